"""The guard that keeps old data readable, and a check of the guard itself."""

import copy

import pytest

from schemas.compat import check_all, evolution_problems, sample_records, unreleased
from schemas.events import EVENT_TYPES, NAMESPACE


def test_current_schemas_read_and_are_read_by_every_release():
    assert check_all() == {name: [] for name in EVENT_TYPES}


def test_every_current_schema_is_released():
    # A changed schema must be kept as a new release (`tabloop schemas release`),
    # so the data it writes stays decodable by fingerprint forever.
    assert unreleased() == []
    for et in EVENT_TYPES.values():
        assert et.released_versions(), f"{et.name} has no released version"


def test_schemas_carry_the_design_fields():
    common = {"event_id", "project_id"}
    for et in EVENT_TYPES.values():
        assert et.schema_json["namespace"] == NAMESPACE
        assert common <= et.field_names
        assert et.time_field in et.field_names
    assert {"completion_id", "policy_version", "prompt_sha256", "completion_token_ids", "completion_logprobs",
            "aborted", "ttft_ms", "replica_id"} <= EVENT_TYPES["CompletionServed"].field_names
    assert {"source", "client_completion_id", "outcome", "cache_hit", "raw_payload"} <= \
        EVENT_TYPES["FeedbackReceived"].field_names
    assert {"behaviour_logprobs", "reward", "reward_components", "matched"} <= EVENT_TYPES["Episode"].field_names
    assert {"version", "parent_version", "source_offsets", "status", "sha256"} <= \
        EVENT_TYPES["WeightVersion"].field_names


def _changed(name, change):
    schema = copy.deepcopy(EVENT_TYPES[name].schema_json)
    change(schema)
    return schema, [(1, EVENT_TYPES[name].schema_json)]


def _field(schema, name):
    return next(f for f in schema["fields"] if f["name"] == name)


@pytest.mark.parametrize(
    "what,name,change,expect",
    [
        ("removed field without default", "FeedbackReceived",
         lambda s: s["fields"].remove(_field(s, "source")), "unreadable by v1 readers"),
        ("changed type", "CompletionServed",
         lambda s: _field(s, "policy_version").update(type="string"), "v1 data unreadable"),
        ("added field without default", "Episode",
         lambda s: s["fields"].append({"name": "team", "type": "string"}), "v1 data unreadable"),
        ("removed enum symbol", "WeightVersion",
         lambda s: _field(s, "status")["type"]["symbols"].remove("ROLLED_BACK"), "v1 data unreadable"),
        ("nullable made required", "FeedbackReceived",
         lambda s: (_field(s, "prompt").update(type="string"), _field(s, "prompt").pop("default")), "unreadable"),
        ("invalid default", "FeedbackReceived",
         lambda s: _field(s, "prompt").update(type="string"), "invalid schema"),
    ],
)
def test_guard_catches_breaking_changes(what, name, change, expect):
    current, released = _changed(name, change)
    problems = evolution_problems(current, released)
    assert problems, f"the guard missed: {what}"
    assert any(expect in p for p in problems), problems


def test_guard_accepts_compatible_changes():
    def add_defaulted(s):
        s["fields"].append({"name": "team", "type": ["null", "string"], "default": None})
        s["fields"].append({"name": "attempt", "type": "int", "default": 0})

    current, released = _changed("CompletionServed", add_defaulted)
    assert evolution_problems(current, released) == []
    # Removing a field that had a default is fine both ways, too.
    current, released = _changed("FeedbackReceived", lambda s: s["fields"].remove(_field(s, "model_name")))
    assert evolution_problems(current, released) == []


def test_samples_take_every_union_branch_and_enum_symbol():
    samples = sample_records(EVENT_TYPES["Episode"].schema_json)
    assert {s["outcome"] for s in samples} == {"ACCEPTED", "REJECTED", "PARTIAL", "IGNORED"}
    assert {s["policy_version"] is None for s in samples} == {True, False}


def test_episodes_and_completions_written_before_the_sampling_fields_read_with_their_defaults():
    # Data written before prompt ids, temperature and top_p were recorded stays readable: no prompt ids
    # (the trainer re-encodes the prompt) and the T=1, full-vocabulary distribution old engines recorded.
    import io
    import json

    import fastavro

    from schemas.codec import SINGLE_OBJECT_MAGIC, Codec, schema_fingerprint
    from schemas.events import RELEASED_DIR
    from schemas.examples import example_event

    codec = Codec()
    for name, version, new in (("Episode", 2, {"prompt_token_ids", "temperature", "top_p", "prompt_sha256"}),
                               ("CompletionServed", 1, {"prompt_token_ids", "requested_temperature",
                                                        "completion_token_ends"})):
        old = fastavro.parse_schema(json.loads((RELEASED_DIR / f"{name}.v{version}.avsc").read_text()))
        record = {k: v for k, v in example_event(name).record.items() if k not in new}
        out = io.BytesIO(SINGLE_OBJECT_MAGIC + schema_fingerprint(old))
        out.seek(0, io.SEEK_END)
        fastavro.schemaless_writer(out, old, record)
        read = codec.decode(out.getvalue()).record
        assert read["prompt_token_ids"] == []
        if name == "Episode":
            assert (read["temperature"], read["top_p"], read["prompt_sha256"]) == (1.0, 1.0, None)
        else:
            assert read["requested_temperature"] is None and read["temperature"] == 0.2
            assert read["completion_token_ends"] == []  # the join then keeps the tokens as served
