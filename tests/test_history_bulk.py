"""The sink's bulk path (Avro bodies read by the engine) stores exactly what decoding here stores.

No broker: messages are built as the consumer would hand them over (undecoded), for every event type."""

from __future__ import annotations

import random

from infra.bus import Received
from schemas.codec import Codec
from schemas.examples import example_event
from streams.history.sink import EVENT_FOR_TABLE, TABLE_FOR_EVENT, HistorySink
from tests.conftest import make_settings
from tests.history_fixture import new_store


class _NoConsumer:
    """Stands in for the Kafka consumer: store_batch only needs its codec."""

    def __init__(self):
        self.codec = Codec()

    def close(self):
        pass


def _messages(n_per_type: int, seed: int = 3) -> list[Received]:
    rng, codec, out = random.Random(seed), Codec(), []
    for type_name, table in TABLE_FOR_EVENT.items():
        for i in range(n_per_type):
            event = example_event(type_name, i, rng, prompt_size=300, tokens=9)
            if type_name == "CompletionServed" and i % 2:
                event.record["suffix"], event.record["requested_temperature"] = "\n}\n", 0.5
            out.append(Received(f"t.{table}", i % 2, i, b"k", codec.encode(event), None, None))
    return out


def _rows(store, table: str) -> list:
    return store.query(f"SELECT * EXCEPT _stored_at FROM {store.database}.{table} ORDER BY _partition, _offset",
                       read_only=False).rows


def _sink(tmp_path, store) -> HistorySink:
    topics = {f"t.{table}": table for table in EVENT_FOR_TABLE}
    return HistorySink(make_settings(tmp_path), store, topics, consumer=_NoConsumer())


def test_bulk_rows_equal_decoded_rows_for_every_event_type(tmp_path):
    messages = _messages(6)
    bulk, decoded = new_store(), new_store()
    assert _sink(tmp_path, bulk).store_batch(messages) == {t: 6 for t in EVENT_FOR_TABLE}
    # the same messages decoded here first: the path every message took before the bulk path
    codec = Codec()
    as_events = [Received(r.topic, r.partition, r.offset, r.key, r.value, codec.decode(r.value), None)
                 for r in messages]
    _sink(tmp_path, decoded).store_batch(as_events)
    for table in EVENT_FOR_TABLE:
        got, want = _rows(bulk, table), _rows(decoded, table)
        assert len(got) == 6 and got == want, table


def test_a_bad_body_behind_a_good_header_is_rejected_alone_and_nothing_stored_twice(tmp_path):
    # Every table in the batch: the completions' insert fails, the others are stored as they are.
    messages = _messages(8)
    at = next(i for i, m in enumerate(messages) if m.topic == "t.completions" and m.offset == 3)
    broken = messages[at]
    messages[at] = Received(broken.topic, broken.partition, broken.offset, broken.key, broken.value[:-7], None, None)
    store = new_store()
    sink = _sink(tmp_path, store)
    stored = {table: 7 if table == "completions" else 8 for table in EVENT_FOR_TABLE}
    assert sink.store_batch(messages) == stored
    assert {table: store.count(table) for table in EVENT_FOR_TABLE} == stored
    assert store.count("rejects") == 1
    (error,) = store.query(f"SELECT error FROM {store.database}.rejects", read_only=False).rows[0]
    assert "Truncated" in error or "Corrupt" in error


def test_insert_files_leave_nothing_behind_and_a_killed_sinks_files_go_when_a_store_opens(tmp_path):
    """Into the embedded engine a batch goes through a file in its data directory: removed after each insert,
    and one a sink killed mid-insert left (named by another process's id) is removed by the next store."""
    import os
    from pathlib import Path

    from tests.history_fixture import shared_client

    folder = Path(shared_client().path) / "tabloop-inserts"
    folder.mkdir(exist_ok=True)
    leftover, ours = folder / "4194305-killed.avro", folder / f"{os.getpid()}-in-flight.avro"
    leftover.write_bytes(b"half an insert")
    ours.write_bytes(b"an insert of this process")
    store = new_store()
    assert not leftover.exists() and ours.exists()  # another process's file is a leftover; ours may be in use
    ours.unlink()
    assert _sink(tmp_path, store).store_batch(_messages(4)) == {table: 4 for table in EVENT_FOR_TABLE}
    assert list(folder.iterdir()) == []
