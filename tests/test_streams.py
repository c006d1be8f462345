"""The streams worker on the real broker: 10,000 completions and 10,000 feedback events, shuffled,
with early feedback, duplicates, cache hits, unmatched feedback, trimmed texts and expired windows.
The expected episodes are worked out here from how each event was made, not with streams.join."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone

import pytest

from infra.bus import EventProducer, ensure_topics, read_topic
from infra.settings import to_environ
from schemas.events import new_event
from tests.conftest import make_settings
from tests.system_helpers import Quiet, feedback_waiting, stalled_partitions, wait, worker_lag

# Long runs on a broker of their own (the session broker's topics hold other tests' events, which a
# worker reading from the earliest offset would join too): `make drills`, not `make test`.
pytestmark = [pytest.mark.kafka, pytest.mark.drill]
N_COMPLETIONS = 10_000
N_FEEDBACK = 10_000
WINDOW_S, LATENESS_S, IDLE_S = 30, 20, 3
# What the worker may still hold back once it has read all its input: an open window closes at most a
# window plus the allowed lateness after its last event, or after IDLE_S of an idle partition. A wait for
# episodes that has seen nothing new for this long with the worker's lag at 0 knows the rest is missing.
GRACE_S = WINDOW_S + LATENESS_S + IDLE_S + 10


@pytest.fixture
def kafka(own_kafka):
    """A fresh broker per test (conftest's ``own_kafka``): the workers read their topics from the start."""
    return own_kafka


def ts(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, timezone.utc)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def reward(outcome: str, fraction: float | None = None) -> float:
    return {"ACCEPTED": 0.75, "REJECTED": -0.25}.get(outcome, -0.25 + (fraction or 0.0))


def scenario(seed: int = 7, n_completions: int = N_COMPLETIONS, n_feedback: int = N_FEEDBACK):
    """(events in publish order, expected {episode completion_id: (outcome, reward, matched)}, counts)."""
    rng = random.Random(seed)
    now = int(time.time() * 1000)
    completions, feedback, expected = [], [], {}
    kinds = {"by_id": 0, "by_prompt": 0, "duplicate": 0, "ignored": 0, "expired": 0, "cache_hit": 0,
             "unmatched": 0}

    def fb(**fields):
        e = new_event("FeedbackReceived", raw_payload="{}", **fields)
        feedback.append(e)
        return e

    for i in range(n_completions):
        project, user, prompt = f"p{i % 3}", f"u{i % 5}", f"<|fim_prefix|>x{i % 200} = <|fim_suffix|><|fim_middle|>"
        text = f"v{i:06d}:" + "".join(rng.choice("abc ") for _ in range(rng.randrange(4, 30)))
        fate = rng.choices(["by_id", "by_prompt", "ignored", "expired"], [30, 50, 12, 8])[0]
        served = now - (WINDOW_S + 15) * 1000 if fate == "expired" else now + i
        cid = f"cmpl-{seed}-{i}"
        completions.append(new_event(
            "CompletionServed", completion_id=cid, served_at=ts(served), project_id=project, user_id=user,
            model="tiny", policy_version=i % 4, prompt=prompt, prompt_sha256=sha(prompt), completion_text=text,
            completion_token_ids=[i % 50, 7], completion_logprobs=[-0.5, -1.0], finish_reason="stop",
            aborted=False, temperature=0.2, top_p=1.0, max_tokens=16, ttft_ms=1.0, latency_ms=2.0,
            replica_id="r"))
        kinds[fate] += 1
        if fate == "ignored":
            continue
        outcome = rng.choice(["ACCEPTED", "REJECTED", "PARTIAL"] if fate == "by_id" else ["ACCEPTED", "REJECTED"])
        received = now + 500 + i if fate != "expired" else now
        if fate == "by_id":
            chars = rng.randrange(0, len(text) + 1) if outcome == "PARTIAL" else None
            fb(project_id=project, user_id=user, source="api", completion_id=cid, outcome=outcome,
               accepted_chars=chars, received_at=ts(received))
            expected[cid] = (outcome, reward(outcome, chars / len(text) if chars is not None else None), True)
            continue
        shown = text[:rng.randrange(8, len(text) + 1)]  # Continue trims what it shows
        client_id = f"continue-{seed}-{i}"
        first = fb(project_id=project, user_id=user, source="continue-fork", client_completion_id=client_id,
                   prompt=prompt, prompt_sha256=sha(prompt), completion=shown, outcome=outcome,
                   received_at=ts(received))
        if fate == "expired":  # served outside the window: unmatched, an off-policy episode of its own
            expected[f"unmatched-{first.event_id}"] = (outcome, reward(outcome), False)
            continue
        expected[cid] = (outcome, reward(outcome), True)
        if rng.random() < 0.1:  # Continue reports the same decision again
            kinds["duplicate"] += 1
            fb(project_id=project, user_id=user, source="continue-fork", client_completion_id=client_id,
               prompt=prompt, prompt_sha256=sha(prompt), completion=shown, outcome=outcome,
               received_at=ts(received + 5))
    while len(feedback) < n_feedback:
        j = len(feedback)
        outcome = rng.choice(["ACCEPTED", "REJECTED"])
        cache_hit = j % 2 == 0
        kinds["cache_hit" if cache_hit else "unmatched"] += 1
        prompt = f"never served {j}"
        e = fb(project_id="p0", user_id="u0", source="continue-data", client_completion_id=f"lost-{seed}-{j}",
               prompt=prompt, prompt_sha256=sha(prompt), completion="zzz", outcome=outcome, cache_hit=cache_hit,
               received_at=ts(now + 1000 + j))
        expected[f"unmatched-{e.event_id}"] = (outcome, reward(outcome), False)
    events = completions + feedback
    rng.shuffle(events)  # feedback often arrives before its completion
    return events, expected, kinds


def start_worker(settings, log_name: str, *options: str) -> subprocess.Popen:
    log = open(settings.state_dir / log_name, "ab")
    return subprocess.Popen([sys.executable, "-m", "tabloop.cli", "streams", *options], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, **to_environ(settings)})


