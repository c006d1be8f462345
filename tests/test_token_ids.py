"""Prompt ids packed as bytes (CompletionServed v5, Episode v8): written packed, read from either field,
old events (the ids in an int array) still decoded, joined, stored, replayed and trained."""

from __future__ import annotations

import io
import json
import random

import fastavro
import pytest

from infra.bus import Received
from schemas.codec import SINGLE_OBJECT_MAGIC, Codec, schema_fingerprint
from schemas.events import EVENT_TYPES, RELEASED_DIR, Event, new_event
from schemas.examples import example_event
from schemas.token_ids import PACKED, pack_ids, packed_field, packed_text, prompt_ids, unpack_ids
from streams.join import JoinPipeline
from rewards.spec import RewardSpecs
from trainer.episodes import episode_sample

IDS = [0, 7, 151_000, 2**32 - 1]


class _NoEncoding:
    """A tokenizer that must not be asked: the sample is built from the ids the event carries."""

    def encode(self, *args, **kwargs):
        raise AssertionError("the prompt was re-encoded instead of trained on the ids that were fed")


def _old_event(type_name: str, version: int, record: dict) -> bytes:
    """``record`` as an event written with a released version of its schema (single-object format)."""
    old = fastavro.parse_schema(json.loads((RELEASED_DIR / f"{type_name}.v{version}.avsc").read_text()))
    body = io.BytesIO()
    fastavro.schemaless_writer(body, old, record)
    return SINGLE_OBJECT_MAGIC + schema_fingerprint(old) + body.getvalue()


def _with_ids_as_array(record: dict) -> dict:
    """``record`` as the versions before packed ids wrote it: the prompt's ids as an array of ints."""
    return {k: v for k, v in record.items() if k != PACKED} | {"prompt_token_ids": prompt_ids(record)}


def _feedback_on(completion: dict) -> dict:
    return new_event("FeedbackReceived", project_id=completion["project_id"], user_id=completion["user_id"],
                     source="continue-fork", completion_id=completion["completion_id"], prompt=None,
                     prompt_sha256=None, completion=None, outcome="ACCEPTED",
                     raw_payload="{}", received_at=completion["served_at"]).record


def _episode_of(completion: dict) -> Event:
    pipe = JoinPipeline(RewardSpecs())
    out = pipe.completion(completion) + pipe.feedback(_feedback_on(completion))
    [episode] = out + pipe.tick()
    return episode


def test_packing_round_trips_little_endian_and_refuses_what_is_not_ids():
    data = pack_ids(IDS)
    assert data == b"".join(i.to_bytes(4, "little") for i in IDS)
    assert unpack_ids(data).tolist() == IDS and pack_ids(unpack_ids(data)) == data
    assert pack_ids([]) == b"" and prompt_ids({PACKED: b"", "prompt_token_ids": []}) == []
    with pytest.raises(OverflowError):
        pack_ids([-1])
    with pytest.raises(OverflowError):
        pack_ids([2**32])
    with pytest.raises(ValueError, match="4 bytes each"):
        unpack_ids(data[:-1])
    # How a record may hold them: bytes, base64 text (the streams worker's JSON), numbers (a history column).
    assert packed_field(data) == packed_field(packed_text(data)) == packed_field(IDS) == data
    assert packed_field(None) == packed_field("") == b""
    with pytest.raises(ValueError, match="base64"):
        packed_field(str(data))  # what Faust's JSON would make of the bytes


def test_a_new_completion_is_packed_and_carried_packed_into_its_episode_and_training():
    codec = Codec()
    served = example_event("CompletionServed", 1)
    ids = prompt_ids(served.record)
    assert len(ids) > 500 and served.record["prompt_token_ids"] == []
    completion = codec.decode(codec.encode(served)).record
    assert completion[PACKED] == served.record[PACKED] and prompt_ids(completion) == ids
    episode = _episode_of(completion)
    assert episode.record[PACKED] == completion[PACKED] and episode.record["prompt_token_ids"] == []
    read = codec.decode(codec.encode(episode)).record
    assert prompt_ids(read) == ids
    assert episode_sample(read, _NoEncoding(), max_prompt_tokens=2048).prompt_ids == ids


