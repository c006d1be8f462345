"""The promotion gate's pure parts (trainer/promotion.py), the trainer's staleness exception for the serving
version, and the history's version_estimates view; tests/test_gate_trainer.py runs the gate in a real
trainer on the real broker."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from schemas.events import new_event
from trainer.promotion import GateDecision, HeldOutPool, estimate_metrics, gate_decision, in_gate_holdout


def test_the_holdout_is_a_stable_share_of_completion_ids():
    ids = [f"cmpl-{i}" for i in range(20000)]
    held = [i for i in ids if in_gate_holdout(i, 0.1)]
    assert 0.09 < len(held) / len(ids) < 0.11
    assert held == [i for i in ids if in_gate_holdout(i, 0.1)]  # the same on every replay
    # A larger share holds out a superset: raising it never puts a held-out episode back into training.
    assert set(held) <= {i for i in ids if in_gate_holdout(i, 0.3)}


def test_the_held_out_pool_keeps_the_newest_episodes_each_once():
    pool = HeldOutPool(3)
    assert [pool.add({"completion_id": c}) for c in "abcb"] == [True, True, True, False]  # b from the other reader
    assert pool.add({"completion_id": "d"})  # a, the oldest, goes
    assert [e["completion_id"] for e in pool] == ["b", "c", "d"] and len(pool) == 3
    assert pool.add({"completion_id": "a"})  # gone, so kept again as the newest


def test_the_gate_needs_enough_episodes_and_a_lower_bound_above_the_serving_reward():
    assert gate_decision(0.30, 0.10, 99, min_episodes=100) == GateDecision(
        False, "99 held-out episodes of the serving version, 100 needed")
    assert gate_decision(0.11, 0.10, 100, min_episodes=100).passed
    refused = gate_decision(0.10, 0.10, 500, min_episodes=100)
    assert not refused.passed and "0.1000 <= serving 0.1000" in refused.reason
    assert not gate_decision(None, 0.10, 500, min_episodes=100).passed


def test_estimate_metrics_flatten_the_evaluation():
    result = {"episodes": 120, "effective_sample_size": 80.5, "clipped_share": 0.01, "level": 0.9,
              "accept_rate_shown": {"value": 0.4, "low": 0.3, "high": 0.5}, "shown_share": None,
              "reward_mean": {"value": 0.1, "low": 0.0, "high": 0.2},
              "reward_mean_dr": {"value": 0.12, "low": 0.05, "high": 0.19},
              "logged": {"accept_rate_shown": 0.35, "shown_share": 0.9, "reward_mean": 0.04}}
    m = estimate_metrics(result, serving_version=3, held_out=120, decision=GateDecision(True, "x"))
    assert m["ope_gate_passed"] == 1.0 and m["ope_serving_version"] == 3.0 and m["ope_ess"] == 80.5
    assert (m["ope_reward_mean_dr"], m["ope_reward_mean_dr_low"], m["ope_reward_mean_dr_high"]) == (0.12, 0.05, 0.19)
    assert m["ope_serving_reward_mean"] == 0.04 and "ope_shown_share" not in m
    waiting = estimate_metrics(None, serving_version=3, held_out=7, decision=GateDecision(False, "y"))
    assert waiting == {"ope_serving_version": 3.0, "ope_held_out": 7.0, "ope_gate_passed": 0.0}


def _episode(version: int) -> dict:
    return {"completion_token_ids": [5], "completion_text": "x", "temperature": 1.0, "top_p": 1.0,
            "policy_version": version}


def test_episodes_of_the_serving_version_are_never_stale():
    from trainer.online import drop_reason

    assert drop_reason(_episode(2), 10, 4) == "stale"
    # Versions 3..10 were held back by the gate: version 2 is what users are served, today's traffic.
    assert drop_reason(_episode(2), 10, 4, serving_version=2) is None
    assert drop_reason(_episode(1), 10, 4, serving_version=2) == "stale"
    assert drop_reason(_episode(7), 10, 4, serving_version=2) is None


def _weight_event(version: int, status: str, at: datetime, metrics: dict) -> object:
    return new_event("WeightVersion", created_at=at, version=version, parent_version=version - 1, base_model="m",
                     kind="LORA", uri=f"file:///w/{version}", sha256="0" * 64, size_bytes=1, trainer_step=version,
                     episodes_consumed=1, source_offsets={}, metrics=metrics, status=status)


def test_version_estimates_view_puts_the_estimate_beside_the_canary():
    from tests.history_fixture import insert_events, new_store

    t0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
    gate = {"ope_gate_passed": 1.0, "ope_serving_version": 0.0, "ope_held_out": 150.0, "ope_ess": 90.0,
            "ope_reward_mean_dr": 0.2, "ope_reward_mean_dr_low": 0.1, "ope_reward_mean_dr_high": 0.3,
            "ope_accept_rate_shown": 0.45, "ope_serving_reward_mean": 0.05, "canary_share": 0.5}
    events = [
        _weight_event(1, "CANDIDATE", t0, gate),
        _weight_event(1, "PROMOTED", t0 + timedelta(minutes=5),
                      {**{k: v for k, v in gate.items() if k != "canary_share"},
                       "canary_candidate_accept_rate": 0.42, "canary_candidate_episodes": 60.0}),
        _weight_event(2, "CANDIDATE", t0 + timedelta(minutes=6),
                      {"ope_gate_passed": 0.0, "ope_serving_version": 1.0, "ope_held_out": 12.0}),
        _weight_event(3, "PROMOTED", t0 + timedelta(minutes=7), {"reward_mean": 0.1}),  # no gate: not listed
    ]
    store = new_store()
    insert_events(store, events)
    insert_events(store, events[:1])  # a redelivery counts once
    rows = {r["version"]: r for r in store.query(f"SELECT * FROM {store.database}.version_estimates").records()}
    assert sorted(rows) == [1, 2]
    one = rows[1]
    assert one["status"] == "PROMOTED" and one["gate_passed"] == 1.0 and one["held_out_episodes"] == 150.0
    assert (one["reward_low"], one["reward_estimate"], one["reward_high"]) == (0.1, 0.2, 0.3)
    assert one["canary_accept_rate"] == pytest.approx(0.42) and one["canary_episodes"] == 60.0
    assert one["accept_rate_estimate"] == 0.45 and one["serving_reward"] == 0.05
    two = rows[2]
    assert two["status"] == "CANDIDATE" and two["gate_passed"] == 0.0 and two["reward_estimate"] is None
    assert two["canary_accept_rate"] is None