def collect(settings, before: set, want: int, timeout_s: float, proc, grace_s: float = GRACE_S) -> list:
    """The episode topic once ``want`` completion ids not in ``before`` have an episode — or, sooner, once
    more cannot come (the worker exited, or its output and lag stood still for ``grace_s``):
    the caller's ``check`` then names what is missing. A missing episode costs ``grace_s``, not the timeout."""
    seen: list = []

    def new_ids() -> int:
        seen[:] = [r.event.record for r in read_topic(settings, "tabloop.episodes") if r.event]
        return len({e["completion_id"] for e in seen} - before)

    quiet = Quiet(settings, new_ids, want, grace_s, proc)
    try:
        wait(quiet, timeout_s, f"{want} new episodes", poll_s=2,
             explain=lambda: f"{new_ids()} new episodes; worker lag {worker_lag(settings, detail=True)}")
    finally:
        quiet.close()
    return seen


def collect_restarting(settings, before: set, want: int, worker, grace_s: float,
                       timeout_s: float = 900) -> tuple[subprocess.Popen, int]:
    """``collect`` until ``want`` new episodes, starting the worker again whenever it exited, as the supervisor
    would (a worker may give up during an outage, or exit for a clean start after a rebalance); (the worker
    running at the end, how many restarts it took)."""
    deadline, restarts = time.monotonic() + timeout_s, 0
    try:
        while time.monotonic() < deadline:
            collect(settings, before, want, deadline - time.monotonic(), worker, grace_s=grace_s)
            if worker.poll() is None:
                break
            restarts += 1
            worker = start_worker(settings, f"streams-{restarts + 1}.log")
    except BaseException:
        stop(worker)  # one started here: the caller's own stop has only the first
        raise
    return worker, restarts


