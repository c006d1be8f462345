"""Fault drills (issue 8): the whole system under `tabloop simulate` load while its parts die.

One drill on one `tabloop up` (its own broker, free ports, a tmp state dir, the tiny model, a trainer
that publishes a version every few episodes), phase by phase with simulated Continue users sending
completions and feedback throughout: SIGKILL the front door, the streams worker, the trainer and the
history sink in turn (the supervisor restarts each), then stop Kafka for 30 s and start it again on the
same data; last, stop Kafka and SIGKILL the front door and the streams worker while it is away (issue 32).
(Issue 30: one system for all the phases, not one per kind of fault, saves a whole-system start, drain and
stop in CI's drills.)

Afterwards, from the topics and the history:

- every feedback the front door answered 202 is exactly one FeedbackReceived and at most one Episode;
- no episode twice (by event id, by the feedback it joined);
- the policy versions on tabloop.weights are one unbroken sequence;
- the history holds exactly what the topics hold, table by table;
- the front door answered no 5xx outside the restart window of what was killed.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from infra.bus import read_topic
from infra.kafka_broker import free_port
from schemas.topics import COMPLETIONS, DEADLETTER, EPISODES, FEEDBACK, WEIGHTS
from tests.conftest import TEST_PARTITIONS, make_settings
from tests.system_helpers import (ROOT, cli, env, explain_system, processes_of, row, stalled_partitions, status,
                                  wait)

KAFKA_OUTAGE_S = 30
SLACK_S = 3.0  # the supervisor probes every 2 s: "healthy again" is seen up to this late
HISTORY_TABLES = {COMPLETIONS.name: "completions", FEEDBACK.name: "feedback", EPISODES.name: "episodes",
                  WEIGHTS.name: "weights", DEADLETTER.name: "deadletter"}


class Load:
    """`tabloop simulate` in the background for one phase, its requests and HTTP calls written to files."""

    def __init__(self, settings, out: Path, name: str, duration_s: float):
        self.records, self.calls = out / f"{name}.records.jsonl", out / f"{name}.calls.jsonl"
        self.log = out / f"{name}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tabloop.cli", "simulate", "stdlib:train", "--limit", "40", "--users", "4",
                 "--requests", "100000", "--duration", str(duration_s), "--max-tokens", "8", "--debounce-ms", "100",
                 "--rule", "similarity", "--threshold", "0.3", "--temperature", "1.0", "--project", f"drill-{name}",
                 "--seed", str(sum(map(ord, name))), "--records", str(self.records), "--calls", str(self.calls)],
                env=env(settings), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def started(self) -> bool:
        """The simulator has built its tasks, made its keys and had completions answered."""
        done = re.findall(r"simulate: (\d+) completed", self.log.read_text(errors="replace"))
        return bool(done) and int(done[-1]) > 0

    def finish(self, timeout_s: float = 180) -> tuple[list[dict], list[dict], dict]:
        self.proc.wait(timeout_s)
        text = self.log.read_text(errors="replace")
        assert self.proc.returncode == 0, text[-3000:]
        summary = json.loads(text.strip().splitlines()[-1])
        return _jsonl(self.records), _jsonl(self.calls), summary


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _healthy_again(settings, name: str, old_pid: int, timeout_s: float = 180) -> float:
    wait(lambda: (r := row(status(settings), name))["healthy"] and r["pid"] not in (None, old_pid), timeout_s,
         f"{name} to be restarted and healthy", explain=lambda: explain_system(settings))
    return time.time()


def _all_healthy(settings, timeout_s: float = 180) -> None:
    wait(lambda: status(settings)["healthy"], timeout_s, "every component to be healthy",
         explain=lambda: explain_system(settings))


def _events(settings, topic: str) -> list:
    return [r.event for r in read_topic(settings, topic) if r.event is not None]


def _lag_zero(settings, *names: str) -> bool:
    st = status(settings)
    return all(row(st, n)["lag"] == 0 for n in names)


def _history_count(settings, table: str) -> int:
    proc = cli(settings, "sql", f"SELECT count() AS n, uniqExact(event_id) AS u FROM tabloop.{table} FINAL",
               "--format", "json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert int(got["n"]) == int(got["u"]), f"{table}: {got}"  # FINAL folds an event stored twice
    return int(got["n"])


def five_xx_outside(calls: list[dict], windows: list[tuple[float, float]]) -> list[dict]:
    """The calls answered 5xx that do not overlap any (start, end) window."""
    return [c for c in calls if c["status"] is not None and c["status"] >= 500
            and not any(c["started_at"] <= end and c["ended_at"] >= start for start, end in windows)]


def test_five_xx_outside_windows_by_hand():
    calls = [{"status": 503, "started_at": 10.0, "ended_at": 11.0},  # inside (10, 20)
             {"status": 500, "started_at": 9.0, "ended_at": 10.5},  # overlaps its start
             {"status": 502, "started_at": 25.0, "ended_at": 26.0},  # outside
             {"status": 200, "started_at": 25.0, "ended_at": 26.0},
             {"status": None, "started_at": 30.0, "ended_at": 30.1}]
    assert five_xx_outside(calls, [(10.0, 20.0)]) == [calls[2]]
    assert five_xx_outside(calls, []) == calls[:3]


def _kill_phase(settings, out: Path, name: str) -> tuple:
    """Load, SIGKILL component ``name``, wait until the supervisor has it healthy again, let the load end."""
    _all_healthy(settings)
    load = Load(settings, out, name, duration_s=45)
    wait(load.started, 60, f"the simulator of phase {name} to get answers")
    time.sleep(3)
    old = row(status(settings), name)["pid"]
    killed_at = time.time()
    os.kill(old, signal.SIGKILL)
    back_at = _healthy_again(settings, name, old)
    return (name, *load.finish(), (killed_at, back_at + SLACK_S))


def _kafka_phase(settings, out: Path, name: str = "kafka", kill: tuple[str, ...] = ()) -> tuple:
    """Load, stop the broker for ``KAFKA_OUTAGE_S`` and start it again on the same data, let the load end.
    With ``kill``, issue 32's combination: those components are SIGKILLed halfway through the outage (the
    supervisor starts them again, without Kafka). (Each fault alone passed the drills while the broker away and
    the front door and the worker killed left episodes twice on the topic, committed.)"""
    _all_healthy(settings)
    load = Load(settings, out, name, duration_s=KAFKA_OUTAGE_S + 40)
    wait(load.started, 60, f"the simulator of phase {name} to get answers")
    time.sleep(3)
    stopped_at = time.time()
    stop = cli(settings, "kafka", "stop")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    time.sleep(KAFKA_OUTAGE_S / 2)
    killed = {component: row(status(settings), component)["pid"] for component in kill}
    for pid in killed.values():
        os.kill(pid, signal.SIGKILL)
    time.sleep(KAFKA_OUTAGE_S / 2)
    start = cli(settings, "kafka", "start", timeout=180)
    assert start.returncode == 0, start.stdout + start.stderr
    back_at = max([time.time()] + [_healthy_again(settings, component, pid) for component, pid in killed.items()])
    return (name, *load.finish(), (stopped_at, back_at + SLACK_S))


# The components SIGKILLed in turn, then Kafka stopped, then both at once. Kafka last: the kills run as they did
# when they had a system of their own, on a broker that has not been away, and the drain comes right after the
# broker's restart.
PHASES = ("serve", "streams", "trainer", "history", "kafka", "kafka-kills")
PHASE_RUNS = {"kafka": _kafka_phase,
              "kafka-kills": functools.partial(_kafka_phase, name="kafka-kills", kill=("serve", "streams"))}


@pytest.mark.drill
@pytest.mark.kafka
@pytest.mark.timeout(1800)
def test_faults_lose_nothing_acknowledged(tiny_model, tmp_path):
    """SIGKILL the front door, the streams worker, the trainer, the history sink in turn, then stop Kafka
    for 30 s: all on one system (and broker), then one drain and one set of checks over every phase."""
    state = tmp_path / "state"
    out = tmp_path / "load"
    out.mkdir()
    settings = make_settings(state, kafka_bootstrap=f"127.0.0.1:{free_port()}", completions_port=free_port(),
                             feedback_port=free_port(), history_port=free_port(), topic_partitions=TEST_PARTITIONS,
                             model=tiny_model, trainer_batch_size=4, trainer_save_every=1, trainer_batch_wait_s=5.0,
                             trainer_micro_batch=4, trainer_max_staleness=1)
    phases: list[tuple[str, list[dict], list[dict], dict, tuple[float, float]]] = []
    try:
        up = cli(settings, "up", timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
        for name in PHASES:
            phases.append(PHASE_RUNS[name](settings, out) if name in PHASE_RUNS else _kill_phase(settings, out, name))
        _all_healthy(settings, timeout_s=240)

        # Everything drained: the worker joined every feedback, the trainer saved what it trained, the sink
        # stored it all; the counts then stay put.
        acknowledged = {r["feedback_event_id"]: (name, r) for name, records, *_ in phases for r in records
                        if r["feedback_status"] == 202}
        # Every phase had feedback acknowledged, each with its event id: else what follows holds of nothing.
        assert {n for n, _ in acknowledged.values()} == {n for n, *_ in phases}, Counter(
            n for n, _ in acknowledged.values())
        assert all(isinstance(i, str) and i for i in acknowledged), [i for i in acknowledged if not i][:3]
        wait(lambda: acknowledged.keys() <= {e.event_id for e in _events(settings, FEEDBACK.name)}, 120,
             "every acknowledged feedback on tabloop.feedback (the spool replayed)")
        drained = None
        try:
            wait(lambda: _lag_zero(settings, "streams", "trainer", "history"), 480,
                 "every consumer group's lag to be 0", explain=lambda: explain_system(settings))
            time.sleep(8)
            wait(lambda: _lag_zero(settings, "streams", "trainer", "history"), 120, "lag 0 to hold")
        except AssertionError as exc:  # still check the rest, on what is there
            lags = {n: row(status(settings), n)["lag"] for n in ("streams", "trainer", "history")}
            drained = f"{exc}: lags {lags}"
        # The worker's own repartition topics too (the lag above counts the event log only): each of
        # their partitions keeps committing.
        stalled = stalled_partitions(settings)
        topics = {t: _events(settings, t) for t in HISTORY_TABLES}
        # The history as the sink answers it (it owns the embedded ClickHouse while it runs).
        stored = {t: _history_count(settings, HISTORY_TABLES[t]) for t in topics}
    finally:
        down = cli(settings, "down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert processes_of(state) == []

    failed = [drained] if drained else []  # every check runs; the drill reports all that failed
    if stalled:
        failed.append(f"streams partitions that stopped committing: {stalled}")
    report = {name: {"summary": {k: s[k] for k in ("completed", "errors", "shown", "feedback_sent",
                                                   "feedback_errors")},
                     "window_s": round(w[1] - w[0], 1)} for name, _, _, s, w in phases}
    print("drill: phases", json.dumps(report))
    failed += [f"phase {name}: no feedback sent" for name, _, _, s, _ in phases if not s["feedback_sent"]]

    # Every 202 is exactly one FeedbackReceived …
    feedback_ids = Counter(e.event_id for e in topics[FEEDBACK.name])
    missing = [i for i in acknowledged if feedback_ids[i] == 0]
    twice = [i for i in acknowledged if feedback_ids[i] > 1]
    if missing or twice:
        failed.append(f"acknowledged feedback missing: {len(missing)} {missing[:3]}, twice: {len(twice)} {twice[:3]}")
    # … and at most one Episode; no episode twice.
    episodes = topics[EPISODES.name]
    by_event = Counter(e.event_id for e in episodes)
    by_feedback = Counter(e.record["feedback_event_id"] for e in episodes if e.record["feedback_event_id"])
    same_id = [k for k, n in by_event.items() if n > 1]
    one_feedback = [k for k, n in by_feedback.items() if n > 1]
    if same_id or one_feedback:
        pairs = Counter(tuple(sorted(e.record["matched"] for e in episodes if e.record["feedback_event_id"] == k))
                        for k in one_feedback)
        failed.append(f"duplicate episodes: {len(same_id)} event ids twice; {len(one_feedback)} feedback with "
                      f"more than one episode (matched flags: {dict(pairs)}), e.g. {one_feedback[:3]}")
    joined = [i for i in acknowledged if by_feedback[i] >= 1]
    if not joined:
        failed.append("no acknowledged feedback became an episode")
    print(f"drill: {len(acknowledged)} feedback answered 202, {len(joined)} became episodes, "
          f"{len(episodes)} episodes in all")

    # One unbroken sequence of policy versions, each announced as a candidate once.
    weights = [e.record for e in topics[WEIGHTS.name]]
    versions = sorted({w["version"] for w in weights if w["version"] > 0})
    if not versions or versions != list(range(1, versions[-1] + 1)):
        failed.append(f"policy versions not 1..N: {versions}")
    candidates = Counter(w["version"] for w in weights if w["status"] == "CANDIDATE")
    if any(n > 1 for n in candidates.values()):
        failed.append(f"versions announced twice: {[v for v, n in candidates.items() if n > 1]}")
    print(f"drill: policy versions 1..{versions[-1] if versions else 0}")

    # The history holds what the topics hold.
    counts = {t: (len({e.event_id for e in events}), stored[t]) for t, events in topics.items()}
    print(f"drill: (topic, history) counts {counts}")
    if any(on_topic != stored for on_topic, stored in counts.values()):
        failed.append(f"history counts differ from the topics': {counts}")

    # No 5xx outside the window of what was killed (the front door's own restart: connections refused).
    for name, records, calls, summary, window in phases:
        bad = five_xx_outside(calls, [window])
        if bad:
            failed.append(f"phase {name}: {len(bad)} 5xx outside {window}: {bad[:3]}")
        print(f"drill: phase {name}: calls by (kind, status) "
              f"{dict(Counter((c['kind'], c['status']) for c in calls))}")
    assert failed == [], "\n".join(failed)
