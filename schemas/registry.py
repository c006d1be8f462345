"""A client for a Confluent-compatible schema registry (REST API v1).

Used by the codec when ``TABLOOP_SCHEMA_REGISTRY_URL`` is set: schemas are
registered under the TopicNameStrategy subject (``<topic>-value``) and looked
up by id when decoding. Both answers are cached: ids are immutable.
"""

from __future__ import annotations

import httpx

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


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
            raise LookupError(f"schema id {schema_id} not found in {self.url}")
        schema = resp.json()["schema"]
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