def nothing_left_to_close(settings, timeout_s: float) -> None:
    """Wait until nothing the worker holds could still become an episode by time alone: no feedback waiting
    in its tables, nothing unread in its topics (its own included), twice in a row. Read before the topic's
    last read, instead of sleeping out the lateness and the idle close: a wrong late episode still shows (it
    comes from feedback that waits), and a right run does not pay for the wait.

    Waiting is read on both sides of the lag: input the worker moves to its home partition (through its
    own topic) is in flight between the two reads of an earlier round."""
    rounds = []

    def quiet_twice() -> bool:
        rounds.append(feedback_waiting(settings) == 0 and worker_lag(settings) == 0 and feedback_waiting(settings) == 0)
        return rounds[-2:] == [True, True]

    wait(quiet_twice, timeout_s, "no feedback left waiting in the worker and its lag 0", poll_s=2,
         explain=lambda: f"feedback waiting {feedback_waiting(settings)}, worker lag {worker_lag(settings, detail=True)}")


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def check(episodes, before: set, expected: dict) -> int:
    """Assert the distinct episodes are exactly the expected ones; return how many were redelivered.

    A redelivery is the same episode (same deterministic event_id, same content) on the topic twice;
    consumers deduplicate by event_id. Two *different* episodes for one completion fail the test.
    """
    got, first, redelivered = {}, {}, 0
    for e in episodes:
        if e["completion_id"] in before:
            continue
        cid = e["completion_id"]
        if cid in first:
            assert e == first[cid], f"two different episodes for {cid}"
            redelivered += 1
            continue
        first[cid] = e
        got[cid] = (e["outcome"], e["reward"], e["matched"])
    assert set(got) == set(expected), (len(set(expected) - set(got)), len(set(got) - set(expected)))
    for cid, (outcome, r, matched) in expected.items():
        assert got[cid][0] == outcome and got[cid][2] == matched and got[cid][1] == pytest.approx(r), cid
    return redelivered


def episode_ids(settings) -> set:
    return {r.event.record["completion_id"] for r in read_topic(settings, "tabloop.episodes") if r.event}


def drill_start(kafka, tmp_path, *, idle_s: float = IDLE_S, instance_id: str = "", **scenario_args):
    """A drill's start: settings on the session's broker with the drills' windows, the topics, the scenario's
    events, and the episodes already on the topic (earlier tests'), which the checks leave out."""
    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap, join_window_s=WINDOW_S,
                             join_lateness_s=LATENESS_S, idle_close_s=idle_s, streams_instance_id=instance_id)
    ensure_topics(settings)
    events, expected, kinds = scenario(**scenario_args)
    return settings, events, expected, kinds, episode_ids(settings)


@pytest.mark.timeout(1800)  # the session's topics already hold other tests' events, which the worker reads too
def test_ten_thousand_shuffled_events_give_exactly_the_expected_episodes(kafka, tmp_path):
    settings, events, expected, kinds, before = drill_start(kafka, tmp_path)
    assert all(v > 100 for v in kinds.values()), kinds  # every situation is well represented
    worker = start_worker(settings, "streams.log")
    try:
        with EventProducer(settings) as producer:
            for e in events:
                producer.publish(e)
        collect(settings, before, len(expected), 1200, worker)
        nothing_left_to_close(settings, LATENESS_S + IDLE_S + 120)  # anything late would show up by then
        episodes = [r.event.record for r in read_topic(settings, "tabloop.episodes") if r.event]
    finally:
        stop(worker)
    assert check(episodes, before, expected) == 0  # no crash, no redelivery


