"""What users are served, on held-out tasks: a weight version's sampled draws, a show-gate's decision on each,
a simulated user's decision on what is shown, and the figures with their intervals. Pure functions.

The front door samples a completion at the exploration temperature, holds its first line, scores it with the
promoted gate (``policy.show_gate``) and shows it when the score reaches the gate's threshold, otherwise with
probability ``exploration``. Here the same decision is made on draws sampled once per weight version
(``trainer.proof.evaluate.sample_draws``), so every gate version served with that weight version is judged
on the same samples:

* ``explore=True``: the served policy, exploration included, each coin drawn from an RNG seeded by the task
  and the draw (the same coin for every gate: two gates differ by their decisions, not by luck);
* ``explore=False``: the gate's own decision (ε = 0).

A line that is empty or whitespace is shown as nothing, gate or not. A plain server's rule can stand where a
gate does (``ConfidenceThreshold``: the model's mean token probability on the line against a threshold chosen
on train tasks), the baseline a learned gate has to beat.

Intervals (two-sided, ``LEVEL``), two kinds side by side:

* ``intervals`` (the first ones, kept for what reads them): Wilson's for the two rates, counting every draw as
  a trial; for the means, a normal interval over tasks of each task's mean over its draws;
* ``intervals_by_task``: every figure clustered by task (``trainer.proof.intervals``: the draws of one task
  are not independent of each other, the tasks are), the ones to read; a difference between two policies on
  the same tasks is paired by task (``paired_figures``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from policy.show_gate import FEATURES, choose_threshold, line_features
from trainer.ope import wilson_interval
from trainer.proof.intervals import Z, clustered_interval, paired_interval, task_sums
from trainer.proof.simulate import decision_rows


def gate_decision(gate, line: str, logprobs: Sequence[float], rng: random.Random | None = None
                  ) -> tuple[bool, float | None, float]:
    """(shown, score, show probability) of a line as the door decides it. ``gate`` None: no gate, every
    non-empty line is shown; ``rng`` None: the gate's deterministic decision (score ≥ threshold)."""
    if not line.strip():
        return False, None, 1.0
    if gate is None:
        return True, None, 1.0
    score = gate.score(line_features(line, logprobs))
    if rng is None:
        return score >= gate.threshold, score, 1.0 if score >= gate.threshold else 0.0
    shown, p = gate.decide(score, rng)
    return shown, score, p


def served_rows(tasks: Sequence, draws: Sequence, gate, user, spec, *, explore: bool, seed: int = 0) -> list[dict]:
    """One row per draw (``Draw``: ``task_index``, ``draw``, ``completion``, ``line``, ``line_logprobs``):
    the gate's decision, then what the editor shows and the user's decision on it
    (``trainer.proof.simulate.decision_rows``; a hidden completion shows nothing: IGNORED)."""
    decided, completions, picked = [], [], []
    for d in draws:
        rng = random.Random(f"{seed}:explore:{d.task_index}:{d.draw}") if explore else None
        shown, score, p = gate_decision(gate, d.line, d.line_logprobs, rng)
        decided.append((shown, score, p))
        completions.append(d.completion if shown else "")
        picked.append(tasks[d.task_index])
    rows = decision_rows(picked, completions, user, spec)
    for row, d, (shown, score, p) in zip(rows, draws, decided):
        row.update(task_index=d.task_index, draw=d.draw, gate_score=None if score is None else round(score, 6),
                   show_probability=p, hidden_by_gate=bool(d.line.strip()) and not shown)
        if not shown:
            row["completion"] = d.completion  # what was sampled, though nothing was shown
    return rows


def wilson(successes: float, n: float, z: float = Z) -> dict:
    """A rate with its Wilson score interval ({"value", "low", "high"}); all None when n is 0."""
    if n <= 0:
        return {"value": None, "low": None, "high": None}
    i = wilson_interval(successes / n, n, z)
    return {"value": round(i.value, 4), "low": round(i.low, 4), "high": round(i.high, 4)}


def mean_interval(values: Sequence[float], z: float = Z) -> dict:
    """A mean with its normal interval (sample standard deviation / √n); with one value the interval is
    the value itself; all None with none."""
    n = len(values)
    if n == 0:
        return {"value": None, "low": None, "high": None}
    mean = sum(values) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1)) if n > 1 else 0.0
    half = z * sd / math.sqrt(n)
    return {"value": round(mean, 4), "low": round(mean - half, 4), "high": round(mean + half, 4)}


def per_task_means(rows: Sequence[dict], key: str) -> dict[int, float]:
    """task_index → the mean of ``key`` over that task's draws."""
    sums: dict[int, list[float]] = {}
    for r in rows:
        sums.setdefault(r["task_index"], []).append(float(r[key]))
    return {t: sum(xs) / len(xs) for t, xs in sums.items()}


RATIOS = {
    "accept_rate_shown": (lambda r: bool(r["accepted"]), lambda r: r["shown"] is not None, True),
    "shown_share": (lambda r: r["shown"] is not None, lambda r: 1, True),
    "accepted_chars_per_request": (lambda r: r["accepted_chars"], lambda r: 1, False),
    "kept_chars_per_request": (lambda r: r["kept_chars"], lambda r: 1, False),
    "reward_mean": (lambda r: r["reward"], lambda r: 1, False),
}
"""Each figure as a ratio of sums over requests (``trainer.proof.intervals``): figure → (Y of a row, X of a
row, whether it is a rate)."""