def test_the_streams_worker_json_carries_packed_ids_through_to_the_encoded_episode():
    from faust.serializers import codecs

    from streams.app import plain
    from rewards.scoring import rescored

    codec = Codec()
    completion = codec.decode(codec.encode(example_event("CompletionServed", 2))).record
    via_json = codecs.loads("json", codecs.dumps("json", plain(completion)))  # by-completion, completion-state
    assert isinstance(via_json[PACKED], str)
    episode = _episode_of(via_json)
    assert episode.record[PACKED] == completion[PACKED]
    # The scoring stage gets the episode as JSON too, and encodes what rescored gives back.
    record = codecs.loads("json", codecs.dumps("json", plain(episode.record)))
    record = rescored(record, RewardSpecs().for_project(record["project_id"]), {}, {})
    record["joined_at"] = episode.record["joined_at"]
    assert prompt_ids(codec.decode(codec.encode(Event("Episode", record))).record) == prompt_ids(completion)


def test_an_old_completion_still_decodes_joins_and_trains_from_its_array():
    codec = Codec()
    served = example_event("CompletionServed", 3).record
    ids = prompt_ids(served)
    completion = codec.decode(_old_event("CompletionServed", 4, _with_ids_as_array(served))).record
    assert completion["prompt_token_ids"] == ids and completion[PACKED] == b""
    assert codec.decode(codec.encode(Event("CompletionServed", completion))).record == completion  # encodes again
    episode = _episode_of(completion)
    assert episode.record["prompt_token_ids"] == ids and episode.record[PACKED] == b""
    read = codec.decode(codec.encode(episode)).record
    assert episode_sample(read, _NoEncoding(), max_prompt_tokens=2048).prompt_ids == ids


def test_an_old_episode_still_trains_and_old_readers_see_new_events_as_ids_not_recorded():
    codec = Codec()
    episode = example_event("Episode", 4).record
    ids = prompt_ids(episode)
    read = codec.decode(_old_event("Episode", 7, _with_ids_as_array(episode))).record
    assert episode_sample(read, _NoEncoding(), max_prompt_tokens=2048).prompt_ids == ids
    # A reader still on v7 (a rolling deploy): the array is empty, which it takes as "re-encode the prompt".
    body = io.BytesIO(codec.encode(Event("Episode", episode))[10:])
    v7_schema = fastavro.parse_schema(json.loads((RELEASED_DIR / "Episode.v7.avsc").read_text()))
    old_view = fastavro.schemaless_reader(body, EVENT_TYPES["Episode"].schema, v7_schema)
    assert old_view["prompt_token_ids"] == [] and PACKED not in old_view


def test_the_sink_stores_packed_and_old_ids_as_numbers_and_replay_gives_them_back(tmp_path):
    from streams.history.replay import Selection, derive_episodes, records_from_clickhouse
    from streams.history.sink import EVENT_FOR_TABLE, HistorySink
    from tests.conftest import make_settings
    from tests.history_fixture import new_store

    codec, rng = Codec(), random.Random(5)
    new = example_event("CompletionServed", 5, rng, prompt_size=300)
    old = example_event("CompletionServed", 6, rng, prompt_size=300)
    old_ids = prompt_ids(old.record)
    old_bytes = _old_event("CompletionServed", 4, _with_ids_as_array(old.record))
    messages = [Received("t.completions", 0, 0, b"k", codec.encode(new), None, None),  # the bulk path
                Received("t.completions", 0, 1, b"k", old_bytes, None, None)]  # decoded here: an older version

    class NoConsumer:
        codec = Codec()

    store = new_store()
    sink = HistorySink(make_settings(tmp_path), store, {f"t.{t}": t for t in EVENT_FOR_TABLE}, consumer=NoConsumer())
    assert sink.store_batch(messages) == {"completions": 2}
    rows = store.query(f"SELECT prompt_token_ids, {PACKED}, toTypeName({PACKED}) FROM {store.database}.completions "
                       "ORDER BY _offset", read_only=False).rows
    assert rows == [[[], prompt_ids(new.record), "Array(UInt32)"], [old_ids, [], "Array(UInt32)"]]
    replayed = {r["event_id"]: r for _, r in records_from_clickhouse(store, Selection())}
    assert replayed[new.event_id][PACKED] == new.record[PACKED]
    assert prompt_ids(replayed[old.event_id]) == old_ids and replayed[old.event_id][PACKED] == b""
    for record in replayed.values():  # what replay publishes encodes, and the episodes keep the ids
        codec.encode(Event("CompletionServed", record))
    episodes = derive_episodes([("CompletionServed", r) for r in replayed.values()]
                               + [("FeedbackReceived", _feedback_on(r)) for r in replayed.values()])
    by_completion = {e.record["completion_id"]: prompt_ids(codec.decode(codec.encode(e)).record) for e in episodes}
    assert by_completion == {new.record["completion_id"]: prompt_ids(new.record),
                             old.record["completion_id"]: old_ids}