@pytest.mark.timeout(1800)
def test_sigkill_mid_stream_loses_nothing_and_doubles_nothing(kafka, tmp_path):
    settings, events, expected, _, before = drill_start(kafka, tmp_path, seed=11, n_completions=3000, n_feedback=3000)
    worker = start_worker(settings, "streams-1.log")
    try:
        with EventProducer(settings) as producer:
            for e in events:
                producer.publish(e)
        partial = collect(settings, before, len(expected) // 3, 300, worker)
        assert len({e["completion_id"] for e in partial} - before) < len(expected), \
            "the worker finished before it could be killed"
        worker.kill()  # SIGKILL, mid-stream
        worker.wait()
        worker = start_worker(settings, "streams-2.log")
        collect(settings, before, len(expected), 1200, worker)
        nothing_left_to_close(settings, LATENESS_S + IDLE_S + 120)
        episodes = [r.event.record for r in read_topic(settings, "tabloop.episodes") if r.event]
        stalled = stalled_partitions(settings)
    finally:
        stop(worker)
    assert check(episodes, before, expected) == 0  # none lost, none twice: the same topic as an uninterrupted run
    assert stalled == {}  # the restarted worker commits every partition it reads (a stall: lag forever)


def test_a_sigkilled_worker_with_an_instance_id_is_succeeded_at_once_and_nothing_is_doubled(kafka, tmp_path):
    """Static group membership (TABLOOP_STREAMS_INSTANCE_ID, which `tabloop up` gives the worker it supervises):
    the successor of a SIGKILLed worker, started with the same id, takes the dead one's place at once. Without
    the id the group keeps the dead member's partitions until its 60 s session ends (the drill above waits that
    out), and nothing becomes an episode meanwhile. The episodes are still each exactly once."""
    from tabloop.fuzz import ASSIGNED_LINE

    settings, events, expected, _, before = drill_start(kafka, tmp_path, seed=12, n_completions=1500,
                                                        n_feedback=1500, instance_id="drill-static-0")
    worker = start_worker(settings, "static-1.log")
    try:
        with EventProducer(settings) as producer:
            for e in events:
                producer.publish(e)
        collect(settings, before, len(expected) // 3, 300, worker)
        worker.kill()  # SIGKILL: no LeaveGroup, the group still lists it
        worker.wait()
        killed_at = time.monotonic()
        worker = start_worker(settings, "static-2.log")
        successor_log = settings.state_dir / "static-2.log"
        # The dead member's last heartbeat came at most 3 s before the kill: its session ends 57 s after it at
        # the earliest. An assignment before that is the static takeover, not the session's expiry.
        wait(lambda: ASSIGNED_LINE in successor_log.read_text(errors="replace"), 50,
             "the successor's first assignment before the dead member's 60 s session could end")
        took_over_s = time.monotonic() - killed_at
        collect(settings, before, len(expected), 600, worker)
        nothing_left_to_close(settings, LATENESS_S + IDLE_S + 120)
        episodes = [r.event.record for r in read_topic(settings, "tabloop.episodes") if r.event]
    finally:
        stop(worker)
    assert took_over_s < 57, took_over_s
    assert check(episodes, before, expected) == 0


def test_undecodable_input_goes_to_the_dead_letter_topic(kafka, tmp_path):
    from confluent_kafka import Producer

    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap)
    ensure_topics(settings)
    worker = start_worker(settings, "streams-dl.log")
    try:
        raw = Producer({"bootstrap.servers": settings.kafka_bootstrap})
        raw.produce("tabloop.feedback", b"\xc3\x01not an event at all", key=b"junk")
        raw.produce("tabloop.completions", b'{"json": "is not avro"}', key=b"junk")
        raw.flush(10)
        letters = wait(lambda: (found := [r.event.record for r in read_topic(settings, "tabloop.deadletter")
                                          if r.event and r.event.record["consumer"] == "tabloop-streams"])
                       and len(found) >= 2 and found, 120, "two dead letters from the worker")
        # The stream goes on: a good event after the bad ones still becomes an episode.
        good = new_event("FeedbackReceived", project_id="p", user_id="u", source="api", completion_id="cmpl-dl",
                         outcome="ACCEPTED", raw_payload="{}", cache_hit=True)
        with EventProducer(settings) as producer:
            producer.publish(good)
        episodes = wait(lambda: [r for r in read_topic(settings, "tabloop.episodes")
                                 if r.event and r.event.record["feedback_event_id"] == good.event_id],
                        120, "the good feedback's episode")
    finally:
        stop(worker)
    by_topic = {d["source_topic"]: d for d in letters}
    assert set(by_topic) == {"tabloop.feedback", "tabloop.completions"}
    assert by_topic["tabloop.feedback"]["raw"] == b"\xc3\x01not an event at all"
    assert "UnknownSchemaError" in by_topic["tabloop.feedback"]["error"]
    assert "CorruptEventError" in by_topic["tabloop.completions"]["error"]
    assert len(episodes) == 1


def test_judge_and_tests_scores_reach_the_episodes(kafka, tmp_path):
    """A spec weighing judge and tests: the worker asks a judge (a local server speaking the OpenAI chat
    API) and runs the task's tests in the sandbox before it publishes; the rewards are worked by hand."""
    import json

    from policy.fim import build_fim_prompt
    from schemas.token_ids import pack_ids, prompt_ids
    from tests.test_judge import FakeJudgeAPI, Reply

    api = FakeJudgeAPI()
    api.default = Reply(content="Reasonable.\nSCORE: 6")
    tested = build_fim_prompt("def add(a, b):\n    return ", "\n")
    untested = build_fim_prompt("def sub(a, b):\n    return ", "\n")
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"prompt": tested, "tests": "assert add(2, 3) == 5\n"}) + "\n")
    (tmp_path / "rewards.yaml").write_text("default:\n  weights: {acceptance: 0.5, judge: 0.3, tests: 0.2}\n")
    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap, idle_close_s=IDLE_S,
                             reward_spec_file=tmp_path / "rewards.yaml", tests_file=tmp_path / "tasks.jsonl",
                             judge_api_url=api.url + "/v1", judge_api_key="sk-test", judge_model="judge")
    ensure_topics(settings)
    events, now = [], int(time.time() * 1000)
    for cid, prompt, text, outcome in (("c-tested", tested, "a + b", "ACCEPTED"),
                                       ("c-untested", untested, "a - b", "REJECTED")):
        events.append(new_event(
            "CompletionServed", completion_id=cid, served_at=ts(now), project_id="p", user_id="u", model="tiny",
            policy_version=1, prompt=prompt, prompt_sha256=sha(prompt), completion_text=text,
            completion_token_ids=[1, 2], completion_logprobs=[-0.1, -0.2], finish_reason="stop", aborted=False,
            temperature=0.2, top_p=1.0, max_tokens=16, ttft_ms=1.0, latency_ms=2.0, replica_id="r",
            prompt_token_ids_packed=pack_ids([5, 6, 2**32 - 1])))  # through the worker's JSON stages as bytes
        events.append(new_event("FeedbackReceived", project_id="p", user_id="u", source="api", completion_id=cid,
                                outcome=outcome, raw_payload="{}", received_at=ts(now + 5)))
    cache_hit = new_event("FeedbackReceived", project_id="p", user_id="u", source="continue-data",
                          client_completion_id="cached-1", prompt=tested, prompt_sha256=sha(tested),
                          completion="a + b", outcome="ACCEPTED", cache_hit=True, raw_payload="{}")
    worker = start_worker(settings, "streams-score.log")
    try:
        with EventProducer(settings) as producer:
            for e in events + [cache_hit]:
                producer.publish(e)
        got = wait(lambda: len(found := {r.event.record["completion_id"]: r.event.record
                                         for r in read_topic(settings, "tabloop.episodes") if r.event}) >= 3
                   and found, 180, "three scored episodes")
    finally:
        stop(worker)
        api.stop()
    judge = -0.25 + 0.6  # 6/10 on the acceptance scale: 0 → −0.25, 10 → +0.75
    tested_ep, untested_ep = got["c-tested"], got["c-untested"]
    assert tested_ep["reward_components"] == pytest.approx({"acceptance": 0.75, "judge": judge, "tests": 0.75})
    assert tested_ep["reward"] == pytest.approx(0.5 * 0.75 + 0.3 * judge + 0.2 * 0.75)
    assert tested_ep["scorer"] == "acceptance+judge+tests" and tested_ep["scoring_errors"] == {}
    assert prompt_ids(tested_ep) == prompt_ids(untested_ep) == [5, 6, 2**32 - 1]  # both through to-score
    assert untested_ep["reward_components"] == pytest.approx({"acceptance": -0.25, "judge": judge})
    assert untested_ep["reward"] == pytest.approx((0.5 * -0.25 + 0.3 * judge) / 0.8)
    assert got[f"unmatched-{cache_hit.event_id}"]["reward_components"] == {"acceptance": 0.75}  # nothing to judge
    assert len(api.requests) == 2