def figures_by_task(rows: Sequence[dict], z: float = Z) -> dict[str, dict]:
    """Every figure of ``RATIOS`` with its interval clustered by task (``clustered_interval``)."""
    return {name: clustered_interval(list(task_sums(rows, y, x).values()), z, rate=rate)
            for name, (y, x, rate) in RATIOS.items()}


def paired_figures(after: Sequence[dict], before: Sequence[dict], z: float = Z) -> dict[str, dict]:
    """``after`` − ``before`` of every figure of ``RATIOS``, over the tasks both hold, each with its interval
    paired by task (``paired_interval``): two policies on the same held-out tasks."""
    return {name: paired_interval(task_sums(after, y, x), task_sums(before, y, x), z)
            for name, (y, x, _) in RATIOS.items()}


def figures(rows: Sequence[dict], z: float = Z) -> dict:
    """The bench's figures of a set of rows, each with its interval: ``accept_rate_shown`` (accepted / shown),
    ``shown_share`` (shown / requests), ``accepted_chars_per_request``, ``kept_chars_per_request`` (of the
    accepted characters, those that agree with the true code: ``trainer.proof.simulate.kept_characters``) and
    ``reward_mean``; counts ``n``, ``shown``, ``accepted``, ``hidden_by_gate``, ``tasks``. ``intervals``: the
    first kind (Wilson over draws for rates, normal over per-task means for the rest); ``intervals_by_task``:
    every figure clustered by task (the module docstring)."""
    n = len(rows)
    shown = sum(r["shown"] is not None for r in rows)
    accepted = sum(bool(r["accepted"]) for r in rows)
    rate, share = wilson(accepted, shown, z), wilson(shown, n, z)
    chars = mean_interval(list(per_task_means(rows, "accepted_chars").values()), z)
    kept = mean_interval(list(per_task_means(rows, "kept_chars").values()), z)
    reward = mean_interval(list(per_task_means(rows, "reward").values()), z)
    by_task = figures_by_task(rows, z)
    return {"n": n, "tasks": len({r["task_index"] for r in rows}), "shown": shown, "accepted": accepted,
            "hidden_by_gate": sum(bool(r.get("hidden_by_gate")) for r in rows),
            "accept_rate_shown": rate["value"], "shown_share": share["value"],
            "accepted_chars_per_request": None if n == 0 else round(sum(r["accepted_chars"] for r in rows) / n, 4),
            "kept_chars_per_request": None if n == 0 else round(sum(r["kept_chars"] for r in rows) / n, 4),
            "reward_mean": None if n == 0 else round(sum(r["reward"] for r in rows) / n, 4),
            "intervals": {"accept_rate_shown": [rate["low"], rate["high"]],
                          "shown_share": [share["low"], share["high"]],
                          "accepted_chars_per_request": [chars["low"], chars["high"]],
                          "kept_chars_per_request": [kept["low"], kept["high"]],
                          "reward_mean": [reward["low"], reward["high"]]},
            "intervals_by_task": {k: [v["low"], v["high"]] for k, v in by_task.items()}}


def paired_difference(after: Sequence[dict], before: Sequence[dict], key: str, z: float = Z) -> dict:
    """``after`` − ``before`` of the per-task mean of ``key`` over the tasks both hold, with its normal
    interval over those tasks (paired: each task is its own control)."""
    a, b = per_task_means(after, key), per_task_means(before, key)
    common = sorted(set(a) & set(b))
    return mean_interval([a[t] - b[t] for t in common], z)


def relative_change(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None or before == 0 else round(after / before - 1, 4)


@dataclass(frozen=True)
class ConfidenceThreshold:
    """A plain server's show rule, no learning: show a line when the model's mean token probability on it,
    exp(mean log-probability of its tokens and the one that ended it; ``policy.show_gate.line_features``),
    reaches ``threshold``. Duck-types the part of ``policy.show_gate.Gate`` that ``gate_decision`` uses
    without exploration (``score``, ``threshold``); the log-probabilities are the model's own (temperature 1)."""

    threshold: float

    @staticmethod
    def score(features: Sequence[float]) -> float:
        return math.exp(features[FEATURES.index("mean_logprob")])


def choose_confidence_threshold(rows: Sequence[dict], draws: Sequence, keep: float) -> float:
    """The threshold of ``ConfidenceThreshold`` chosen on decided rows (``served_rows`` of ``draws`` with no
    gate, on train tasks) by the show-gate's own rule (``policy.show_gate.choose_threshold``): the highest
    that keeps at least ``keep`` of the characters users accepted of what was shown. 0.0 (show every line)
    when nothing was accepted. Only shown lines count: an empty one is never shown, whatever its score."""
    picked = [(ConfidenceThreshold.score(line_features(d.line, d.line_logprobs)), r["accepted_chars"])
              for r, d in zip(rows, draws) if r["shown"] is not None]
    if not picked:
        return 0.0
    return choose_threshold([s for s, _ in picked], [c for _, c in picked], [1.0] * len(picked), keep=keep)
