"""The show-gate's pure parts by hand: its features, its fit, its operating point, its decisions, and the
propensity weighting that lets it learn from what it chose to show."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from policy.show_gate import (FEATURES, KEPT_BY, Decided, FitConfig, Gate, choose_threshold, cross_fitted_scores,
                              fit_gate, fit_logistic, kept_gains, line_features, sigmoid)


def test_line_features_by_hand():
    f = line_features("  x = 1 ", [-0.5, -2.0, -0.25])
    assert len(f) == len(FEATURES)
    assert f == pytest.approx([math.log(4), math.log(6), -0.5, -2.75 / 3, -2.0, -2.75, -0.25])
    # A logprob far outside the nucleus (logged near -50) is clipped, so it cannot decide the score alone.
    assert line_features("a", [-50.0])[2:] == pytest.approx([-30.0] * 5)


def test_fit_logistic_solves_the_penalised_likelihood():
    """At the optimum the gradient vanishes: Σ w (p − y) = 0 (intercept) and Σ w (p − y) z_j + l2 θ_j = 0."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(200, 2))
    y = (rng.random(200) < sigmoid(1.5 * X[:, 0] - 0.5)).astype(float)
    w = rng.uniform(1, 10, size=200)
    coef, intercept, mean, scale = fit_logistic(X, y, w, l2=2.0)
    wn = w * len(w) / w.sum()
    Z = (X - mean) / scale
    p = sigmoid(Z @ coef + intercept)
    assert abs(np.sum(wn * (p - y))) < 1e-6
    assert np.allclose(Z.T @ (wn * (p - y)) + 2.0 * coef, 0, atol=1e-6)
    assert coef[0] > 0.5 and abs(coef[1]) < 0.3  # the informative feature carries the weight


def test_fit_logistic_refuses_shapes_that_do_not_match():
    with pytest.raises(ValueError, match="same samples"):
        fit_logistic(np.zeros((3, 2)), np.zeros(4))


def test_choose_threshold_keeps_the_accepted_characters_by_hand():
    scores = [0.05, 0.1, 0.2, 0.3, 0.9]
    chars = [0, 0, 2, 0, 98]  # 100 accepted characters in all
    assert choose_threshold(scores, chars, [1] * 5, keep=0.99) == 0.2  # hiding the 0.2 line would lose 2 %
    assert choose_threshold(scores, chars, [1] * 5, keep=0.98) == 0.9  # 98 % kept: everything below 0.9 hides
    # Weights count: the 0.2 line stands for 10 lines shown once in ten, so hiding it loses 20 of 118.
    assert choose_threshold(scores, chars, [1, 1, 10, 1, 1], keep=0.9) == 0.2
    assert choose_threshold(scores, [0] * 5, [1] * 5) == 0.0  # nothing accepted: show everything
    # Equal scores are never split: hiding the first 0.1 line alone would lose nothing, but its twin at 0.1
    # holds 10 % of the characters, so both stay shown.
    assert choose_threshold([0.1, 0.1, 0.5], [0, 1, 9], [1, 1, 1], keep=0.95) == 0.0
    assert choose_threshold([0.1, 0.1, 0.5], [0, 1, 9], [1, 1, 1], keep=0.9) == 0.5


def test_one_explored_acceptance_stops_the_realised_rule_not_the_expected_one():
    """Lines scored 0.01, 0.02, 0.5, 0.6, 10 characters each; the first, accepted, was shown by exploration
    (p = 0.1: it stands for 10 lines). Realised, it holds 100 of the 120 accepted characters, so nothing can
    be hidden at keep 0.9. Expected (score × characters × weight: 1, 0.2, 5, 6 of 12.2), hiding the two
    lowest loses 1.2 / 12.2 = 9.8 %: the threshold is 0.5."""
    scores = [0.01, 0.02, 0.5, 0.6]
    decided = [Decided((0.0,) * 7, True, 10.0, 0.1, 10.0), Decided((0.0,) * 7, False, 0.0, 1.0, 10.0),
               Decided((0.0,) * 7, True, 10.0, 1.0, 10.0), Decided((0.0,) * 7, True, 10.0, 1.0, 10.0)]
    w = [1 / d.show_probability for d in decided]
    assert kept_gains(decided, scores, "realised") == [10.0, 0.0, 10.0, 10.0]
    assert kept_gains(decided, scores, "expected") == pytest.approx([0.1, 0.2, 5.0, 6.0])
    assert choose_threshold(scores, kept_gains(decided, scores, "realised"), w, keep=0.9) == 0.0
    assert choose_threshold(scores, kept_gains(decided, scores, "expected"), w, keep=0.9) == 0.5
    with pytest.raises(ValueError, match="line_chars"):
        kept_gains([Decided((0.0,) * 7, False, 0.0)], [0.5], "expected")
    with pytest.raises(ValueError, match="kept_by must be one of"):
        kept_gains(decided, scores, "both")


def test_gate_decides_by_its_threshold_and_explores_below_it():
    gate = Gate(coef=(1.0,) + (0.0,) * 6, intercept=0.0, mean=(0.0,) * 7, scale=(1.0,) * 7, threshold=0.5,
                exploration=0.25)
    assert gate.score([0.0] * 7) == pytest.approx(0.5)
    assert gate.score([2.0] + [0.0] * 6) == pytest.approx(1 / (1 + math.exp(-2)))
    assert gate.decide(0.5) == (True, 1.0)
    rng = random.Random(3)
    shown = [gate.decide(0.1, rng) for _ in range(4000)]
    assert {p for _, p in shown} == {0.25}
    assert 0.22 < sum(s for s, _ in shown) / len(shown) < 0.28


