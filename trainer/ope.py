"""Off-policy evaluation, as pure functions: what a weight version would score on traffic another one served.

Every episode carries what the serving policy (the *behaviour* b) did: the tokens it sampled and their
log-probabilities under the sampler that drew them. A candidate version V's log-probability of the same
tokens under the same sampler gives the importance weight w = π_V(y|x) / π_b(y|x); the logged outcomes
averaged with these weights estimate what V would have got on the same contexts, before any user sees V.

All estimates are self-normalised ratios Σ w·y / Σ w·x (a common scale of the weights cancels):

- accept rate among shown: Σ w·accepted / Σ w·shown;
- share shown: Σ w·shown / Σ w;
- mean reward: Σ w·reward / Σ w, and a doubly-robust one (``doubly_robust_reward``).

Weights are clipped at ``clip``: a sequence of 20 tokens can have a ratio of 10⁶ and decide an estimate on
its own. Clipping trades a bias towards the behaviour policy for bounded variance. The effective sample size
(Σw)² / Σw² says how many logged episodes an estimate is worth: near 1, V is so far from what served that
the log says little about it.

Intervals come from the delta method's normal approximation of a ratio estimator,
var(Σ w y / Σ w x) ≈ Σ w_i² (y_i − R·x_i)² / (Σ w_i x_i)², two-sided at ``level``. A rate (an accept rate,
a share: 0/1 outcomes) gets a Wilson score interval instead, at an effective number of episodes n: the
smaller of the Kish size of the weighted denominators, (Σ w x)² / Σ (w x)², and the design-effect size
R(1 − R) / var. The normal interval is zero-wide when no episode was accepted: 0 accepts in 25 shown gave
[0, 0], while 1 accept in 60 is entirely plausible at such a rate (seen on the whole loop,
docs/ope-vs-canary/). Wilson's gives [0, 0.098] there and stays inside [0, 1]; with equal weights it is the
textbook binomial interval.

``tests/test_ope.py`` checks each by hand.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Sequence


@dataclass(frozen=True)
class LoggedOutcome:
    """One logged episode as OPE needs it."""
    behaviour_logprob: float
    """log π_b(y|x): the sum of the served tokens' behaviour log-probabilities."""
    target_logprob: float
    """log π_V(y|x) of the same tokens under the same sampler (temperature, top-p)."""
    shown: bool
    accepted: bool
    reward: float
    target_abstain_prob: float = 0.0
    """π_V(nothing shown | x): V's probability of ending the completion at its first token."""


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float


def importance_weights(outcomes: Sequence[LoggedOutcome], clip: float) -> list[float]:
    """min(π_V/π_b, clip) per episode, computed in log space (a ratio of 10⁶⁰ must not overflow)."""
    if clip <= 0:
        raise ValueError(f"clip must be above 0, got {clip}")
    log_clip = math.log(clip)
    return [math.exp(min(o.target_logprob - o.behaviour_logprob, log_clip)) for o in outcomes]


def effective_sample_size(weights: Sequence[float]) -> float:
    """(Σw)² / Σw²: n when all weights are equal, 1 when one weight holds all the mass."""
    squares = sum(w * w for w in weights)
    return sum(weights) ** 2 / squares if squares > 0 else 0.0