LOAD_DELIVERY_TIMEOUT_MS = 300_000
"""The steady load's producer holds an event this long before giving it up. With the producers' default 120 s
(``infra.bus.EventProducer``) the load lost 3,643 of its events in a clean-clone CI run here (at eb3647b): the
broker stopped for 30 s took over 90 s more to take writes again on a machine running other drills, and the drill
failed for events its own load never delivered, not for anything the worker did."""


def publish_steadily(settings, events, per_second: float) -> threading.Thread:
    """Publish ``events`` from a thread at ``per_second``, as IDEs do: the load goes on through a broker
    outage (the producer holds what it cannot deliver yet, for up to its delivery timeout). What is tested is the
    worker, so the load's own producer waits as long as the drill does (``LOAD_DELIVERY_TIMEOUT_MS``)."""
    def run() -> None:
        producer = EventProducer(settings, overrides={"delivery.timeout.ms": LOAD_DELIVERY_TIMEOUT_MS})
        try:
            start = time.monotonic()
            for i, e in enumerate(events):
                time.sleep(max(0.0, start + i / per_second - time.monotonic()))
                producer.publish(e)
        finally:
            # What the outage held back is delivered once the broker's coordinators have loaded again, which on
            # a machine running other drills took over a minute: wait for it as long as the drill does (its
            # delivery timeout still fails what the broker never took).
            producer.close(timeout_s=LOAD_DELIVERY_TIMEOUT_MS / 1000 + 30)

    thread = threading.Thread(target=run, name="steady-load", daemon=True)
    thread.start()
    return thread


