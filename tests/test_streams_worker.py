"""The `tabloop streams` worker as a process in `make test` (the long runs are drills in test_streams.py):
a few hundred completions and feedback events of every kind on a broker of its own, and a record that is no
event at all. Exactly once by event ids, the dead letter, the acceptance score; the expectations come from
test_streams.scenario, which works them out from how each event was made, not with streams.join."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from confluent_kafka import Producer

from infra.bus import EventProducer, ensure_topics, read_topic
from tabloop.bench import _pipeline_events
from tests.conftest import make_settings
from tests.system_helpers import wait
from tests.test_streams import IDLE_S, check, collect, reward, scenario, start_worker, stop

pytestmark = pytest.mark.kafka

GARBAGE = b"\x00\x01 neither Avro nor JSON"
# Shorter windows than the drills' (the scenario's expired completions are older than either): what the
# worker holds back at the end is a window plus the lateness, here 7 s.
WINDOW_S, LATENESS_S = 5, 2


@pytest.mark.timeout(240)  # a broker and a worker starting on two shared cores; the run itself is well under that
@pytest.mark.parametrize("guarantee", ["exactly_once", "at_least_once"])
def test_a_few_hundred_events_give_each_episode_once_a_dead_letter_and_scores(own_kafka, tmp_path, guarantee):
    """Both guarantees `tabloop streams --guarantee` offers join the same episodes when nothing fails (at least
    once may repeat output only after a crash)."""
    # Commits 3 s apart (0.5 s by default): the burst's completions mostly open and close between two, so
    # the changelog count below does not hang on how fast a busy machine publishes the burst.
    settings = make_settings(tmp_path, kafka_bootstrap=own_kafka.settings.kafka_bootstrap, join_window_s=WINDOW_S,
                             join_lateness_s=LATENESS_S, idle_close_s=IDLE_S, streams_commit_interval_s=3)
    ensure_topics(settings)
    events, expected, kinds = scenario(seed=5, n_completions=300, n_feedback=300)
    assert kinds["by_id"] and kinds["by_prompt"] and kinds["expired"] and kinds["cache_hit"] and kinds["duplicate"]
    feedback_ids = {e.event_id for e in events if e.type == "FeedbackReceived"}
    worker = start_worker(settings, "streams.log", "--guarantee", guarantee)
    try:
        raw = Producer({"bootstrap.servers": settings.kafka_bootstrap})
        raw.produce("tabloop.feedback", GARBAGE, key=b"junk")
        raw.flush(10)
        with EventProducer(settings) as producer:
            for e in events:
                producer.publish(e)
        episodes = collect(settings, set(), len(expected), 150, worker, grace_s=WINDOW_S + LATENESS_S + IDLE_S + 10)
        letters = wait(lambda: [r.event.record for r in read_topic(settings, "tabloop.deadletter")
                                if r.event and r.event.record["consumer"] == "tabloop-streams"],
                       60, "the garbage record's dead letter")
    finally:
        stop(worker)
    log = (settings.state_dir / "streams.log").read_text(errors="replace")[-3000:]
    assert check(episodes, set(), expected) == 0, log  # every expected episode, nothing else, nothing twice
    # Exactly once by event ids: no episode event twice, no feedback joined into two episodes, and every
    # episode's feedback one that was published (a duplicate report folds into its first's episode).
    assert max(Counter(e["event_id"] for e in episodes).values()) == 1
    joined = [e["feedback_event_id"] for e in episodes]
    assert len(joined) == len(set(joined)) and set(joined) <= feedback_ids
    # Scored in the worker: the default spec is acceptance alone, its reward worked out by hand in reward().
    accepted = [e for e in episodes if e["outcome"] == "ACCEPTED"]
    assert accepted and all(e["scorer"] == "acceptance" and e["reward_components"] == {"acceptance": reward(
        "ACCEPTED")} for e in accepted)
    assert [d["raw"] for d in letters] == [GARBAGE] and letters[0]["source_topic"] == "tabloop.feedback"
    # The option reached the worker: exactly once writes its output in transactions, each ended by a commit
    # marker that takes an offset no record has; at least once writes plain records, offsets without a gap.
    offsets: dict[int, list[int]] = {}
    for r in read_topic(settings, "tabloop.episodes"):
        offsets.setdefault(r.partition, []).append(r.offset)
    gaps = any(o[-1] - o[0] + 1 > len(o) or o[0] > 0 for o in offsets.values())
    assert gaps == (guarantee == "exactly_once"), offsets
    # A completion's state is written when it opens and again when it closes; exactly once sends a key's
    # last value when its transaction commits (``streams.upstream.ChangelogWrites``), so no key stands twice in
    # one transaction; at least once sends each write as it is made, about half the completions twice. (A bound
    # on writes per completion under exactly once hung on how many commits fell inside the burst: 1.30 on a
    # busy machine against < 1.25.)
    changelog = [r for r in read_topic(settings, "tabloop-streams-join-state-changelog") if r.key.startswith(b"c\x1f")]
    twice_in_one = [key for key, n in Counter((transaction, r.key) for transaction, r in
                                              transactions(changelog)).items() if n > 1]
    writes = Counter(r.key for r in changelog)
    per_completion = sum(writes.values()) / len(writes)
    if guarantee == "exactly_once":
        assert twice_in_one == [], (len(twice_in_one), twice_in_one[:3], per_completion)
    else:
        assert per_completion > 1.3, per_completion  # sent as each event is processed: 1.5 in a run


def transactions(records) -> list[tuple[tuple[int, int], object]]:
    """(transaction, record) for records read in offset order: on a partition, a transaction's records stand at
    consecutive offsets and its commit marker takes the next one, so a skipped offset starts another. (Written
    without transactions, a partition's records are one run.) The transaction is (partition, its first offset)."""
    out, last = [], {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        start = last.get(r.partition)
        if start is None or r.offset != start[1] + 1:
            start = (r.offset, r.offset)
        last[r.partition] = (start[0], r.offset)
        out.append(((r.partition, start[0]), r))
    return out


def test_transactions_split_where_an_offset_is_skipped():
    class R:
        def __init__(self, partition, offset):
            self.partition, self.offset = partition, offset

    got = transactions([R(0, 0), R(0, 1), R(0, 3), R(1, 0), R(0, 4), R(0, 7)])
    assert [(t, r.partition, r.offset) for t, r in got] == [((0, 0), 0, 0), ((0, 0), 0, 1), ((0, 3), 0, 3),
                                                            ((0, 3), 0, 4), ((0, 7), 0, 7), ((1, 0), 1, 0)]


@pytest.mark.timeout(300)
def test_a_restarted_worker_restores_its_tables_up_to_the_last_committed_record_without_faust_s_wait(own_kafka,
                                                                                                    tmp_path):
    """Under exactly_once every changelog partition ends with a commit marker, an offset no record has. Faust's
    recovery read up to the end minus one and so waited for a record at the marker's offset, until two 5 s
    timeouts of its read loop had passed ("Aborted tx until highwater"): 10-15 s without processing after each
    rebalance and restart (issue 44's fuzzer). ``MarkerAwareRecovery`` reads up to the last committed record.
    What the first worker stored must all be there for the second: feedback sent after the restart joins every
    completion sent before it (half by our id, half by prompt: both tables restored)."""
    settings = make_settings(tmp_path, kafka_bootstrap=own_kafka.settings.kafka_bootstrap)
    ensure_topics(settings)
    n = 60
    completions, feedback = _pipeline_events(n, 3, int(time.time() * 1000), "restart")
    worker = start_worker(settings, "streams-1.log")
    try:
        with EventProducer(settings) as producer:
            for event in completions:
                producer.publish(event)
        wait(lambda: len({r.key for r in read_topic(settings, "tabloop-streams-join-state-changelog")
                          if r.key.startswith(b"c\x1f")}) >= n, 120, f"{n} completions' state committed")
    finally:
        stop(worker)
    log = settings.state_dir / "streams-2.log"
    worker = start_worker(settings, log.name)
    try:
        wait(lambda: log.exists() and "Recovery complete" in log.read_text(errors="replace"), 120,
             "the restarted worker's recovery")
        with EventProducer(settings) as producer:
            for event in feedback:
                producer.publish(event)
        episodes = collect(settings, set(), n, 120, worker)
    finally:
        stop(worker)
    text = log.read_text(errors="replace")
    assert "Aborted tx until highwater" not in text, text[-3000:]
    assert "recovery reads up to" in text, text[-3000:]
    joined = {e["completion_id"]: e["feedback_event_id"] for e in episodes if e["matched"]}
    assert joined == {c.record["completion_id"]: f.event_id for c, f in zip(completions, feedback)}