def test_a_gate_round_trips_through_its_event_and_refuses_other_features():
    gate = Gate(coef=tuple(range(7)), intercept=0.5, mean=(1.0,) * 7, scale=(2.0,) * 7, threshold=0.3,
                exploration=0.1, version=4, project_id="p", policy_version=2)
    assert Gate.from_record(gate.as_record()) == gate
    with pytest.raises(ValueError, match="scores features"):
        Gate.from_record({**gate.as_record(), "feature_names": ["x"]})


def simulated_traffic(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lines whose truth is known: features, the true acceptance probability, and the line's length."""
    X = rng.normal(size=(n, len(FEATURES)))
    p_true = sigmoid(2.0 * X[:, 3] + 0.8 * X[:, 1] - 1.2)  # mean logprob and length decide, about 30 % accepted
    chars = np.round(np.exp(1.5 + 0.5 * X[:, 1]))
    return X, p_true, chars


def test_inverse_propensity_weights_make_the_logged_sums_unbiased_on_a_simulated_bandit():
    """A gate shows what it scores high and explores the rest with ε. Summed over shown lines, accepted
    characters weighted by 1 / show probability estimate what always-show would have got; unweighted they
    fall short by about what the gate hid. Averaged over 200 logs, the weighted estimate is within 2 % of
    the truth; the unweighted one is far off."""
    logging_gate = Gate(coef=(0, 0, 0, 2.0, 0, 0, 0), intercept=-1.2, mean=(0.0,) * 7, scale=(1.0,) * 7,
                        threshold=0.3, exploration=0.1)
    weighted, unweighted, truth = [], [], []
    for seed in range(200):
        rng = np.random.default_rng(seed)
        X, p_true, chars = simulated_traffic(rng, 400)
        accepted = rng.random(400) < p_true
        probs = np.array([logging_gate.show_probability(logging_gate.score(x)) for x in X])
        shown = rng.random(400) < probs
        truth.append(float(np.sum(chars * accepted)))  # what always-show would have got on this traffic
        weighted.append(float(np.sum((chars * accepted / probs)[shown])))
        unweighted.append(float(np.sum((chars * accepted)[shown])))
    assert abs(np.mean(weighted) / np.mean(truth) - 1) < 0.02
    assert np.mean(unweighted) / np.mean(truth) < 0.9


@pytest.mark.parametrize("kept_by", KEPT_BY)
def test_fit_gate_learns_from_gated_traffic_and_keeps_the_accepted_characters(kept_by):
    """Fit on a log the exploring gate above produced, the new gate's threshold keeps ≥ 99 % of accepted
    characters (within noise) on fresh always-shown traffic and hides a good share of the rejected lines,
    whichever way the kept characters are counted."""
    rng = np.random.default_rng(7)
    X, p_true, chars = simulated_traffic(rng, 3000)
    accepted = rng.random(3000) < p_true
    logging_gate = Gate(coef=(0, 0, 0, 2.0, 0, 0, 0), intercept=-1.2, mean=(0.0,) * 7, scale=(1.0,) * 7,
                        threshold=0.3, exploration=0.1)
    probs = np.array([logging_gate.show_probability(logging_gate.score(x)) for x in X])
    shown = rng.random(3000) < probs
    decided = [Decided(tuple(x), bool(a), float(c if a else 0), float(p), float(c))
               for x, a, c, p, s in zip(X, accepted, chars, probs, shown) if s]
    fit = fit_gate(decided, FitConfig(keep=0.99, kept_by=kept_by), version=1)
    assert fit is not None and fit.gate.threshold > 0
    gate = fit.gate
    X2, p2, chars2 = simulated_traffic(np.random.default_rng(8), 20000)
    show = np.array([gate.score(x) >= gate.threshold for x in X2])
    kept = np.sum((p2 * chars2)[show]) / np.sum(p2 * chars2)
    assert kept > 0.97
    hidden_rejects = np.sum((1 - p2)[~show]) / np.sum(1 - p2)
    assert hidden_rejects > 0.15
    assert np.mean(p2[show]) > np.mean(p2) * 1.1  # the accept rate among shown rises


def test_fit_gate_waits_for_enough_of_each_outcome():
    one_class = [Decided((0.0,) * 7, False, 0.0) for _ in range(100)]
    assert fit_gate(one_class) is None
    few = [Decided((float(i),) * 7, i % 2 == 0, 3.0 * (i % 2 == 0)) for i in range(20)]
    assert fit_gate(few, FitConfig(min_decided=50)) is None


def test_cross_fitted_scores_are_out_of_sample():
    """A line's cross-fitted score comes from a model that never saw it: on pure noise the in-sample fit
    separates its own labels better than chance, the cross-fitted scores do not."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 7))
    y = (rng.random(60) < 0.5).astype(float)
    w = np.ones(60)
    coef, intercept, mean, scale = fit_logistic(X, y, w, l2=0.01)
    in_sample = sigmoid(((X - mean) / scale) @ coef + intercept)
    crossed = cross_fitted_scores(X, y, w, l2=0.01)

    def auc(s):
        pos, neg = s[y == 1], s[y == 0]
        return float(np.mean([(a > b) + 0.5 * (a == b) for a in pos for b in neg]))

    assert auc(in_sample) > 0.7
    assert auc(crossed) < 0.62
