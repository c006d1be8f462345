"""The stall guard: a process stuck inside one call ends with its own exit code and a message naming the call;
calls that return in time end nothing. (A history sink stuck in a commit: tests/test_history_sink.py.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from infra.settings import SettingsError, load_settings
from infra.stall_guard import EXIT_STALLED, StallGuard

ROOT = Path(__file__).resolve().parents[1]

# A loop of short guarded calls, then one that sleeps ``last_s``: what a process does under its guard.
GUARDED_LOOP = textwrap.dedent("""
    import sys, time
    from infra.stall_guard import StallGuard
    limit_s, short_calls, last_s = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    guard = StallGuard("a test loop", limit_s, check_every_s=0.1).start()
    for _ in range(short_calls):
        with guard.call("a short call"):
            time.sleep(0.05)
    with guard.call("sleeping on purpose"):
        time.sleep(last_s)
    print("returned")
""")


def run_loop(limit_s: float, short_calls: int, last_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", GUARDED_LOOP, str(limit_s), str(short_calls), str(last_s)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_call_past_the_limit_ends_the_process_with_its_exit_code_and_names_the_call():
    done = run_loop(limit_s=1.0, short_calls=5, last_s=60)
    assert done.returncode == EXIT_STALLED, (done.returncode, done.stderr[-2000:])
    assert "returned" not in done.stdout
    assert "a test loop: sleeping on purpose has not returned after" in done.stderr, done.stderr[-2000:]
    assert "TABLOOP_STALL_LIMIT_S" in done.stderr


def test_calls_that_return_within_the_limit_end_nothing():
    # 40 calls of 0.05 s: two seconds of guarded calls in all, each far under the limit of one second.
    done = run_loop(limit_s=1.0, short_calls=40, last_s=0.5)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "returned"
    assert "has not returned" not in done.stderr


def test_a_stalled_call_is_handed_to_on_stall_once_and_the_clock_restarts_with_the_next_call():
    import time

    stalls: list[str] = []
    guard = StallGuard("in-process", 0.3, on_stall=stalls.append, check_every_s=0.05).start()
    try:
        with guard.call("the first slow call"):
            time.sleep(1.0)
        with guard.call("a quick call"):
            time.sleep(0.01)
        with guard.call("the second slow call"):
            with guard.call("inside it"):  # nested: the outer call is the one watched and named
                time.sleep(1.0)
    finally:
        guard.stop()
    assert len(stalls) == 2, stalls
    assert "the first slow call has not returned" in stalls[0]
    assert "the second slow call has not returned" in stalls[1]


def test_a_limit_the_batch_wait_would_pass_is_refused_by_name():
    with pytest.raises(SettingsError) as refused:
        load_settings(environ={"TABLOOP_STALL_LIMIT_S": "10", "TABLOOP_HISTORY_BATCH_INTERVAL_S": "30"})
    assert "TABLOOP_STALL_LIMIT_S" in str(refused.value) and "TABLOOP_HISTORY_BATCH_INTERVAL_S" in str(refused.value)
    with pytest.raises(ValueError):
        StallGuard("no limit", 0)


def test_a_consumer_without_partitions_past_the_limit_is_reported_once_per_stretch():
    """The clock by hand: held none from t=10; reported at 10 + limit, not before, once; a partition back
    starts it over."""
    stalls: list[str] = []
    guard = StallGuard("a test loop", 30, on_stall=stalls.append)  # not started: no watcher thread needed
    guard.held_partitions(3, now=0)
    guard.held_partitions(0, now=10)
    guard.held_partitions(0, now=39.9)
    assert stalls == []
    guard.held_partitions(0, now=40)
    assert len(stalls) == 1 and "held no partition for 30 s" in stalls[0], stalls
    guard.held_partitions(0, now=100)
    assert len(stalls) == 1  # one report per stretch
    guard.held_partitions(1, now=101)
    guard.held_partitions(0, now=102)
    guard.held_partitions(0, now=131)
    assert len(stalls) == 1  # 29 s into the new stretch
    guard.held_partitions(0, now=132)
    assert len(stalls) == 2 and "for 30 s" in stalls[1], stalls
