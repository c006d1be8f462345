"""Issue 32's migration, on a broker: a worker from before it (two stages, input keyed by completion id or
prompt hash) left state in its two tables, records on its two stage topics, and input under the old keys;
the one join takes them all over, with new input keyed by project and user meanwhile, through a SIGKILL.

The old worker's leavings are written as it wrote them (its tables' changelogs, its stages' records: JSON,
their ``p`` the partition that kept them); each case below is one way an episode was half made when the
keys changed. Every expected episode comes once, the decided one no more, nothing unmatched, and the old
tables end empty."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter

import pytest
from confluent_kafka import Producer

from infra.bus import EventProducer, ensure_topics
from schemas.events import new_event
from schemas.topics import Topic, home_partition
from streams.app import internal_topics, plain
from tests.conftest import make_settings
from tests.test_streams import collect, nothing_left_to_close, sha, start_worker, stop, ts

pytestmark = pytest.mark.kafka

WINDOW_S, LATENESS_S, IDLE_S = 60, 2, 2
APP = "tabloop-streams"


@pytest.mark.timeout(300)
def test_a_two_stage_workers_state_backlog_and_old_keys_move_to_the_one_join_once(own_kafka, tmp_path):
    settings = make_settings(tmp_path, kafka_bootstrap=own_kafka.settings.kafka_bootstrap, join_window_s=WINDOW_S,
                             join_lateness_s=LATENESS_S, idle_close_s=IDLE_S)
    ensure_topics(settings)
    ensure_topics(settings, internal_topics(APP))
    n = settings.topic_partitions
    home = home_partition(b"p/u1", n)
    elsewhere = (home + 1) % n  # where the old keys had put them: not the home of project p, user u1
    now = int(time.time() * 1000)
    prompt = "<|fim_prefix|>def f():\n    return <|fim_suffix|>\n<|fim_middle|>"

    def completion(cid: str, served_ms: int, text: str = "42  # the answer"):
        return new_event("CompletionServed", completion_id=cid, served_at=ts(served_ms), project_id="p",
                         user_id="u1", model="tiny", policy_version=1, prompt=f"{cid} {prompt}",
                         prompt_sha256=sha(f"{cid} {prompt}"), completion_text=text, completion_token_ids=[5, 7],
                         completion_logprobs=[-0.5, -1.0], finish_reason="stop", aborted=False, temperature=0.2,
                         top_p=1.0, max_tokens=16, ttft_ms=1.0, latency_ms=2.0, replica_id="r")

    def by_id(cid: str, received_ms: int, client: str | None = None):
        return new_event("FeedbackReceived", project_id="p", user_id="u1", source="api", completion_id=cid,
                         client_completion_id=client, outcome="ACCEPTED", received_at=ts(received_ms),
                         raw_payload="{}")

    def by_prompt(of, received_ms: int, client: str):
        return new_event("FeedbackReceived", project_id="p", user_id="u1", source="continue-fork",
                         client_completion_id=client, prompt=of.record["prompt"],
                         prompt_sha256=of.record["prompt_sha256"], completion=of.record["completion_text"][:6],
                         outcome="REJECTED", received_at=ts(received_ms), raw_payload="{}")

    def candidate(c):
        r = c.record
        return {"completion_id": r["completion_id"], "served_at": now - 5000, "text": r["completion_text"]}

    old_prompt_key = lambda c: f"p\x1fu1\x1f{c.record['prompt_sha256']}".encode()  # noqa: E731
    a, b, c, d, e, f, g, h = (completion(f"cmpl-{x}", now - 5000) for x in "abcdefgh")
    fb_a, fb_b = by_prompt(a, now + 1000, "client-a"), by_id("cmpl-b", now - 3000, "client-b")
    fb_c, fb_d = by_id("cmpl-c", now - 4000), by_prompt(d, now - 4000, "client-d")
    fb_e, fb_f = by_prompt(e, now + 1000, "client-e"), by_id("cmpl-f", now - 4000)
    fb_g, fb_h = by_id("cmpl-g", now + 1000), by_id("cmpl-h", now + 1000)
    state = lambda **fields: {"t": now - 4000, "seen": {}, "p": elsewhere, **fields}  # noqa: E731
    old_tables = {
        f"{APP}-completion-state-changelog": [
            (b"cmpl-a", state(completion=plain(a.record))),  # a: open; its feedback comes after the upgrade
            # b: decided; the same decision reported again after the upgrade is a duplicate. Its state does not
            # say whose it was: it goes to every partition.
            (b"cmpl-b", state(closed=True, served_at=now - 5000, seen={"p/client-b": now - 3000})),
            (b"cmpl-c", state(early=[plain(fb_c.record)])),  # c: its feedback came first, its completion after
            (b"cmpl-f", state(completion=plain(f.record))),  # f: its feedback is on the old stage's topic
        ],
        f"{APP}-prompt-state-changelog": [
            (old_prompt_key(a), state(candidates=[candidate(a)], waiting=[])),
            (old_prompt_key(d), state(candidates=[], waiting=[plain(fb_d.record)])),  # d: waits for its completion
        ],
    }
    old_stages = [  # e: the old route had re-keyed its completion; its feedback comes after the upgrade
        (f"{APP}-by-completion", b"cmpl-e", {"kind": "completion", "record": plain(e.record)}),
        (f"{APP}-by-prompt", old_prompt_key(e), {"kind": "completion", "record": {
            k: plain(e.record)[k] for k in ("completion_id", "served_at", "completion_text", "project_id", "user_id",
                                            "prompt_sha256")}}),
        (f"{APP}-by-completion", b"cmpl-f", {"kind": "feedback", "record": plain(fb_f.record)}),
    ]
    raw = Producer({"bootstrap.servers": settings.kafka_bootstrap})
    for topic, records in old_tables.items():
        for key, value in records:
            raw.produce(topic, json.dumps(value).encode(), key=key, partition=elsewhere)
    for topic, key, value in old_stages:
        raw.produce(topic, json.dumps(value).encode(), key=key, partition=elsewhere)
    # g: input under its old keys (completion id), off its home partition, as an old front door wrote it.
    with EventProducer(settings) as producer:
        for event in (g, fb_g):
            raw.produce(event.topic, producer.codec.encode(event), key=b"cmpl-g", partition=elsewhere)
    assert raw.flush(30) == 0

    worker = start_worker(settings, "streams.log")
    try:
        with EventProducer(settings) as producer:  # new input, keyed by project and user
            for event in (c, d, h, fb_h):
                producer.publish(event)
        first = collect(settings, set(), 5, 120, worker, grace_s=30)  # c, d, f, g, h
        assert {ep["completion_id"] for ep in first} == {"cmpl-c", "cmpl-d", "cmpl-f", "cmpl-g", "cmpl-h"}, \
            (settings.state_dir / "streams.log").read_text(errors="replace")[-3000:]
        os.kill(worker.pid, signal.SIGKILL)  # after the move: what it did is not done again
        worker.wait(30)
        worker = start_worker(settings, "streams.log")
        with EventProducer(settings) as producer:
            for event in (fb_a, by_prompt(a, now + 1100, "client-a"), fb_b, fb_e):
                producer.publish(event)
        collect(settings, {ep["completion_id"] for ep in first}, 2, 120, worker, grace_s=30)  # a, e
        nothing_left_to_close(settings, 90)
        # Every episode read back once all seven are out (waiting on the topic's state, not a fixed few seconds a
        # busy machine misses): a duplicate committed by then is in the count below.
        episodes = collect(settings, set(), 7, 120, worker, grace_s=30)
    finally:
        stop(worker)
    log = (settings.state_dir / "streams.log").read_text(errors="replace")[-4000:]
    by_completion = Counter(ep["completion_id"] for ep in episodes)
    assert by_completion == Counter({f"cmpl-{x}": 1 for x in "acdefgh"}), (by_completion, log)
    assert all(ep["matched"] for ep in episodes)
    assert {ep["feedback_event_id"] for ep in episodes} == {x.event_id for x in (fb_a, fb_c, fb_d, fb_e, fb_f,
                                                                                   fb_g, fb_h)}
    assert old_tables_left(settings) == {}, "the old tables still hold state"


def old_tables_left(settings) -> dict:
    """The old tables' keys whose last value is not a deletion, read as a worker restores them."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    reader = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": "tabloop-tests-migration",
                       "enable.auto.commit": False, "isolation.level": "read_committed",
                       "enable.partition.eof": True})
    try:
        topics = [f"{APP}-completion-state-changelog", f"{APP}-prompt-state-changelog"]
        parts = [TopicPartition(t, p, 0) for t in topics for p in range(settings.topic_partitions)]
        reader.assign(parts)
        latest, reading = {}, {(tp.topic, tp.partition) for tp in parts}
        while reading:
            m = reader.poll(5)
            assert m is not None, f"changelogs not read to their end: {reading}"
            if m.error():
                if m.error().code() == KafkaError._PARTITION_EOF:
                    reading.discard((m.topic(), m.partition()))
                continue
            latest[(m.topic(), m.key())] = m.value()
        return {k: v for k, v in latest.items() if v is not None}
    finally:
        reader.close()


def test_every_producer_puts_an_event_on_the_partition_the_join_takes_for_its_home(kafka, tmp_path):
    """The front door's producer (librdkafka, ``partitioner`` named in infra.bus) and the worker's
    ``home_partition`` agree, so input is joined where it lands: none goes round through ``rekeyed``."""
    from infra.bus import read_topic

    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap)
    topic = f"tabloop.feedback.home-{os.getpid()}-{tmp_path.name}"
    ensure_topics(settings, (Topic(topic, "FeedbackReceived", {}),))
    users = [(f"project-{i % 7}", f"user-{i}") for i in range(60)]
    with EventProducer(settings) as producer:
        for project, user in users:
            producer.publish(new_event("FeedbackReceived", project_id=project, user_id=user, source="api",
                                       completion_id="c", outcome="ACCEPTED", received_at=ts(0), raw_payload="{}"),
                             topic=topic)
    landed = {(r.event.record["project_id"], r.event.record["user_id"]): r.partition for r in read_topic(settings, topic)}
    assert len(landed) == len(users) and len(set(landed.values())) > 1
    assert landed == {u: home_partition(f"{u[0]}/{u[1]}".encode(), settings.topic_partitions) for u in users}
