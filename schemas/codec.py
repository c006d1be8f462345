"""The one codec: events to bytes and back, in either Avro wire format.

- Avro single-object encoding (default, no registry needed):
  ``C3 01`` + 8-byte little-endian CRC-64-AVRO fingerprint of the writer
  schema's canonical form + the Avro body.
- Confluent wire format (when a schema registry is configured):
  ``00`` + 4-byte big-endian schema id + the Avro body.

Decoding recognises both, whatever the codec writes. Data written with any
released version of a schema is resolved to the current one, so old events
stay readable after the schema evolves.
"""

from __future__ import annotations

import io
import json
from typing import Iterable, Protocol

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form
from fastavro.validation import validate

from schemas.events import EVENT_TYPES, Event

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = b"\x00"
SINGLE_OBJECT_HEADER_LEN = 10
CONFLUENT_HEADER_LEN = 5


class EventDecodeError(Exception):
    """Bytes that are not a tabloop event this codec can read."""


class UnknownSchemaError(EventDecodeError):
    """The header names a schema (fingerprint or registry id) we don't know."""


class TruncatedEventError(EventDecodeError):
    """The bytes end before the event does."""


class CorruptEventError(EventDecodeError):
    """The bytes are not a valid encoding of the schema they claim."""


class EventEncodeError(ValueError):
    """An event whose fields don't fit its schema."""


class SchemaRegistry(Protocol):
    """What the Confluent wire format needs from a schema registry."""

    def id_for(self, subject: str, schema: str) -> int: ...

    def schema_for(self, schema_id: int) -> str: ...


def schema_fingerprint(parsed_schema: dict) -> bytes:
    """CRC-64-AVRO of the Parsing Canonical Form, little-endian (as on the wire)."""
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(parsed_schema), "CRC-64-AVRO"))


class _Writer:
    """A schema that data may have been written with, and how to read it."""

    __slots__ = ("type_name", "schema", "reader", "bytes_defaults")

    def __init__(self, type_name: str, schema: dict, reader: dict | None):
        self.type_name = type_name
        self.schema = schema
        self.reader = reader  # None when the writer is the current schema
        # fastavro fills a bytes field the writer lacked with its JSON default, text: bytes, as when written
        # (e.g. prompt_token_ids_packed of an event written before it), so the record encodes again.
        self.bytes_defaults = {} if reader is None else {
            name: value for name, value in EVENT_TYPES[type_name].defaults.items()
            if isinstance(value, bytes) and name not in {f["name"] for f in schema["fields"]}}


