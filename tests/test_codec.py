import io
import json
import random
import struct

import fastavro
import pytest

from schemas.codec import (CONFLUENT_MAGIC, Codec, CorruptEventError, EventDecodeError, EventEncodeError,
                           TruncatedEventError, UnknownSchemaError, schema_fingerprint)
from schemas.events import EVENT_TYPES, new_event
from schemas.examples import example_event


class DictRegistry:
    """The SchemaRegistry protocol over a dict: ids in registration order, like a registry assigns them."""

    def __init__(self, first_id: int = 100):
        self.by_id: dict[int, str] = {}
        self.next_id = first_id

    def id_for(self, subject, schema):
        for i, s in self.by_id.items():
            if s == schema:
                return i
        self.by_id[self.next_id] = schema
        self.next_id += 1
        return self.next_id - 1

    def schema_for(self, schema_id):
        try:
            return self.by_id[schema_id]
        except KeyError:
            raise LookupError(schema_id) from None


def float32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def expected_after_round_trip(record: dict) -> dict:
    """Avro `float` keeps float32 precision; everything else comes back as written."""
    out = dict(record)
    for key in ("completion_logprobs", "behaviour_logprobs"):
        if key in out:
            out[key] = [float32(x) for x in out[key]]
    return out


@pytest.mark.parametrize("type_name", list(EVENT_TYPES))
def test_round_trip_single_object(type_name):
    codec = Codec()
    for i in range(20):
        event = example_event(type_name, i)
        data = codec.encode(event)
        assert data[:2] == b"\xc3\x01"
        assert data[2:10] == schema_fingerprint(EVENT_TYPES[type_name].schema)
        back = codec.decode(data)
        assert back.type == type_name
        assert back.record == expected_after_round_trip(event.record)


@pytest.mark.parametrize("type_name", list(EVENT_TYPES))
def test_round_trip_confluent(type_name):
    registry = DictRegistry()
    codec = Codec(registry)
    event = example_event(type_name, 3)
    data = codec.encode(event)
    assert data[:1] == CONFLUENT_MAGIC
    schema_id = int.from_bytes(data[1:5], "big")
    assert json.loads(registry.schema_for(schema_id))["name"] == type_name
    # Any codec that can reach the registry decodes it; the default one too.
    assert Codec(registry).decode(data).record == expected_after_round_trip(event.record)
    # A single-object codec still reads Confluent bytes it has a registry for, and vice versa.
    assert codec.decode(Codec().encode(event)).record == expected_after_round_trip(event.record)


def test_confluent_bytes_without_registry_or_unknown_id():
    data = Codec(DictRegistry()).encode(example_event("Episode"))
    with pytest.raises(UnknownSchemaError, match="no schema registry"):
        Codec().decode(data)
    with pytest.raises(UnknownSchemaError, match="not in the registry"):
        Codec(DictRegistry(first_id=500)).decode(data)


def test_registry_schema_that_is_not_ours():
    registry = DictRegistry()
    foreign = json.dumps({"type": "record", "name": "Other", "namespace": "acme", "fields": []})
    schema_id = registry.id_for("x-value", foreign)
    with pytest.raises(UnknownSchemaError, match="not a tabloop event"):
        Codec(registry).decode(CONFLUENT_MAGIC + schema_id.to_bytes(4, "big"))


def test_avro_spec_fingerprint_vector():
    # The Avro specification's single-object example: schema "int" → C3 01 8F 5C 39 3F 1A D5 75 72.
    assert schema_fingerprint(fastavro.parse_schema("int")) == bytes.fromhex("8f5c393f1ad57572")


def test_every_truncation_is_a_truncated_error():
    codec = Codec()
    data = codec.encode(example_event("FeedbackReceived", 1))
    for cut in range(len(data)):
        with pytest.raises(TruncatedEventError):
            codec.decode(data[:cut])


def test_unknown_fingerprint():
    data = bytearray(Codec().encode(example_event("WeightVersion")))
    data[5] ^= 0xFF
    with pytest.raises(UnknownSchemaError, match="fingerprint"):
        Codec().decode(bytes(data))