def z_score(level: float) -> float:
    """The two-sided normal quantile of a ``level`` interval (0.90 → 1.645)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"the interval level must be in (0, 1), got {level}")
    return NormalDist().inv_cdf(0.5 + level / 2)


def ratio_estimate(weights: Sequence[float], numerators: Sequence[float], denominators: Sequence[float], *,
                   level: float = 0.9, rate: bool = False) -> Interval | None:
    """R = Σ w·y / Σ w·x with its delta-method interval, or for a ``rate`` (y and x 0 or 1) a Wilson score
    interval at an effective number of episodes (module doc); None when Σ w·x is 0 (nothing to divide by)."""
    if not len(weights) == len(numerators) == len(denominators):
        raise ValueError(f"{len(weights)} weights, {len(numerators)} numerators, {len(denominators)} denominators")
    below = sum(w * x for w, x in zip(weights, denominators))
    if below <= 0:
        return None
    ratio = sum(w * y for w, y in zip(weights, numerators)) / below
    variance = sum((w * (y - ratio * x)) ** 2 for w, y, x in zip(weights, numerators, denominators)) / below ** 2
    z = z_score(level)
    if not rate:
        half = z * math.sqrt(variance)
        return Interval(ratio, ratio - half, ratio + half)
    n = below ** 2 / sum((w * x) ** 2 for w, x in zip(weights, denominators))  # Kish
    if 0 < ratio < 1 and variance > 0:
        n = min(n, ratio * (1 - ratio) / variance)  # the design effect of weights that go with the outcome
    return wilson_interval(ratio, n, z)


def wilson_interval(rate: float, n: float, z: float) -> Interval:
    """The Wilson score interval of a proportion ``rate`` observed on ``n`` (possibly effective) trials."""
    shrink = 1 + z * z / n
    centre = (rate + z * z / (2 * n)) / shrink
    half = z / shrink * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n))
    return Interval(rate, max(0.0, centre - half), min(1.0, centre + half))


def fit_shown_reward(abstain_probs: Sequence[float], rewards: Sequence[float]) -> tuple[float, float]:
    """(a, b) of the least-squares line reward ≈ a + b·p through the shown episodes.

    p is V's probability of showing nothing at that context: how unsure V is there, the one feature of a
    context that is free to compute and that says most about whether a suggestion there gets accepted.
    When every p is the same the line is flat: b = 0, a = the mean reward.
    """
    n = len(rewards)
    if n == 0:
        return 0.0, 0.0
    mean_p = sum(abstain_probs) / n
    mean_r = sum(rewards) / n
    spread = sum((p - mean_p) ** 2 for p in abstain_probs)
    if spread < 1e-12:
        return mean_r, 0.0
    slope = sum((p - mean_p) * (r - mean_r) for p, r in zip(abstain_probs, rewards)) / spread
    return mean_r - slope * mean_p, slope


def doubly_robust_reward(outcomes: Sequence[LoggedOutcome], weights: Sequence[float], *, ignored_reward: float,
                         level: float = 0.9) -> Interval | None:
    """V's mean reward, doubly robust: right if either the weights or the reward model are.

    The reward model depends on the completion only through "shown or not": nothing shown earns the ignored
    reward exactly, a shown suggestion earns q(x) = a + b·p(x) (``fit_shown_reward``). Its expectation under V
    is then exact from V's abstain probability p alone: DM(x) = p·r_ignored + (1 − p)·q(x). The estimate is
    mean(DM) + Σ w·(r − q̂) / Σ w, where q̂ is the model's reward for what was logged. The model soaks up
    the variance that the show/abstain decision (the one Tab RL mostly learns) gives plain importance
    sampling; the weighted residuals correct what the model gets wrong.
    """
    n = len(outcomes)
    if n == 0 or sum(weights) <= 0:
        return None
    shown = [o for o in outcomes if o.shown]
    a, b = fit_shown_reward([o.target_abstain_prob for o in shown], [o.reward for o in shown])
    direct = [o.target_abstain_prob * ignored_reward + (1 - o.target_abstain_prob) * (a + b * o.target_abstain_prob)
              for o in outcomes]
    residuals = [o.reward - ((a + b * o.target_abstain_prob) if o.shown else ignored_reward) for o in outcomes]
    total_w = sum(weights)
    direct_mean = sum(direct) / n
    correction = sum(w * e for w, e in zip(weights, residuals)) / total_w
    value = direct_mean + correction
    mean_w = total_w / n
    influence = [(d - direct_mean) + (w / mean_w) * (e - correction) for d, w, e in zip(direct, weights, residuals)]
    half = z_score(level) * math.sqrt(sum(x * x for x in influence)) / n
    return Interval(value, value - half, value + half)


@dataclass(frozen=True)
class OffPolicyEstimate:
    episodes: int
    effective_sample_size: float
    clipped_share: float
    """Share of episodes whose weight hit the clip."""
    accept_rate_shown: Interval | None
    shown_share: Interval | None
    reward_mean: Interval | None
    reward_mean_dr: Interval | None

    def as_dict(self) -> dict:
        return asdict(self)


def estimate(outcomes: Sequence[LoggedOutcome], *, clip: float = 10.0, level: float = 0.9,
             ignored_reward: float = 0.0) -> OffPolicyEstimate:
    """Every estimate of V from the logged ``outcomes`` (see the module doc)."""
    weights = importance_weights(outcomes, clip)
    ones = [1.0] * len(outcomes)
    shown = [float(o.shown) for o in outcomes]
    accepted = [float(o.accepted) for o in outcomes]
    log_clip = math.log(clip)
    clipped = sum(o.target_logprob - o.behaviour_logprob >= log_clip for o in outcomes)
    return OffPolicyEstimate(
        episodes=len(outcomes),
        effective_sample_size=effective_sample_size(weights),
        clipped_share=clipped / len(outcomes) if outcomes else 0.0,
        accept_rate_shown=ratio_estimate(weights, accepted, shown, level=level, rate=True),
        shown_share=ratio_estimate(weights, shown, ones, level=level, rate=True),
        reward_mean=ratio_estimate(weights, [o.reward for o in outcomes], ones, level=level),
        reward_mean_dr=doubly_robust_reward(outcomes, weights, ignored_reward=ignored_reward, level=level),
    )
