"""Integration tests on the real local Kafka broker (started once per session by the `kafka` fixture)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from concurrent.futures import wait

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import ConfigResource

from infra.bus import (
    EventConsumer,
    EventProducer,
    PublishError,
    TopicSetupError,
    admin_client,
    ensure_topics,
    read_topic,
)
from infra.kafka_broker import KafkaLaunchError, LocalKafka
from schemas.events import EVENT_TYPES
from schemas.examples import example_event
from schemas.topics import CATALOG, Topic
from tests.system_helpers import poll

pytestmark = pytest.mark.kafka
N_PER_TYPE = 10_000


def _topic_state(settings, name):
    admin = admin_client(settings)
    meta = admin.list_topics(name, timeout=10).topics[name]
    res = ConfigResource(ConfigResource.Type.TOPIC, name)
    configs = admin.describe_configs([res])[res].result(10)
    return len(meta.partitions), {k: v.value for k, v in configs.items()}


def fresh_catalog() -> list[Topic]:
    """The catalog under names no other test has used: the session broker is shared, and tests that
    ran before may already have created (and written to) the real topics."""
    suffix = uuid.uuid4().hex[:6]
    return [Topic(f"{t.name}.{suffix}", t.event_type, t.configs, t.partitions) for t in CATALOG]


def test_topics_create_is_idempotent_and_matches_the_catalog(kafka_settings):
    catalog = fresh_catalog()
    first = ensure_topics(kafka_settings, catalog)
    assert sorted(a for a in first if a.endswith("created")) == sorted(f"{t.name}: created" for t in catalog)
    assert ensure_topics(kafka_settings, catalog) == []  # second run: nothing to do
    for t in catalog:
        partitions, configs = _topic_state(kafka_settings, t.name)
        assert partitions == (t.partitions or kafka_settings.topic_partitions)
        for k, v in t.configs.items():
            assert configs[k] == v, (t.name, k)
    by_type = {t.event_type: t.name for t in catalog}
    assert _topic_state(kafka_settings, by_type["WeightVersion"])[1]["cleanup.policy"] == "compact"
    assert _topic_state(kafka_settings, by_type["FeedbackReceived"])[1]["retention.ms"] == "-1"


def test_topics_create_fixes_drift_or_says_why_not(kafka_settings):
    name = f"tabloop.test.{uuid.uuid4().hex[:6]}"
    ensure_topics(kafka_settings, [Topic(name, "Episode", {"retention.ms": "1000"}, partitions=2)])
    actions = ensure_topics(kafka_settings, [Topic(name, "Episode", {"retention.ms": "-1"}, partitions=4)])
    assert f"{name}: partitions 2 -> 4" in actions
    assert f"{name}: retention.ms 1000 -> -1" in actions
    # The broker applies an accepted change from its metadata log a moment later: a clean-clone CI run
    # read retention.ms 1000 right after the call returned.
    state = poll(lambda: _topic_state(kafka_settings, name),
                 lambda got: got[0] == 4 and got[1]["retention.ms"] == "-1", 15, 0.2)
    assert state[0] == 4 and state[1]["retention.ms"] == "-1"
    with pytest.raises(TopicSetupError, match="cannot remove partitions"):
        ensure_topics(kafka_settings, [Topic(name, "Episode", {}, partitions=1)])
    with pytest.raises(TopicSetupError, match="replication factor"):
        ensure_topics(kafka_settings.model_copy(update={"topic_replication": 3}),
                      [Topic(name, "Episode", {}, partitions=4)])


def _publish_all(settings, events, topic_of: dict[str, str] | None = None):
    with EventProducer(settings) as producer:
        futures = [producer.publish_acked(e, topic=(topic_of or {}).get(e.type)) for e in events]
        producer.flush()
    done, not_done = wait(futures, timeout=60)
    assert not not_done
    return [f.result() for f in futures]


def test_ten_thousand_of_each_type_through_a_consumer_group(kafka, kafka_settings):
    catalog = fresh_catalog()  # topics of its own: counts below are exact
    ensure_topics(kafka_settings, catalog)
    topic_of = {t.event_type: t.name for t in catalog}
    sequence: dict[str, int] = {}
    events = []
    for type_name in EVENT_TYPES:
        for i in range(N_PER_TYPE):
            e = example_event(type_name, i, prompt_size=256, tokens=16)
            # Few keys, many events per key: per-key order is what must survive.
            if type_name in ("CompletionServed", "Episode"):
                e.record["completion_id"] = f"cmpl-{i % 50}"
            sequence[e.event_id] = len(events)
            events.append(e)
    delivered = _publish_all(kafka_settings, events, topic_of)
    assert len(delivered) == len(events)

    group = f"test-{uuid.uuid4().hex[:6]}"
    topics = [t.name for t in catalog]
    got, errors = [], []
    with EventConsumer(kafka_settings, group, topics) as consumer:
        while len(got) + len(errors) < len(events):
            batch = consumer.poll(5000, 5.0)
            assert batch, f"stalled after {len(got)} events"
            got.extend(r for r in batch if r.event)
            errors.extend(r for r in batch if r.error)
        consumer.commit()
    assert errors == []
    assert len(got) == len(events) and {r.event.event_id for r in got} == set(sequence)
    per_type = defaultdict(int)
    per_key_seq = defaultdict(list)
    for r in got:
        per_type[r.event.type] += 1
        assert r.topic == topic_of[r.event.type]
        assert r.key.decode() == r.event.key
        per_key_seq[(r.topic, r.key)].append(sequence[r.event.event_id])
    assert per_type == {t: N_PER_TYPE for t in EVENT_TYPES}
    for key, seqs in per_key_seq.items():
        assert seqs == sorted(seqs), f"order broken for key {key}"
    assert max(len(s) for s in per_key_seq.values()) >= N_PER_TYPE // 50

    # Stop and start the broker: everything is still there.
    counts_before = {t: sum(1 for _ in read_topic(kafka_settings, t)) for t in topics}
    assert kafka.stop()
    assert not kafka.status().running
    kafka.start()
    counts_after = {t: sum(1 for _ in read_topic(kafka_settings, t)) for t in topics}
    assert counts_after == counts_before
    assert sum(counts_after.values()) >= len(events)

    # The group's committed offsets survived too: nothing left to read for it.
    with EventConsumer(kafka_settings, group, topics) as consumer:
        leftover = []
        for _ in range(5):
            leftover.extend(consumer.poll(1000, 1.0))
    assert leftover == []


def _topic_of_examples(settings, name: str, event_type: str, n: int, partitions: int):
    """A new topic ``tabloop.test.<name>.<random>`` holding ``n`` example events of ``event_type``."""
    topic = f"tabloop.test.{name}.{uuid.uuid4().hex[:6]}"
    ensure_topics(settings, [Topic(topic, event_type, {}, partitions=partitions)])
    events = [example_event(event_type, i) for i in range(n)]
    _publish_all(settings, events, {event_type: topic})
    return topic, events


def test_consumer_resumes_from_committed_offsets(kafka_settings):
    ensure_topics(kafka_settings)
    topic, events = _topic_of_examples(kafka_settings, "resume", "FeedbackReceived", 600, partitions=3)
    group = f"resume-{uuid.uuid4().hex[:6]}"
    first = []
    with EventConsumer(kafka_settings, group, [topic]) as consumer:
        while len(first) < 250:
            first.extend(consumer.poll(50, 2.0))
        consumer.commit(first)  # commit what was processed; the rest of the batch is not
    rest = []
    with EventConsumer(kafka_settings, group, [topic]) as consumer:
        for _ in range(20):
            rest.extend(consumer.poll(1000, 1.0))
            if len(first) + len(rest) >= len(events):
                break
    ids_first = [r.event.event_id for r in first]
    ids_rest = [r.event.event_id for r in rest]
    assert not set(ids_first) & set(ids_rest), "re-read committed events"
    assert sorted(ids_first + ids_rest) == sorted(e.event_id for e in events), "lost or duplicated events"


def test_delivery_failures_surface(kafka_settings):
    producer = EventProducer(kafka_settings, overrides={"delivery.timeout.ms": 1500, "linger.ms": 0})
    future = producer.publish_acked(example_event("Episode"), topic="tabloop.no-such-topic")
    with pytest.raises(PublishError, match="Episode .* to tabloop.no-such-topic"):
        future.result(timeout=30)
    seen = []
    producer.publish(example_event("Episode"), topic="tabloop.no-such-topic", on_delivery=lambda e, d: seen.append(e))
    producer.publish(example_event("Episode"), topic="tabloop.no-such-topic")  # no callback: flush raises
    with pytest.raises(PublishError, match="1 events were not delivered"):
        producer.flush(30)
    assert len(seen) == 1 and isinstance(seen[0], PublishError)
    producer.flush(5)  # the failure was reported once, not again
    producer.close()


def _cli(settings, *args, timeout=60):
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
           "TABLOOP_KAFKA_BOOTSTRAP": settings.kafka_bootstrap, "TABLOOP_STATE_DIR": str(settings.state_dir),
           "TABLOOP_CACHE_DIR": str(settings.cache_dir), "TABLOOP_TOPIC_PARTITIONS": str(settings.topic_partitions)}
    return subprocess.run([sys.executable, "-m", "tabloop.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_events_dump_prints_json_and_error_lines(kafka_settings):
    topic, events = _topic_of_examples(kafka_settings, "dump", "Episode", 30, partitions=2)
    raw = Producer({"bootstrap.servers": kafka_settings.kafka_bootstrap})
    raw.produce(topic, b"\xc3\x01garbage-not-avro", key=b"bad")
    raw.flush(10)

    proc = _cli(kafka_settings, "events", "dump", topic, "--from-beginning")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    good = [line for line in lines if "event" in line]
    bad = [line for line in lines if "error" in line]
    assert len(good) == 30 and len(bad) == 1
    assert {line["event"]["event_id"] for line in good} == {e.event_id for e in events}
    assert good[0]["type"] == "Episode" and isinstance(good[0]["event"]["joined_at"], str)
    assert bad[0]["key"] == "bad" and bad[0]["error"].startswith("UnknownSchemaError")

    proc = _cli(kafka_settings, "events", "dump", topic, "--from-beginning", "--limit", "5")
    assert len(proc.stdout.splitlines()) == 5
    # Without --from-beginning: starts 3 before the end of each partition, prints at most 3.
    ends = {}
    for line in lines:
        ends[line["partition"]] = max(ends.get(line["partition"], -1), line["offset"])
    proc = _cli(kafka_settings, "events", "dump", topic, "--limit", "3")
    tail = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(tail) == 3
    assert all(line["offset"] > ends[line["partition"]] - 3 for line in tail)
    proc = _cli(kafka_settings, "events", "dump", "tabloop.nope")
    assert proc.returncode == 1 and "does not exist" in proc.stderr


def test_cli_topics_create_and_kafka_status(kafka_settings):
    proc = _cli(kafka_settings, "topics", "create")
    assert proc.returncode == 0, proc.stderr
    assert _cli(kafka_settings, "topics", "create").stdout.strip() == "all topics match the catalog"
    status = _cli(kafka_settings, "kafka", "status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["answering"] is True


def test_clear_errors_without_java_or_maven(tmp_path, kafka_settings):
    settings = kafka_settings.model_copy(update={"state_dir": tmp_path, "cache_dir": tmp_path / "cache",
                                                 "kafka_bootstrap": "127.0.0.1:1"})
    with pytest.raises(KafkaLaunchError, match="Maven .* is not on PATH"):
        LocalKafka(settings, maven="no-such-mvn").fetch()
    with pytest.raises(KafkaLaunchError, match="Java .* is not on PATH"):
        LocalKafka(settings, java="no-such-java").start()
    with pytest.raises(KafkaLaunchError, match="127.0.0.1 only"):
        LocalKafka(settings.model_copy(update={"kafka_bootstrap": "kafka.example:9092"}))


def test_a_group_waits_for_more_members_only_where_several_start_together(tmp_path, kafka_settings):
    """``bench pipeline --workers 2`` starts its broker with Kafka's default 3 s wait, so the workers join
    one generation; everywhere else a group's only member is assigned at once."""
    def wait_written(broker: LocalKafka) -> str:
        broker.dir.mkdir(parents=True, exist_ok=True)
        broker._write_config(controller_port=1)
        lines = dict(line.split("=", 1) for line in broker.properties_file.read_text().splitlines())
        return lines["group.initial.rebalance.delay.ms"]

    settings = kafka_settings.model_copy(update={"state_dir": tmp_path, "kafka_bootstrap": "127.0.0.1:1"})
    assert wait_written(LocalKafka(settings)) == "0"
    assert wait_written(LocalKafka(settings, group_join_wait_ms=3000)) == "3000"