def test_corrupt_inputs():
    codec = Codec()
    good = codec.encode(example_event("FeedbackReceived", 2))
    with pytest.raises(CorruptEventError, match="left over"):
        codec.decode(good + b"\x00")
    with pytest.raises(CorruptEventError, match="wire format"):
        codec.decode(b"{\"json\": true}")
    # The `outcome` enum index lies past its 3 symbols.
    et = EVENT_TYPES["FeedbackReceived"]
    record = dict(example_event("FeedbackReceived", 2).record)
    header = good[:10]
    body = io.BytesIO()
    fastavro.schemaless_writer(body, et.schema, record)
    fields = [f["name"] for f in et.schema_json["fields"]]
    # Re-encode with a schema whose outcome enum has more symbols, writing the 5th one.
    wider = json.loads(json.dumps(et.schema_json))
    wider["fields"][fields.index("outcome")]["type"]["symbols"] += ["X", "Y"]
    record["outcome"] = "Y"
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(wider), record)
    with pytest.raises(CorruptEventError):
        codec.decode(header + body.getvalue())
    # Invalid UTF-8 in a string field (project_id comes right after event_id and received_at).
    bad = bytearray(good)
    start = good.index(record["project_id"].encode())
    bad[start] = 0xFF
    with pytest.raises(CorruptEventError):
        codec.decode(bytes(bad))
    with pytest.raises(CorruptEventError, match="expected bytes"):
        codec.decode("not bytes")


def test_random_mutations_never_escape_the_typed_error():
    codec = Codec()
    rng = random.Random(7)
    blobs = [codec.encode(example_event(t, i)) for i, t in enumerate(EVENT_TYPES)]
    decoded = failed = 0
    for _ in range(3000):
        data = bytearray(rng.choice(blobs))
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            codec.decode(bytes(data))
            decoded += 1
        except EventDecodeError:
            failed += 1
    assert failed > 0 and decoded + failed == 3000


def test_encode_errors_name_the_field():
    codec = Codec()
    event = example_event("CompletionServed")
    event.record["policy_version"] = "seven"
    with pytest.raises(EventEncodeError, match="policy_version"):
        codec.encode(event)
    del event.record["prompt"]
    with pytest.raises(EventEncodeError, match="missing required field.*prompt"):
        codec.encode(event)


def test_new_event_checks_fields():
    with pytest.raises(ValueError, match="no field.*colour"):
        new_event("DeadLetter", colour="red")
    with pytest.raises(ValueError, match="missing required.*source_topic"):
        new_event("DeadLetter", source_partition=0, source_offset=1, raw=b"", error="x")
    with pytest.raises(ValueError, match="unknown event type"):
        new_event("Nope")
    e = new_event("DeadLetter", source_topic="t", source_partition=0, source_offset=1, raw=b"", error="x")
    assert len(e.event_id) == 36 and e.record["at"].microsecond % 1000 == 0
    assert e.key == "t/0/1" and e.topic == "tabloop.deadletter"


def test_completions_and_feedback_are_keyed_by_project_and_user_whatever_they_name():
    """One key for everything one user's join needs (streams.app decides each join inside one partition)."""
    completion, feedback = example_event("CompletionServed"), example_event("FeedbackReceived")
    feedback.record.update(project_id=completion.record["project_id"], user_id=completion.record["user_id"])
    assert completion.key == feedback.key == f"{completion.record['project_id']}/{completion.record['user_id']}"
    feedback.record["completion_id"] = "cmpl-1"
    assert feedback.key == completion.key
    feedback.record["user_id"] = "someone-else"
    assert feedback.key != completion.key


def test_data_written_with_an_older_release_reads_as_current():
    # An "older release" of FeedbackReceived that lacked two defaulted fields.
    current = EVENT_TYPES["FeedbackReceived"].schema_json
    older = json.loads(json.dumps(current))
    older["fields"] = [f for f in older["fields"] if f["name"] not in ("model_name", "cache_hit")]
    codec = Codec(released=[("FeedbackReceived", older)])
    record = {k: v for k, v in example_event("FeedbackReceived").record.items() if k not in ("model_name", "cache_hit")}
    parsed_older = fastavro.parse_schema(older)
    body = io.BytesIO()
    fastavro.schemaless_writer(body, parsed_older, record)
    data = b"\xc3\x01" + schema_fingerprint(parsed_older) + body.getvalue()
    event = codec.decode(data)
    assert event.record["model_name"] is None and event.record["cache_hit"] is False
    assert event.record["prompt"] == record["prompt"]
    with pytest.raises(UnknownSchemaError):  # a codec that doesn't know that release
        Codec(released=[]).decode(data)
