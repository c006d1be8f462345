"""Intervals clustered by task and paired by task (issue 41, item 6): every number worked by hand from the closed
forms in ``trainer/proof/intervals.py``."""

from __future__ import annotations

import math

import pytest

from trainer.ope import wilson_interval
from trainer.proof.intervals import Z, clustered_interval, paired_interval, ratio_se, task_sums
from trainer.proof.served import mean_interval, paired_difference


def test_task_sums_add_each_tasks_numerator_and_denominator():
    rows = [{"task_index": 0, "y": 1, "x": 1}, {"task_index": 1, "y": 0, "x": 1}, {"task_index": 0, "y": 2, "x": 0}]
    assert task_sums(rows, lambda r: r["y"], lambda r: r["x"]) == {0: (3.0, 1.0), 1: (0.0, 1.0)}


def test_the_ratio_and_its_cluster_robust_standard_error_by_hand():
    # Four tasks (Y, X): R = 3 / 6 = 0.5; residuals Y − R·X = 0, −0.5, 1, −0.5; Σ² = 1.5;
    # se² = n/(n−1) · Σ² / (ΣX)² = 4/3 · 1.5 / 36 = 1/18.
    clusters = [(1, 2), (0, 1), (2, 2), (0, 1)]
    r, se = ratio_se(clusters)
    assert r == 0.5 and se == pytest.approx(math.sqrt(1 / 18))
    mean = clustered_interval(clusters)
    half = Z * math.sqrt(1 / 18)  # 0.3877
    assert mean == {"value": 0.5, "low": round(0.5 - half, 4), "high": round(0.5 + half, 4),
                    "se": round(math.sqrt(1 / 18), 6), "tasks": 4}
    assert (mean["low"], mean["high"]) == (0.1123, 0.8877)
    # As a rate (accepted of shown): Wilson at n_eff = R(1 − R) / se² = 0.25 · 18 = 4.5 (under the 6 trials).
    rate = clustered_interval(clusters, rate=True)
    want = wilson_interval(0.5, 4.5, Z)
    assert rate["effective_n"] == 4.5 and (rate["low"], rate["high"]) == (round(want.low, 4), round(want.high, 4))
    # Wilson at 4.5 trials, by hand: centre 0.5; half z / (1 + z²/4.5) · √(0.25/4.5 + z²/81).
    by_hand = Z / (1 + Z * Z / 4.5) * math.sqrt(0.25 / 4.5 + Z * Z / 81)
    assert rate["high"] == round(0.5 + by_hand, 4)
    # Clustering widens it: the plain Wilson interval counts all 6 draws as independent trials.
    plain = wilson_interval(0.5, 6, Z)
    assert rate["high"] - rate["low"] > plain.high - plain.low


def test_equal_tasks_give_no_spread_and_a_rate_keeps_its_trials():
    same = [(1.0, 2.0)] * 5  # every task: one accepted of two shown
    assert clustered_interval(same) == {"value": 0.5, "low": 0.5, "high": 0.5, "se": 0.0, "tasks": 5}
    rate = clustered_interval(same, rate=True)  # n_eff capped at the 10 trials there are: the plain Wilson
    plain = wilson_interval(0.5, 10, Z)
    assert rate["effective_n"] == 10 and (rate["low"], rate["high"]) == (round(plain.low, 4), round(plain.high, 4))
    # A rate of 0: the delta method's se is 0, Wilson at all the trials is not zero-wide.
    zero = clustered_interval([(0, 2), (0, 1)], rate=True)
    assert zero["value"] == 0.0 and zero["low"] == 0.0 and zero["high"] == round(wilson_interval(0.0, 3, Z).high, 4)
    assert zero["high"] > 0


def test_one_draw_per_task_is_the_mean_and_equal_draws_are_the_per_task_means():
    # X = 1 per task: the standard error of a mean (sample sd / √n), the old normal interval.
    got = clustered_interval([(1, 1), (2, 1), (3, 1)])
    old = mean_interval([1.0, 2.0, 3.0])
    assert (got["value"], got["low"], got["high"]) == (old["value"], old["low"], old["high"]) == (2.0, 1.0503, 2.9497)
    # Two draws per task: the same as the interval over the per-task means (1, 2.5, 0).
    got = clustered_interval([(2, 2), (5, 2), (0, 2)])
    old = mean_interval([1.0, 2.5, 0.0])
    assert (got["value"], got["low"], got["high"]) == (old["value"], old["low"], old["high"])