class Codec:
    def __init__(self, registry: SchemaRegistry | None = None,
                 released: Iterable[tuple[str, dict]] | None = None):
        """``released``: (type name, schema JSON) pairs data may have been written with;
        by default every released version kept under schemas/avro/released."""
        self.registry = registry
        self._headers: dict[str, bytes] = {}
        self._confluent_headers: dict[str, bytes] = {}
        self._by_fingerprint: dict[bytes, _Writer] = {}
        self._by_registry_id: dict[int, _Writer] = {}
        for name, et in EVENT_TYPES.items():
            current = et.schema
            fp = schema_fingerprint(current)
            self._headers[name] = SINGLE_OBJECT_MAGIC + fp
            self._by_fingerprint[fp] = _Writer(name, current, None)
        if released is None:
            released = [(name, json.loads(path.read_text()))
                        for name, et in EVENT_TYPES.items() for _, path in et.released_versions()]
        for name, schema_json in released:
            old = fastavro.parse_schema(schema_json)
            old_fp = schema_fingerprint(old)
            if old_fp not in self._by_fingerprint:
                self._by_fingerprint[old_fp] = _Writer(name, old, EVENT_TYPES[name].schema)

    def prepare(self) -> None:
        """Look up every event type's schema id now (Confluent format; nothing without a registry), so that
        no encode waits on the registry later: a process calls it at its start."""
        if self.registry is not None:
            for type_name in EVENT_TYPES:
                self._header(type_name)

    def close(self) -> None:
        """Close the registry client, if any (its connections)."""
        close = getattr(self.registry, "close", None)
        if close is not None:
            close()

    @property
    def wire_format(self) -> str:
        return "confluent" if self.registry is not None else "single-object"

    # -- encoding -----------------------------------------------------------

    def encode(self, event: Event) -> bytes:
        et = EVENT_TYPES.get(event.type)
        if et is None:
            raise EventEncodeError(f"unknown event type {event.type!r}")
        out = io.BytesIO()
        out.write(self._header(event.type))
        try:
            fastavro.schemaless_writer(out, et.schema, event.record)
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
            raise EventEncodeError(self._explain(event, exc)) from exc
        return out.getvalue()

    def _header(self, type_name: str) -> bytes:
        header = self._headers[type_name]
        if self.registry is None:
            return header
        # Confluent format: register once per type (TopicNameStrategy subject),
        # then reuse the id; the single-object headers are kept for decoding.
        header = self._confluent_headers.get(type_name)
        if header is None:
            et = EVENT_TYPES[type_name]
            schema_id = self.registry.id_for(f"{et.topic}-value", json.dumps(et.schema_json))
            header = CONFLUENT_MAGIC + schema_id.to_bytes(4, "big")
            self._confluent_headers[type_name] = header
            self._by_registry_id[schema_id] = self._by_fingerprint[self._headers[type_name][2:]]
        return header

    def _explain(self, event: Event, exc: Exception) -> str:
        et = EVENT_TYPES[event.type]
        missing = et.required_fields - event.record.keys()
        if missing:
            return f"{event.type} is missing required field(s) {', '.join(sorted(missing))}"
        try:
            validate(event.record, et.schema, raise_errors=True)
        except Exception as detail:  # fastavro's ValidationError lists the bad fields
            return f"{event.type} does not fit its schema: {detail}"
        return f"{event.type} could not be encoded: {exc}"

    # -- decoding -----------------------------------------------------------

    def current_body_offset(self, data: bytes, type_name: str) -> int | None:
        """Where the Avro body starts when ``data`` carries a ``type_name`` event written with that type's
        current schema (so its body reads as the current schema with no resolution); None otherwise.

        Looks at the header only: a bulk reader (the history sink hands bodies to ClickHouse) uses it to
        pick what it may read without decoding here; everything else goes through ``decode``."""
        if data[:2] == SINGLE_OBJECT_MAGIC:
            header = self._headers.get(type_name)
            return SINGLE_OBJECT_HEADER_LEN if header is not None and data[:SINGLE_OBJECT_HEADER_LEN] == header \
                else None
        if data[:1] == CONFLUENT_MAGIC and len(data) >= CONFLUENT_HEADER_LEN:
            writer = self._by_registry_id.get(int.from_bytes(data[1:CONFLUENT_HEADER_LEN], "big"))
            if writer is None and self.registry is not None:
                try:
                    writer = self._registry_writer(int.from_bytes(data[1:CONFLUENT_HEADER_LEN], "big"))
                except EventDecodeError:
                    return None
            if writer is not None and writer.type_name == type_name and writer.reader is None:
                return CONFLUENT_HEADER_LEN
        return None

    def decode(self, data: bytes) -> Event:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CorruptEventError(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if data[:2] == SINGLE_OBJECT_MAGIC:
            if len(data) < SINGLE_OBJECT_HEADER_LEN:
                raise TruncatedEventError(f"{len(data)} bytes: shorter than the single-object header")
            fp = data[2:SINGLE_OBJECT_HEADER_LEN]
            writer = self._by_fingerprint.get(fp)
            if writer is None:
                raise UnknownSchemaError(f"unknown schema fingerprint {fp.hex()}")
            return self._read(writer, data, SINGLE_OBJECT_HEADER_LEN)
        if data[:1] == CONFLUENT_MAGIC:
            if len(data) < CONFLUENT_HEADER_LEN:
                raise TruncatedEventError(f"{len(data)} bytes: shorter than the Confluent header")
            schema_id = int.from_bytes(data[1:CONFLUENT_HEADER_LEN], "big")
            return self._read(self._registry_writer(schema_id), data, CONFLUENT_HEADER_LEN)
        if len(data) < 2 and SINGLE_OBJECT_MAGIC.startswith(data):
            raise TruncatedEventError(f"{len(data)} bytes: shorter than any header")
        raise CorruptEventError(f"unknown wire format (first bytes {data[:2].hex()})")

    def _read(self, writer: _Writer, data: bytes, offset: int) -> Event:
        body = io.BytesIO(data)
        body.seek(offset)
        try:
            record = fastavro.schemaless_reader(body, writer.schema, writer.reader)
        except EOFError as exc:
            raise TruncatedEventError(f"{writer.type_name}: {exc}") from exc
        except Exception as exc:  # fastavro raises IndexError, UnicodeDecodeError, ... on garbage
            if body.tell() >= len(data):  # it failed for want of bytes (e.g. a varint cut short)
                raise TruncatedEventError(f"{writer.type_name}: ends inside the event ({exc!r})") from exc
            raise CorruptEventError(f"{writer.type_name}: body does not match its schema ({exc!r})") from exc
        if body.tell() != len(data):
            raise CorruptEventError(
                f"{writer.type_name}: {len(data) - body.tell()} bytes left over after the event"
            )
        if writer.bytes_defaults:
            record.update(writer.bytes_defaults)
        return Event(writer.type_name, record)

    def _registry_writer(self, schema_id: int) -> _Writer:
        writer = self._by_registry_id.get(schema_id)
        if writer is not None:
            return writer
        if self.registry is None:
            raise UnknownSchemaError(
                f"Confluent wire format with schema id {schema_id}, but no schema registry is configured"
            )
        try:
            schema_text = self.registry.schema_for(schema_id)
        except LookupError as exc:
            raise UnknownSchemaError(f"schema id {schema_id} is not in the registry") from exc
        try:
            writer_schema = fastavro.parse_schema(json.loads(schema_text))
        except Exception as exc:  # not JSON, or not an Avro schema fastavro can read: not one of our events
            raise UnknownSchemaError(f"schema id {schema_id} is not an Avro schema: {exc!r}"[:300]) from exc
        full_name = writer_schema.get("name", "") if isinstance(writer_schema, dict) else ""
        type_name = full_name.rsplit(".", 1)[-1]
        et = EVENT_TYPES.get(type_name)
        if et is None or not full_name.startswith("tabloop."):
            raise UnknownSchemaError(f"schema id {schema_id} is {full_name!r}, not a tabloop event")
        same = schema_fingerprint(writer_schema) == schema_fingerprint(et.schema)
        writer = _Writer(type_name, writer_schema, None if same else et.schema)
        self._by_registry_id[schema_id] = writer
        return writer