def test_start_refuses_a_busy_port(tmp_path, kafka, kafka_settings):
    settings = kafka_settings.model_copy(update={"state_dir": tmp_path})
    with pytest.raises(KafkaLaunchError, match="already in use"):
        LocalKafka(settings).start()


def test_cli_says_when_kafka_is_not_there(kafka_settings):
    from infra.kafka_broker import free_port

    nowhere = kafka_settings.model_copy(update={"kafka_bootstrap": f"127.0.0.1:{free_port()}"})
    proc = _cli(nowhere, "events", "dump", "tabloop.feedback")
    assert proc.returncode == 1
    assert "did not answer" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) < 10, "librdkafka's reconnect messages must not flood the terminal"


def test_a_picked_port_is_none_another_process_already_picked():
    """The broker picks its controller port in the `tabloop up` process, where the ports the settings give the
    front door (picked elsewhere, bound only later) still look free: a drill's broker once took the feedback
    port. ``avoid`` keeps them out: here it holds every port of the range it picks from, so the port must come
    from elsewhere."""
    from infra.kafka_broker import PORT_FLOOR, _ephemeral_low, _free_port

    low = _ephemeral_low()
    every = set(range(PORT_FLOOR, low))
    assert not {_free_port(avoid=every) for _ in range(5)} & every
    assert PORT_FLOOR <= _free_port() < low or low - PORT_FLOOR < 1000  # without it, that range


