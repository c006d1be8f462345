"""The schema-evolution guard.

A schema change is safe when data written with every released version can be
read with the current schema (new readers, old data: backward) and data
written with the current schema can be read with every released version (old
readers still running during a rolling deploy, new data: forward). We prove it
the direct way: write sample records with one schema and resolve them with
the other, through fastavro's schema resolution, for every union branch.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import fastavro

from schemas.codec import schema_fingerprint
from schemas.events import EVENT_TYPES, RELEASED_DIR

PRIMITIVE_SAMPLES = {
    "null": None,
    "boolean": True,
    "int": 7,
    "long": 1_700_000_000_123,
    "float": 0.5,
    "double": -1.25,
    "bytes": b"\x00\x01",
    "string": "sample",
}


def sample_records(schema: dict) -> list[dict]:
    """Records that together take every union branch and enum symbol of ``schema``."""
    variants = max(_branch_count(schema), 1)
    return [_sample(schema, i) for i in range(variants)]


def _branch_count(schema) -> int:
    if isinstance(schema, list):
        return max([len(schema)] + [_branch_count(s) for s in schema])
    if isinstance(schema, dict):
        t = schema["type"]
        if t == "record":
            return max([1] + [_branch_count(f["type"]) for f in schema["fields"]])
        if t == "enum":
            return len(schema["symbols"])
        if t == "array":
            return _branch_count(schema["items"])
        if t == "map":
            return _branch_count(schema["values"])
        return _branch_count(t) if isinstance(t, (list, dict)) else 1
    return 1


def _sample(schema, variant: int):
    if isinstance(schema, list):  # union: take the variant-th branch
        return _sample(schema[variant % len(schema)], variant)
    if isinstance(schema, str):
        return PRIMITIVE_SAMPLES[schema]
    t = schema["type"]
    if t == "record":
        return {f["name"]: _sample(f["type"], variant) for f in schema["fields"]}
    if t == "enum":
        return schema["symbols"][variant % len(schema["symbols"])]
    if t == "array":
        return [_sample(schema["items"], variant), _sample(schema["items"], variant + 1)]
    if t == "map":
        return {"a": _sample(schema["values"], variant)}
    if t == "fixed":
        return b"\x00" * schema["size"]
    if schema.get("logicalType") == "uuid":
        return "00000000-0000-4000-8000-000000000000"
    return _sample(t, variant)


def cannot_read(writer: dict, reader: dict) -> str | None:
    """Why ``reader`` cannot read data written with ``writer``, or None if it can."""
    try:
        w = fastavro.parse_schema(writer)
        r = fastavro.parse_schema(reader)
    except Exception as exc:  # SchemaParseException: not a valid schema at all
        return f"invalid schema: {exc}"
    for record in sample_records(w):
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, w, record)
        buf.seek(0)
        try:
            fastavro.schemaless_reader(buf, w, r)
        except Exception as exc:  # SchemaResolutionError and friends
            return f"{type(exc).__name__}: {exc}"
    return None


def evolution_problems(current: dict, released: list[tuple[int, dict]]) -> list[str]:
    """Every way ``current`` breaks compatibility with a released version."""
    problems = []
    for version, old in released:
        backward = cannot_read(old, current)
        if backward:
            problems.append(f"v{version} data unreadable by the current schema: {backward}")
        forward = cannot_read(current, old)
        if forward:
            problems.append(f"current data unreadable by v{version} readers: {forward}")
    return problems


def load_schema(path: Path) -> dict:
    return json.loads(path.read_text())


def check_all() -> dict[str, list[str]]:
    """Evolution problems of every event type's current schema against its released versions."""
    return {
        name: evolution_problems(et.schema_json, [(v, load_schema(p)) for v, p in et.released_versions()])
        for name, et in EVENT_TYPES.items()
    }


def unreleased() -> list[str]:
    """Event types whose current schema is not (yet) a released version."""
    names = []
    for name, et in EVENT_TYPES.items():
        released = {schema_fingerprint(fastavro.parse_schema(load_schema(p))) for _, p in et.released_versions()}
        if schema_fingerprint(et.schema) not in released:
            names.append(name)
    return names


def release() -> list[Path]:
    """Keep every changed current schema as its next released version (refusing breaking changes)."""
    problems = {name: p for name, p in check_all().items() if p}
    if problems:
        raise ValueError("breaking schema changes:\n" + "\n".join(f"{n}: {'; '.join(p)}" for n, p in problems.items()))
    written = []
    for name in unreleased():
        versions = EVENT_TYPES[name].released_versions()
        path = RELEASED_DIR / f"{name}.v{(versions[-1][0] if versions else 0) + 1}.avsc"
        path.write_text(EVENT_TYPES[name].schema_path.read_text())
        written.append(path)
    return written
