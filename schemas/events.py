"""The event types: their Avro schemas, Kafka keys and event-time fields.

An event is a plain record (a dict shaped by its Avro schema) tagged with its
type name. ``new_event`` fills the envelope every event shares (``event_id``
and the event time); the codec turns events into bytes and back.
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import fastavro

from schemas.topics import TOPIC_FOR_EVENT

NAMESPACE = "tabloop.v1"
AVRO_DIR = Path(__file__).parent / "avro"
RELEASED_DIR = AVRO_DIR / "released"


@dataclass(frozen=True)
class EventType:
    name: str
    time_field: str
    key_of: Callable[[dict], str]
    """The Kafka key: the join key the event's consumer groups it by."""

    @property
    def full_name(self) -> str:
        return f"{NAMESPACE}.{self.name}"

    @property
    def topic(self) -> str:
        return TOPIC_FOR_EVENT[self.name].name

    @property
    def schema_path(self) -> Path:
        return AVRO_DIR / f"{self.name}.avsc"

    @cached_property
    def schema_json(self) -> dict:
        return json.loads(self.schema_path.read_text())

    @cached_property
    def schema(self) -> dict:
        """The current schema, parsed by fastavro (what every reader resolves to)."""
        return fastavro.parse_schema(self.schema_json)

    @cached_property
    def field_names(self) -> frozenset[str]:
        return frozenset(f["name"] for f in self.schema_json["fields"])

    @cached_property
    def defaults(self) -> dict[str, Any]:
        return {f["name"]: _default_value(f) for f in self.schema_json["fields"] if "default" in f}

    @cached_property
    def required_fields(self) -> frozenset[str]:
        return frozenset(f["name"] for f in self.schema_json["fields"] if "default" not in f)

    def released_versions(self) -> list[tuple[int, Path]]:
        """Every released version of this schema, oldest first."""
        found = []
        for path in RELEASED_DIR.glob(f"{self.name}.v*.avsc"):
            found.append((int(path.stem.rsplit(".v", 1)[1]), path))
        return sorted(found)


def _default_value(field: dict) -> Any:
    """A field's default as a record holds it: a ``bytes`` default is JSON text (one char a byte, per the Avro
    spec), which the codec would refuse as a value."""
    if field["type"] == "bytes":
        return field["default"].encode("latin-1")
    return field["default"]


def user_key(r: dict) -> str:
    """Completions and feedback are keyed by who they are for: every join rule (our id, the prompt hash,
    generator reuse) pairs events of one project and user, so the streams worker decides each inside one
    partition (``streams.app``). Before issue 32 completions were keyed by completion id and feedback by
    completion id or prompt hash; the worker moves what it finds under those keys (``streams.app``)."""
    return f"{r['project_id']}/{r['user_id']}"


EVENT_TYPES: dict[str, EventType] = {
    t.name: t
    for t in (
        EventType("CompletionServed", "served_at", user_key),
        EventType("FeedbackReceived", "received_at", user_key),
        EventType("Episode", "joined_at", lambda r: r["completion_id"]),
        # One key per (base model, version): compaction keeps the latest status of every version,
        # so the topic still holds the whole history a replica (or `tabloop weights list`) folds.
        EventType("WeightVersion", "created_at", lambda r: f"{r['base_model']}@v{r['version']}"),
        EventType("GateVersion", "created_at", lambda r: f"{r['project_id']}@g{r['version']}"),
        EventType(
            "DeadLetter",
            "at",
            lambda r: f"{r['source_topic']}/{r['source_partition']}/{r['source_offset']}",
        ),
    )
}


def event_type(name: str) -> EventType:
    try:
        return EVENT_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown event type {name!r}; known: {', '.join(EVENT_TYPES)}") from None


@dataclass(slots=True)
class Event:
    """One typed fact: ``type`` names its schema, ``record`` holds its fields."""

    type: str
    record: dict[str, Any]

    @property
    def event_type(self) -> EventType:
        return EVENT_TYPES[self.type]

    @property
    def key(self) -> str:
        return self.event_type.key_of(self.record)

    @property
    def topic(self) -> str:
        return self.event_type.topic

    @property
    def event_id(self) -> str:
        return self.record["event_id"]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready view: datetimes as ISO-8601, bytes as hex."""
        return {"type": self.type, "event": {k: _jsonable(v) for k, v in self.record.items()}}


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def now() -> datetime:
    """The current time at the precision events store (timestamp-millis)."""
    t = datetime.now(timezone.utc)
    return t.replace(microsecond=t.microsecond - t.microsecond % 1000)


def new_event(type_name: str, **fields: Any) -> Event:
    """Build an event, filling ``event_id``, the event time and defaulted fields when not given.

    Raises ValueError naming unknown or missing fields; value types are checked
    by the codec when the event is encoded.
    """
    et = event_type(type_name)
    unknown = fields.keys() - et.field_names
    if unknown:
        raise ValueError(f"{type_name} has no field(s) {', '.join(sorted(unknown))}")
    fields.setdefault("event_id", str(uuid.uuid4()))
    fields.setdefault(et.time_field, now())
    for name, default in et.defaults.items():
        if name not in fields:
            fields[name] = copy.copy(default)
    missing = et.required_fields - fields.keys()
    if missing:
        raise ValueError(f"{type_name} is missing required field(s) {', '.join(sorted(missing))}")
    return Event(type_name, fields)
