"""A client for a Confluent-compatible schema registry (REST API v1).

Used by the codec when ``TABLOOP_SCHEMA_REGISTRY_URL`` is set: schemas are
registered under the TopicNameStrategy subject (``<topic>-value``) and looked
up by id when decoding. Both answers are cached: ids are immutable.
"""

from __future__ import annotations

import httpx

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
SCHEMA_NOT_FOUND = 40403
"""Confluent's error code for an id no schema has (Apicurio's compatibility API answers the same)."""


class SchemaRegistryError(RuntimeError):
    pass


class ConfluentSchemaRegistry:
    def __init__(self, url: str, *, auth: tuple[str, str] | None = None, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, auth=auth, timeout=timeout_s,
                                  headers={"Accept": CONTENT_TYPE})
        self._ids: dict[tuple[str, str], int] = {}
        self._schemas: dict[int, str] = {}

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
            raise SchemaRegistryError(f"schema registry {self.url} unreachable: {exc}") from exc
        if resp.status_code == 404 and missing_ok:
            return resp
        if resp.status_code >= 400:
            raise SchemaRegistryError(
                f"schema registry {self.url}{path} answered {resp.status_code}: {resp.text[:300]}"
            )
        return resp


def _error_code(resp: httpx.Response) -> int | None:
    try:
        return int(resp.json().get("error_code"))
    except (ValueError, TypeError, AttributeError):
        return None