def test_too_little_to_estimate_a_spread_says_so():
    assert clustered_interval([]) == {"value": None, "low": None, "high": None, "se": None, "tasks": 0}
    assert clustered_interval([(0, 0), (0, 0)], rate=True)["value"] is None  # nothing shown anywhere
    one = clustered_interval([(3, 2)])
    assert (one["value"], one["low"], one["high"], one["se"]) == (1.5, None, None, None)


def test_a_paired_difference_of_means_by_hand():
    # After: two draws per task; before: one. Tasks 0, 1, 2 in both (task 3 only before: left out).
    after = {0: (3.0, 2.0), 1: (2.0, 2.0), 2: (0.0, 2.0)}
    before = {0: (0.0, 1.0), 1: (1.0, 1.0), 2: (0.0, 1.0), 3: (5.0, 1.0)}
    # R_a = 5/6, mean X_a = 2; R_b = 1/3, mean X_b = 1. u_t = (Y_a − R_a X_a)/2 − (Y_b − R_b X_b)/1:
    # u_0 = (3 − 5/3)/2 + 1/3 = 1; u_1 = (2 − 5/3)/2 − 2/3 = −1/2; u_2 = −5/6 + 1/3 = −1/2.
    # se² = Σu² / (n(n − 1)) = 1.5 / 6 = 0.25; D = 5/6 − 1/3 = 0.5.
    d = paired_interval(after, before)
    assert d == {"value": 0.5, "low": round(0.5 - Z * 0.5, 4), "high": round(0.5 + Z * 0.5, 4), "se": 0.5,
                 "tasks": 3}
    # The same as the mean of per-task differences (1.5 − 0, 1 − 1, 0 − 0), the old paired interval.
    rows_after = [{"task_index": t, "c": c} for t, cs in ((0, (3, 0)), (1, (1, 1)), (2, (0, 0))) for c in cs]
    rows_before = [{"task_index": t, "c": c} for t, c in ((0, 0), (1, 1), (2, 0), (3, 5))]
    old = paired_difference(rows_after, rows_before, "c")
    assert (old["value"], old["low"], old["high"]) == (d["value"], d["low"], d["high"])


def test_a_paired_difference_of_rates_with_unequal_denominators_by_hand():
    # Accept rate among shown, (accepted, shown) per task. After: 2 of 3 shown; before: 2 of 4.
    after = {0: (1.0, 2.0), 1: (0.0, 0.0), 2: (1.0, 1.0)}
    before = {0: (0.0, 1.0), 1: (1.0, 2.0), 2: (1.0, 1.0)}
    # R_a = 2/3, mean X_a = 1; R_b = 1/2, mean X_b = 4/3.
    # u_0 = (1 − 4/3) − (0 − 1/2)·3/4 = 1/24; u_1 = 0 − (1 − 1)·3/4 = 0; u_2 = 1/3 − (1/2)·3/4 = −1/24.
    se = math.sqrt((2 / 576) / 6)
    d = paired_interval(after, before)
    assert d["value"] == round(2 / 3 - 1 / 2, 4) and d["se"] == round(se, 6) and d["tasks"] == 3
    assert (d["low"], d["high"]) == (round(1 / 6 - Z * se, 4), round(1 / 6 + Z * se, 4))
    # Identical policies differ by exactly 0, with no spread.
    assert paired_interval(after, after) == {"value": 0.0, "low": 0.0, "high": 0.0, "se": 0.0, "tasks": 3}
    # No task in common, or nothing shown by one of them: no difference to report.
    assert paired_interval({0: (1.0, 1.0)}, {1: (1.0, 1.0)})["value"] is None
    assert paired_interval({0: (0.0, 0.0), 1: (0.0, 0.0)}, before)["value"] is None
