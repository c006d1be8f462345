"""Intervals a reviewer can trust: clustered by task, and paired by task. Pure functions, checked by hand in
``tests/test_intervals.py``.

A held-out evaluation draws several completions of each task (``bench loop --draws``, 2 by default). The
draws of one task share its prompt, its true line and its difficulty: they are not independent of each
other, the tasks are. An interval that counts every draw as a trial (Wilson's over all draws) is too narrow
by about √(1 + (draws − 1)·ρ), ρ the draws' correlation within a task. So the unit here is the task.

**What is estimated.** Every figure of the bench is a ratio of two sums over requests, R = ΣY / ΣX, summed
per task t into a cluster (Y_t, X_t) (``task_sums``):

* accept rate among shown: Y = accepted, X = shown (a task whose draws were all hidden has X_t = 0);
* share shown: Y = shown, X = 1 per request;
* accepted / kept characters per request, mean reward: Y = the request's figure, X = 1 per request.

**The method: the delta method for a ratio estimator, with the task as the sampling unit** (the
cluster-robust, "sandwich", standard error; Cochran, *Sampling Techniques*, 3rd ed., ch. 6 on ratio
estimates and ch. 9A on clusters of unequal sizes; with the small-sample factor n/(n − 1)). With n tasks:

    R = ΣY_t / ΣX_t,        se² = n / (n − 1) · Σ_t (Y_t − R·X_t)² / (ΣX_t)²

``clustered_interval`` gives R ± z·se for means. With one draw per task this is the textbook standard
error of a mean (sample standard deviation / √n); with the same number of draws k in every task it is the
standard error of the per-task means (the bench's earlier "normal interval over tasks"), so nothing changes
for those figures. For a rate (``rate=True``) the interval is Wilson's at the effective number of trials
n_eff = min(ΣX, R(1 − R) / se²) (Korn and Graubard, "Confidence intervals for proportions with small
expected number of positive counts estimated from survey data", Survey Methodology 24, 1998; Dean and
Pagano, "Evaluating confidence interval methods for binomial proportions in clustered surveys", J. Survey
Stat. Methodol. 3, 2015): it stays inside [0, 1] and is not zero-wide at 0 or at 1, where the delta method's
se is 0; n_eff is never more than the trials there are, so a clustered rate's interval is never narrower
than the plain Wilson one.

**Paired by task** (``paired_interval``): two policies evaluated on the same tasks, D = R_a − R_b over the
tasks both hold. Linearised, each task contributes u_t = (Y_at − R_a·X_at) / X̄_a − (Y_bt − R_b·X_bt) / X̄_b
(X̄ the mean of X over those tasks), and se² = Σ_t u_t² / (n (n − 1)): a task that is hard for both
policies costs both alike, and cancels. With the same number of draws per task for each policy this is the
mean of the per-task differences with its standard error.

Why not a cluster bootstrap: the closed form is deterministic, instant and checkable by hand, and agrees
with the bootstrap to first order. Both need enough tasks: with under ~30 the normal approximation is too
narrow (a ``--quick`` run's 16 tasks are a smoke test, not a measurement). Two-sided, at ``LEVEL``.
"""

from __future__ import annotations

import math
from typing import Callable, Hashable, Mapping, Sequence

from trainer.ope import wilson_interval

LEVEL = 0.9
Z = 1.6448536269514722
"""The standard normal quantile of a two-sided 90 % interval."""

Cluster = tuple[float, float]
"""A task's (ΣY, ΣX): the sum of a ratio's numerator and of its denominator over the task's requests."""

INTERVALS_NOTE = ("90 % intervals clustered by task (delta method for a ratio, cluster-robust; rates: Wilson at "
                  "the effective number of trials); differences paired by task")


def task_sums(rows: Sequence[dict], numerator: Callable[[dict], float], denominator: Callable[[dict], float],
              key: str = "task_index") -> dict[Hashable, Cluster]:
    """Each task's (ΣY, ΣX) over ``rows`` (one row per request, ``key`` naming its task), in first-seen order."""
    out: dict[Hashable, list[float]] = {}
    for r in rows:
        sums = out.setdefault(r[key], [0.0, 0.0])
        sums[0] += float(numerator(r))
        sums[1] += float(denominator(r))
    return {t: (y, x) for t, (y, x) in out.items()}


def ratio_se(clusters: Sequence[Cluster]) -> tuple[float | None, float | None]:
    """(R, se): the ratio ΣY / ΣX and its cluster-robust delta-method standard error (module docstring).
    R is None when ΣX is 0; se is None then, and with fewer than two clusters (nothing to estimate a
    spread from)."""
    n = len(clusters)
    total_y = sum(y for y, _ in clusters)
    total_x = sum(x for _, x in clusters)
    if total_x <= 0:
        return None, None
    r = total_y / total_x
    if n < 2:
        return r, None
    residuals = sum((y - r * x) ** 2 for y, x in clusters)
    return r, math.sqrt(n / (n - 1) * residuals / total_x ** 2)


def clustered_interval(clusters: Sequence[Cluster], z: float = Z, *, rate: bool = False) -> dict:
    """The ratio ΣY / ΣX of ``clusters`` (one per task) with its interval clustered by task:
    {"value", "low", "high", "se", "tasks"}, and for a rate "effective_n" (module docstring).

    A mean: value ± z·se. A rate (each Y_t between 0 and X_t): Wilson's interval at
    n_eff = min(ΣX, R(1 − R) / se²) (ΣX where R is 0 or 1, or every task has the same rate). Value None
    with no denominator; low and high None with fewer than two tasks."""
    value, se = ratio_se(clusters)
    out = {"value": None if value is None else round(value, 4), "low": None, "high": None,
           "se": None if se is None else round(se, 6), "tasks": len(clusters)}
    if value is None or se is None:
        return out
    if not rate:
        out.update(low=round(value - z * se, 4), high=round(value + z * se, 4))
        return out
    trials = sum(x for _, x in clusters)
    spread = value * (1 - value)
    n_eff = trials if spread <= 0 or se <= 0 else min(trials, spread / se ** 2)
    interval = wilson_interval(value, n_eff, z)
    out.update(low=round(interval.low, 4), high=round(interval.high, 4), effective_n=round(n_eff, 2))
    return out


def paired_interval(after: Mapping[Hashable, Cluster], before: Mapping[Hashable, Cluster], z: float = Z) -> dict:
    """``after`` − ``before`` of the ratio ΣY / ΣX over the tasks both hold (each a task → (Y, X)), with its
    interval paired by task (module docstring): {"value", "low", "high", "se", "tasks"}. Value None when
    either policy's denominator is 0 on those tasks; low and high None with fewer than two of them."""
    common = [t for t in after if t in before]
    n = len(common)
    out = {"value": None, "low": None, "high": None, "se": None, "tasks": n}
    xa, xb = sum(after[t][1] for t in common), sum(before[t][1] for t in common)
    if n == 0 or xa <= 0 or xb <= 0:
        return out
    ra, rb = sum(after[t][0] for t in common) / xa, sum(before[t][0] for t in common) / xb
    out["value"] = round(ra - rb, 4)
    if n < 2:
        return out
    mean_xa, mean_xb = xa / n, xb / n
    u = [(after[t][0] - ra * after[t][1]) / mean_xa - (before[t][0] - rb * before[t][1]) / mean_xb for t in common]
    se = math.sqrt(sum(v * v for v in u) / (n * (n - 1)))
    out.update(low=round(ra - rb - z * se, 4), high=round(ra - rb + z * se, 4), se=round(se, 6))
    return out
