"""A client for a Confluent-compatible schema registry (REST API v1).

Used by the codec when ``TABLOOP_SCHEMA_REGISTRY_URL`` is set: schemas are
registered under the TopicNameStrategy subject (``<topic>-value``) and looked
up by id when decoding. Both answers are cached: ids are immutable.

Credentials in the URL (``https://user:password@host``) become HTTP basic auth
and never appear in a message: ``url`` is the URL without them. The client
holds an HTTP connection pool: ``close()`` it with the process that owns it.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import httpx

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
SCHEMA_NOT_FOUND = 40403
"""Confluent's error code for an id no schema has (Apicurio's compatibility API answers the same)."""


class SchemaRegistryError(RuntimeError):
    pass


class ConfluentSchemaRegistry:
    def __init__(self, url: str, *, auth: tuple[str, str] | None = None, timeout_s: float = 10.0):
        self.url, in_url = without_credentials(url.rstrip("/"))
        auth = auth or in_url
        self._secrets = [x for x in (auth or ()) if x]
        self._http = httpx.Client(base_url=self.url, auth=auth, timeout=timeout_s,
                                  headers={"Accept": CONTENT_TYPE})
        self._ids: dict[tuple[str, str], int] = {}
        self._schemas: dict[int, str] = {}

    @property
    def closed(self) -> bool:
        return self._http.is_closed

    def close(self) -> None:
        self._http.close()

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def id_for(self, subject: str, schema: str) -> int:
        cached = self._ids.get((subject, schema))
        if cached is not None:
            return cached
        resp = self._call("POST", f"/subjects/{subject}/versions",
                          json={"schema": schema, "schemaType": "AVRO"})
        schema_id = int(resp.json()["id"])
        self._ids[(subject, schema)] = schema_id
        self._schemas[schema_id] = schema
        return schema_id

    def schema_for(self, schema_id: int) -> str:
        cached = self._schemas.get(schema_id)
        if cached is not None:
            return cached
        resp = self._call("GET", f"/schemas/ids/{schema_id}", missing_ok=True)
        if resp.status_code == 404:
            # Only the registry's own "schema not found" means the id is unknown. Any other 404 (a URL
            # missing Apicurio's /apis/ccompat/v7, a proxy) is the registry's fault: were it taken for an
            # unknown id, every event would be dead-lettered as unreadable instead of the consumer stopping.
            if _error_code(resp) != SCHEMA_NOT_FOUND:
                raise SchemaRegistryError(f"schema registry {self.url}/schemas/ids/{schema_id} answered 404 "
                                          f"without Confluent's error code {SCHEMA_NOT_FOUND} (is the URL "
                                          f"the registry's Confluent API?): {resp.text[:300]}")
            raise LookupError(f"schema id {schema_id} not found in {self.url}")
        body = resp.json()
        if body.get("schemaType", "AVRO") != "AVRO":  # Confluent omits it for Avro
            raise LookupError(f"schema id {schema_id} in {self.url} is a {body['schemaType']} schema, not Avro")
        schema = body["schema"]
        self._schemas[schema_id] = schema
        return schema

    def _call(self, method: str, path: str, *, missing_ok: bool = False, **kwargs) -> httpx.Response:
        try:
            resp = self._http.request(method, path, headers={"Content-Type": CONTENT_TYPE}, **kwargs)
        except httpx.HTTPError as exc:
            raise SchemaRegistryError(f"schema registry {self.url} unreachable: {self._redact(str(exc))}") from None
        if resp.status_code == 404 and missing_ok:
            return resp
        if resp.status_code >= 400:
            raise SchemaRegistryError(
                f"schema registry {self.url}{path} answered {resp.status_code}: {self._redact(resp.text[:300])}"
            )
        return resp


def without_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """``url`` without its ``user:password@`` part, and that part (None without one)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    from urllib.parse import unquote

    return (urlunsplit(parts._replace(netloc=netloc)),
            (unquote(parts.username or ""), unquote(parts.password or "")))


def _error_code(resp: httpx.Response) -> int | None:
    try:
        return int(resp.json().get("error_code"))
    except (ValueError, TypeError, AttributeError):
        return None
