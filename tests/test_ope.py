"""Off-policy estimators (trainer/ope.py), each checked by hand or against a simulation whose truth is known."""

from __future__ import annotations

import math
import random

import pytest

from trainer.ope import (Interval, LoggedOutcome, doubly_robust_reward, effective_sample_size, estimate,
                         fit_shown_reward, importance_weights, ratio_estimate, wilson_interval, z_score)


def outcome(log_ratio: float, shown: bool, accepted: bool, reward: float, abstain: float = 0.0) -> LoggedOutcome:
    return LoggedOutcome(behaviour_logprob=-5.0, target_logprob=-5.0 + log_ratio, shown=shown, accepted=accepted,
                         reward=reward, target_abstain_prob=abstain)


def test_weights_are_ratios_clipped_without_overflow():
    logged = [outcome(math.log(2), True, True, 1), outcome(0.0, True, False, 0), outcome(200.0, False, False, 0)]
    assert importance_weights(logged, clip=5.0) == pytest.approx([2.0, 1.0, 5.0])
    with pytest.raises(ValueError, match="clip"):
        importance_weights(logged, clip=0)


def test_effective_sample_size_by_hand():
    assert effective_sample_size([1, 1, 1, 1]) == pytest.approx(4)
    assert effective_sample_size([1, 0, 0, 0]) == pytest.approx(1)
    assert effective_sample_size([2, 1, 1]) == pytest.approx(16 / 6)
    assert effective_sample_size([]) == 0.0


def test_ratio_estimate_by_hand():
    # Σwy/Σwx = (2·1 + 1·0 + 1·1) / (2 + 1 + 1) = 0.75;
    # var = [ (2·(1−.75))² + (1·(0−.75))² + (1·(1−.75))² ] / 4² = (0.25 + 0.5625 + 0.0625) / 16
    got = ratio_estimate([2, 1, 1], [1, 0, 1], [1, 1, 1], level=0.9)
    sd = math.sqrt(0.875 / 16)
    assert got == Interval(pytest.approx(0.75), pytest.approx(0.75 - 1.6448536 * sd),
                           pytest.approx(0.75 + 1.6448536 * sd))
    assert ratio_estimate([1, 1], [0, 0], [0, 0]) is None
    with pytest.raises(ValueError):
        ratio_estimate([1], [1, 1], [1])
    assert z_score(0.9) == pytest.approx(1.6448536)
    with pytest.raises(ValueError, match="level"):
        z_score(1.0)


def test_a_rate_gets_a_wilson_interval_at_its_effective_number_of_episodes():
    z = 1.6448536
    # Equal weights: the textbook Wilson interval. 3 of 10 at 90 %: centre (0.3 + z²/20) / (1 + z²/10), half
    # z / (1 + z²/10) · sqrt(0.3·0.7/10 + z²/400).
    got = ratio_estimate([1] * 10, [1, 1, 1] + [0] * 7, [1] * 10, level=0.9, rate=True)
    assert (got.value, got.low, got.high) == (pytest.approx(0.3), pytest.approx(0.12687, abs=1e-4),
                                              pytest.approx(0.55831, abs=1e-4))
    # No accept in 25 shown: not the delta method's [0, 0] but [0, z²/(25 + z²)].
    none = ratio_estimate([1] * 25, [0] * 25, [1] * 25, level=0.9, rate=True)
    assert (none.value, none.low, none.high) == (0.0, 0.0, pytest.approx(z * z / (25 + z * z)))
    # Unequal weights: n is the smaller of Kish's (Σw)²/Σw² = 16/6 and R(1−R)/var = 0.1875 / (0.875/16).
    weighted = ratio_estimate([2, 1, 1], [1, 0, 1], [1, 1, 1], level=0.9, rate=True)
    assert weighted == wilson_interval(0.75, 16 / 6, z_score(0.9))
    assert wilson_interval(1.0, 2, z).high == 1.0 and wilson_interval(1.0, 2, z).low < 1.0  # inside [0, 1]