def test_a_start_while_another_is_starting_the_broker_waits_for_it(tmp_path, kafka_settings):
    """Two starts at once (or a stop-and-start overlapping another, as the fuzzer's faults can): the second
    finds the first one's broker running but not answering yet, and waits for it instead of calling it broken.
    The broker is held (SIGSTOP) from the moment it exists until 2 s into the second start, so that start
    surely finds it silent. A broker that stays silent still gets the error, after the wait."""
    import signal
    import threading

    from infra.kafka_broker import free_port

    settings = kafka_settings.model_copy(update={"state_dir": tmp_path,
                                                 "kafka_bootstrap": f"127.0.0.1:{free_port()}"})
    first, second = LocalKafka(settings), LocalKafka(settings)
    started: dict = {}
    threads = [threading.Thread(target=lambda: started.update(first=first.start()))]
    threads[0].start()
    try:
        deadline = time.monotonic() + 60
        while first._running_pid() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        pid = first._running_pid()
        os.kill(pid, signal.SIGSTOP)

        def second_start() -> None:
            try:
                started["second"] = second.start()
            except KafkaLaunchError as exc:
                started["second"] = exc

        threads.append(threading.Thread(target=second_start))
        threads[1].start()
        time.sleep(2.0)
        os.kill(pid, signal.SIGCONT)
        for thread in threads:
            thread.join(120)
        assert not isinstance(started["second"], Exception), f"the second start gave up: {started['second']}"
        assert started["second"].pid == started["first"].pid == pid and started["second"].answering
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(KafkaLaunchError, match=r"did not answer .* within 2s"):
                second.start(timeout_s=2)
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        for thread in threads:
            thread.join(120)
        first.stop()
