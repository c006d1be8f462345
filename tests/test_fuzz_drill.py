"""The seeded fault fuzzer (issue 44): schedules drawn from a seed, the invariants' arithmetic by hand, the
command's errors, and (a drill) the issue's six-duplicate case plus one drawn seed on a real system."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from streams.upstream import TRANSACTION_TIMEOUT_S
from tabloop.fuzz import (FAULT_KINDS, NAMED_SCHEDULES, TARGETS, Fault, SeedRun, draw_schedule, episode_violations,
                          replay_command, violation_keys)
from tests.system_helpers import ROOT

CI_SEED = 6  # one drawn schedule in CI: a second worker joins, the trainer is killed, a worker race (2 ms)
CI_LOAD_S = 30.0


def episode(event_id: str, completion_id: str, feedback: str | None, matched: bool = True) -> dict:
    return {"event_id": event_id, "completion_id": completion_id, "feedback_event_id": feedback, "matched": matched}


def test_a_seed_draws_the_same_schedule_every_time_and_seeds_differ():
    assert draw_schedule(11, 30.0) == draw_schedule(11, 30.0)
    schedules = {draw_schedule(seed, 30.0) for seed in range(40)}
    assert len(schedules) == 40
    kinds = Counter(f.kind for s in schedules for f in s)
    assert set(kinds) == set(FAULT_KINDS), kinds  # forty seeds try every kind of fault


def test_every_drawn_fault_lands_within_the_load_and_names_a_real_target():
    for seed in range(200):
        schedule = draw_schedule(seed, 45.0)
        assert 1 <= len(schedule) <= 3
        assert [f.at_s for f in schedule] == sorted(f.at_s for f in schedule)
        for f in schedule:
            assert 2.0 <= f.at_s <= 30.0, f
            assert f.target in TARGETS + ("kafka",), f
            assert (f.target == "kafka") == f.kind.startswith("kafka"), f
            assert f.hold_s == 0.0 if f.kind == "kill" else f.hold_s > 0, f
            assert 0 <= f.delay_ms <= 100 and (f.delay_ms == 0 or f.kind == "join_race"), f


def test_bad_schedules_are_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="unknown fault kind 'explode'"):
        Fault(1.0, "explode", "serve")
    with pytest.raises(ValueError, match="at least 10 s"):
        draw_schedule(1, 5.0)


def test_the_named_schedules_are_the_issues_cases():
    assert NAMED_SCHEDULES["kafka-30s"] == (Fault(5.0, "kafka_stop", "kafka", 30.0),)
    # Longer than a transaction may stay open: the broker aborts the worker's transactions as it wakes.
    (freeze,) = NAMED_SCHEDULES["kafka-paused-45s"]
    assert freeze.kind == "kafka_pause" and freeze.hold_s > TRANSACTION_TIMEOUT_S
    (race,) = NAMED_SCHEDULES["race-50ms"]
    assert race.kind == "join_race" and race.delay_ms == 50


def test_a_clean_seed_has_no_violation_and_counts_feedback_without_an_episode():
    episodes = [episode("e1", "c1", "f1"), episode("e2", "c2", "f2"), episode("e3", "unmatched-f4", "f4", False)]
    violations, facts = episode_violations(["f1", "f2", "f3", "f4"], Counter(f1=1, f2=1, f3=1, f4=1), episodes)
    assert violations == []
    assert facts == {"acknowledged": 4, "episodes": 3, "feedback_without_episode": 1}  # f3


def test_lost_and_doubled_feedback_and_episodes_are_each_named():
    episodes = [episode("e1", "c1", "f1"), episode("e1", "c1", "f1"),  # committed twice: one event id
                episode("e2", "c2", "f2"), episode("e9", "c2", "f5")]  # two episodes of one completion
    violations, _ = episode_violations(["f1", "f2", "f3", "f5"], Counter(f1=1, f2=2, f5=1), episodes)
    assert violations == [
        "acknowledged feedback missing from its topic: 1, e.g. ['f3']",
        "acknowledged feedback twice on its topic: 1, e.g. ['f2']",
        "episode event ids twice: 1, e.g. ['e1']",
        "completions with two episodes: 2, e.g. ['c1', 'c2']",
        "feedback in two episodes: 1, e.g. ['f1']",
    ]


def test_a_violation_an_earlier_seed_reported_is_not_reported_again():
    episodes = [episode("e1", "c1", "f1"), episode("e1", "c1", "f1")]
    known = violation_keys(Counter(f1=1), episodes)
    assert known == {"e1", "c1", "f1"}
    assert episode_violations(["f1"], Counter(f1=1), episodes, known)[0] == []
    assert episode_violations(["f1"], Counter(f1=1), episodes + [episode("e7", "c7", "f7")] * 2, known)[0] == [
        "episode event ids twice: 1, e.g. ['e7']", "completions with two episodes: 1, e.g. ['c7']",
        "feedback in two episodes: 1, e.g. ['f7']"]


def test_a_failing_seed_says_how_to_replay_it():
    assert replay_command(SeedRun(7, ()), 30.0) == "tabloop drill fuzz --seeds 1 --first-seed 7 --load-s 30"
    assert replay_command(SeedRun("kafka-30s", ()), 45.0) == "tabloop drill fuzz --named kafka-30s --seeds 0 --load-s 45"


def test_the_command_refuses_an_unknown_schedule_before_starting_anything(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tabloop.cli", "drill", "fuzz", "--named", "nope", "--seeds", "0",
                           "--workdir", str(tmp_path / "fuzz"), "--model", "unused"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert "unknown named schedule(s) ['nope']: one of ['kafka-30s', 'kafka-paused-45s', 'race-50ms']" in done.stderr
    assert not (tmp_path / "fuzz").exists()


@pytest.mark.drill
@pytest.mark.kafka
@pytest.mark.timeout(1200)
def test_fuzzer_finds_no_violation_on_the_known_case_and_a_drawn_seed(tiny_model, tmp_path, capsys):
    from tabloop.fuzz import fuzz

    lines: list[str] = []
    runs = fuzz(1, CI_SEED, CI_LOAD_S, tmp_path, model=tiny_model, echo=lines.append, named=("kafka-30s",))
    with capsys.disabled():
        print("\n".join(lines))
    assert [r.seed for r in runs] == ["kafka-30s", CI_SEED]
    assert all(r.facts.get("acknowledged") for r in runs), [r.facts for r in runs]
    assert [(r.seed, r.violations) for r in runs if r.violations] == [], "\n".join(lines)