def finish_and_read(settings, load: threading.Thread, before: set, expected: dict, worker, idle_s: float):
    """After a fault: the rest of the steady load published, every expected episode collected (the worker
    started again whenever it exited, as the supervisor would), nothing left to close; (the worker running
    at the end, its restarts, the episode topic)."""
    load.join(LOAD_DELIVERY_TIMEOUT_MS / 1000 + 60)
    worker, restarts = collect_restarting(settings, before, len(expected), worker,
                                          grace_s=WINDOW_S + LATENESS_S + idle_s + 10)
    nothing_left_to_close(settings, LATENESS_S + idle_s + 120)
    return worker, restarts, [r.event.record for r in read_topic(settings, "tabloop.episodes") if r.event]


@pytest.mark.timeout(1800)
def test_kafka_stopped_thirty_seconds_under_steady_load_commits_no_episode_twice(kafka, tmp_path):
    """The broker stops for 30 s while events keep coming and the worker is mid-transaction, nothing killed;
    it starts again on the same data, and a second worker joins as it does: the rebalance that followed the
    outage in the issue's run (a loaded machine, the worker's session lapsed), made certain. Every expected
    episode comes out once and every partition commits again (a worker that gives up during the outage may
    exit: its supervisor starts it again, as this test does; one that stays must rejoin). On 064e281 nine
    completions got two committed episodes here (six in the issue's run, at neighbouring offsets): the first
    worker's open transaction outlived the rebalance, the worker read its kept partitions again from their
    committed offsets and sent the same episodes a second time into the same transaction (issue 44). The
    outage alone, with no rebalance after it, is the fuzzer's ``kafka-30s`` (tests/test_fuzz_drill.py)."""
    # Idle partitions close their windows by the wall clock after idle_close_s; an outage must not count as
    # idle time (with 3 s, feedback still waiting for its completion would close as unmatched meanwhile).
    idle_s = 90
    settings, events, expected, _, before = drill_start(kafka, tmp_path, idle_s=idle_s, seed=29,
                                                        n_completions=3000, n_feedback=3000)
    worker = start_worker(settings, "streams-1.log")
    joined = None
    try:
        load = publish_steadily(settings, events, per_second=60)
        collect(settings, before, len(expected) // 8, 300, worker)  # the worker is busy: mid-transaction
        kafka.stop()
        time.sleep(30)
        kafka.start()
        joined = start_worker(settings, "streams-2.log")
        worker, restarts, episodes = finish_and_read(settings, load, before, expected, worker, idle_s)
        stalled = stalled_partitions(settings)
    finally:
        for proc in filter(None, [worker, joined]):
            stop(proc)
    print(f"worker restarts after the outage: {restarts}")
    assert check(episodes, before, expected) == 0
    assert stalled == {}


def fence_transactions(settings, app_id: str = "tabloop-streams", groups: int = 4) -> None:
    """Do what a second worker with the same transactional ids does first (init_transactions): the broker
    aborts the open transactions of those ids and refuses their old producers from then on."""
    from confluent_kafka import Producer

    for group in range(groups):
        for partition in range(settings.topic_partitions):
            zombie_killer = Producer({"bootstrap.servers": settings.kafka_bootstrap,
                                      "transactional.id": f"{app_id}-{group}-{partition}"})
            zombie_killer.init_transactions(60)


@pytest.mark.timeout(1800)
def test_a_worker_whose_transactions_are_fenced_mid_stream_exits_at_once_and_nothing_is_doubled(kafka, tmp_path):
    """A commit that fails (here: the worker's transactional producers fenced, as a worker that paused past its
    session is by its successor) leaves transactions whose state the worker cannot know. It exits at once, as
    a SIGKILL would, for the next worker to start from what was committed. On 0c4605a Faust logged the fenced
    producer, counted the offsets as committed and went on until its next commit raised ("Not in the middle of
    a transaction"), then stopped gracefully (exit 1); after a Kafka outage such a graceful stop went on
    committing for a minute with its transactions open (issue 44: a reader held 70 s behind them)."""
    from streams.app import EXIT_PRODUCER_DIED
    from streams.upstream import EXIT_UNCOMMITTED

    settings, events, expected, _, before = drill_start(kafka, tmp_path, seed=23, n_completions=1500, n_feedback=1500)
    worker = start_worker(settings, "streams-1.log")
    try:
        load = publish_steadily(settings, events, per_second=60)
        collect(settings, before, len(expected) // 8, 300, worker)  # the worker is busy: mid-transaction
        fence_transactions(settings)
        try:
            code = worker.wait(120)
        except subprocess.TimeoutExpired:
            code = None
        members_after_exit = group_members(settings)
        log = (settings.state_dir / "streams-1.log").read_text(errors="replace")
        worker, restarts, episodes = finish_and_read(settings, load, before, expected, worker, IDLE_S)
    finally:
        stop(worker)
    print(f"fenced worker's exit code {code}; restarts {restarts}; group members right after: {members_after_exit}")
    assert check(episodes, before, expected) == 0
    # Fenced, the worker ends itself at its next commit (76) or, where its producer dies of the fence first, as
    # a dead producer (75; once in a clean-clone CI): either way at once, by os._exit, leaving the group.
    assert code in (EXIT_UNCOMMITTED, EXIT_PRODUCER_DIED), (
        code, "\n".join(ln for ln in log.splitlines()[-60:] if "rdkafka" not in ln))
    # It left the group on its way out: its successor is not kept waiting for the dead member's session to
    # expire (60 s; on 44021f7 the member was still listed here and a successor got nothing for a minute).
    assert members_after_exit == [], members_after_exit


def group_members(settings, group: str = "tabloop-streams") -> list[str]:
    """The member ids the group coordinator lists for ``group`` now."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap})
    description = admin.describe_consumer_groups([group])[group].result(30)
    return [member.member_id for member in description.members]


def wait_for_log(path, text: str, timeout_s: float) -> None:
    """Until ``text`` is in the log file ``path`` (a worker's own account of what it did)."""
    wait(lambda: path.exists() and text in path.read_text(errors="replace"), timeout_s, f"{text!r} in {path.name}",
         poll_s=0.005)


@pytest.mark.timeout(1800)
def test_workers_joining_and_leaving_under_steady_load_commit_no_episode_twice(kafka, tmp_path):
    """A second worker joins 0-100 ms after the first one's first assignment, and others join and leave while
    events keep coming: every rebalance lands in the middle of a commit interval's work. Before the fix the
    worker that kept a partition kept its open transaction too, read the partition again from its committed
    offset and sent that work's episodes a second time into the same transaction (issue 44)."""
    join_after_ms = 40
    settings, events, expected, _, before = drill_start(kafka, tmp_path, seed=19, n_completions=1500, n_feedback=1500)
    load = publish_steadily(settings, events, per_second=60)
    workers = [start_worker(settings, "streams-1.log")]
    try:
        wait_for_log(settings.state_dir / "streams-1.log", "Executing _on_partitions_assigned", 120)
        time.sleep(join_after_ms / 1000)
        workers.append(start_worker(settings, "streams-2.log"))
        time.sleep(15)
        workers.append(start_worker(settings, "streams-3.log"))
        time.sleep(10)
        stop(workers.pop(1))  # the second leaves; the first and third take its partitions over
        load.join(LOAD_DELIVERY_TIMEOUT_MS / 1000 + 60)
        deadline = time.monotonic() + 900
        restarts = 0
        while time.monotonic() < deadline:
            collect(settings, before, len(expected), deadline - time.monotonic(), workers[0])
            exited = [i for i, w in enumerate(workers) if w.poll() is not None]
            if not exited:
                break
            for i in exited:  # what the supervisor does with a worker that exited
                restarts += 1
                workers[i] = start_worker(settings, f"streams-restart-{restarts}.log")
        nothing_left_to_close(settings, LATENESS_S + IDLE_S + 120)
        episodes = [r.event.record for r in read_topic(settings, "tabloop.episodes") if r.event]
    finally:
        for w in workers:
            stop(w)
    print(f"worker restarts: {restarts}")
    assert check(episodes, before, expected) == 0