def test_evaluating_the_behaviour_itself_gives_the_logged_rates():
    logged = [outcome(0.0, True, True, 0.75), outcome(0.0, True, False, -0.25), outcome(0.0, False, False, 0.0),
              outcome(0.0, True, True, 0.75)]
    e = estimate(logged, ignored_reward=0.0)
    assert e.episodes == 4 and e.effective_sample_size == pytest.approx(4) and e.clipped_share == 0
    assert e.accept_rate_shown.value == pytest.approx(2 / 3)
    assert e.shown_share.value == pytest.approx(3 / 4)
    assert e.reward_mean.value == pytest.approx((0.75 - 0.25 + 0.75) / 4)


def test_fit_shown_reward_is_least_squares():
    a, b = fit_shown_reward([0.0, 0.5, 1.0], [1.0, 0.5, 0.0])
    assert (a, b) == (pytest.approx(1.0), pytest.approx(-1.0))
    a, b = fit_shown_reward([0.3, 0.3], [1.0, 0.0])  # no spread in p: the mean
    assert (a + b * 0.3, b) == (pytest.approx(0.5), pytest.approx(0.0))
    assert fit_shown_reward([], []) == (0.0, 0.0)


def test_doubly_robust_with_a_right_model_needs_no_weights():
    # Every shown suggestion earns 1 − p and nothing shown earns 0: the model fits exactly, residuals are 0,
    # and the estimate is the direct method's Σ (1 − p)² / n whatever the weights say.
    ps = [0.1, 0.4, 0.7]
    logged = [outcome(w, True, True, 1 - p, abstain=p) for w, p in zip([0.0, 3.0, -3.0], ps)]
    got = doubly_robust_reward(logged, importance_weights(logged, clip=100), ignored_reward=0.0)
    assert got.value == pytest.approx(sum((1 - p) ** 2 for p in ps) / 3)


def simulated_log(seed: int, n: int) -> list[LoggedOutcome]:
    """A bandit whose truth is known: contexts of two kinds; the behaviour shows a suggestion with probability
    0.9 in both; a shown suggestion is accepted with probability 0.6 (kind A) or 0.1 (kind B). The target
    policy shows with 0.9 on A and 0.2 on B."""
    rng = random.Random(seed)
    logged = []
    for _ in range(n):
        kind_a = rng.random() < 0.5
        shown = rng.random() < 0.9
        target_show = 0.9 if kind_a else 0.2
        accepted = shown and rng.random() < (0.6 if kind_a else 0.1)
        reward = (0.75 if accepted else -0.25) if shown else 0.0
        logged.append(LoggedOutcome(math.log(0.9 if shown else 0.1),
                                    math.log(target_show if shown else 1 - target_show), shown, accepted, reward,
                                    target_abstain_prob=1 - target_show))
    return logged


TRUE_ACCEPT = (0.5 * 0.9 * 0.6 + 0.5 * 0.2 * 0.1) / (0.5 * 0.9 + 0.5 * 0.2)
TRUE_SHOWN = 0.5 * 0.9 + 0.5 * 0.2
TRUE_REWARD = 0.5 * 0.9 * (0.6 * 0.75 - 0.4 * 0.25) + 0.5 * 0.2 * (0.1 * 0.75 - 0.9 * 0.25)


def test_90_percent_intervals_cover_the_target_policys_true_rates_about_90_percent_of_the_time():
    truths = {"accept_rate_shown": TRUE_ACCEPT, "shown_share": TRUE_SHOWN, "reward_mean": TRUE_REWARD,
              "reward_mean_dr": TRUE_REWARD}
    covered = dict.fromkeys(truths, 0)
    widths = dict.fromkeys(truths, 0.0)
    runs = 60
    for seed in range(runs):
        logged = simulated_log(seed, 2000)
        e = estimate(logged, clip=20, level=0.9)
        for name, truth in truths.items():
            got = getattr(e, name)
            covered[name] += got.low <= truth <= got.high
            widths[name] += (got.high - got.low) / runs
        assert 100 < e.effective_sample_size < 2000
    for name in truths:
        assert 0.75 <= covered[name] / runs <= 1.0, (name, covered[name])
        assert widths[name] < 0.1, (name, widths[name])
    # The reward model takes the show/abstain variance out: the doubly-robust interval is the narrower.
    assert widths["reward_mean_dr"] < widths["reward_mean"]
    # And the log's own accept rate is far from the target's: the estimate is not the log's mean.
    logged = simulated_log(0, 2000)
    assert abs(sum(o.accepted for o in logged) / sum(o.shown for o in logged) - TRUE_ACCEPT) > 0.15
