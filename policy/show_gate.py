"""The show-gate: the policy's decision to show a completion at all, as pure functions.

A code model is accepted about a quarter of the time; most of what it shows is rejected. Whether a line will
be accepted is largely legible from figures the sampler already has — how sure the model was of the line's
tokens and how long the line is — and that decision is cheap to learn: a logistic regression on seven
figures, refit in milliseconds from a few hundred decided episodes, where a whole-LM update needs thousands.

The door scores the line the user would see (``line_features``) with the served gate (``Gate.score``: the
estimated probability of acceptance), shows it when the score reaches the gate's threshold, and otherwise
shows it anyway with probability ``exploration`` (``Gate.decide``), so the gate keeps getting labels below
its threshold. What was shown, and with what probability, goes on the event: a learner weighs each decided
episode by 1 / show probability (inverse propensity), which makes sums over shown episodes unbiased for sums
over all traffic (``tests/test_show_gate.py`` checks that on a simulated bandit whose truth is known).

The threshold is chosen not to over-abstain (``choose_threshold``): the highest one that keeps at least
``keep`` of the accepted characters always-show would get, counted as the model expects them or as users
accepted them (``KEPT_BY``). Maximising the reward alone (+0.75 accepted, −0.25 rejected, 0 hidden) hides
most suggestions of a model accepted 25 % of the time and loses a third or more of what users would have
accepted (measured, issue 28).

The features are computed from the shown line's text and its tokens' log-probabilities at the exploration
temperature (the behaviour ones for an exploration sample; for a greedy line, whose behaviour logprobs are
all 0, those the door logs apart: ``completion_gate_logprobs``, ``Episode.gate_logprobs``), both on
``CompletionServed`` and on ``Episode`` (cut to the shown line plus the token that ended it), so a replay
of the history refits the gate from the same numbers the door saw.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from policy.shown import first_line, kept_token_count

FEATURES = ("log_tokens", "log_chars", "first_logprob", "mean_logprob", "min_logprob", "sum_logprob",
            "end_logprob")
"""The figures a line is scored on. Counts enter as log(1 + n): acceptance falls off with length roughly
geometrically, which a logistic model sees as linear in the log."""
LOGPROB_CLIP = -30.0
"""Log-probabilities are clipped here before they enter a feature: a token outside a top-p nucleus is logged
near −50 and would otherwise decide the score alone."""


def line_features(text: str, logprobs: Sequence[float]) -> list[float]:
    """The gate's figures for a shown line: ``text`` as the user would see it, ``logprobs`` the behaviour
    log-probabilities of its tokens plus the one that ended it (end of sequence, newline, stop), in order.

    >>> line_features("x = 1", [-0.5, -1.0, -0.1])[2:]  # doctest: +ELLIPSIS
    [-0.5, -0.533..., -1.0, -1.6, -0.1]
    """
    lps = [max(float(lp), LOGPROB_CLIP) for lp in logprobs] or [0.0]
    return [math.log1p(len(logprobs)), math.log1p(len(text.strip())), lps[0], sum(lps) / len(lps), min(lps),
            sum(lps), lps[-1]]


def first_line_features(text: str, logprobs: Sequence[float], token_ends: Sequence[int]) -> list[float] | None:
    """The gate's figures for the first line of a completion: what the front door scores before it shows
    anything, and what a learner recomputes from the completion's episode.

    ``text`` the completion's text, ``logprobs`` its tokens' behaviour log-probabilities, ``token_ends``
    where each token's text ends in it (``CompletionServed.completion_token_ends``,
    ``Episode.completion_token_ends``). The line is the text before the first newline; its tokens are those
    whose text ends within it plus the one that ended it (``policy.shown.kept_token_count``). A text of one
    line is its own line with all its tokens: the join cuts a single-line episode to exactly these (the line
    and the token that ended it), so the door's figures and the episode's agree. None when a text of several
    lines comes without its token ends (events written before they were recorded).
    """
    if "\n" not in text:
        return line_features(text, logprobs)
    if len(token_ends) != len(logprobs):
        return None
    line = first_line(text)
    return line_features(line, list(logprobs)[:kept_token_count(list(token_ends), len(line))])


def sigmoid(z: np.ndarray | float) -> np.ndarray | float:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -40.0, 40.0)))


@dataclass(frozen=True)
class Gate:
    """One gate version: a logistic model over standardised ``FEATURES`` and the threshold it shows at."""

    coef: tuple[float, ...]
    """One weight per feature, on standardised figures."""
    intercept: float
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    threshold: float
    """Show when the estimated acceptance probability reaches this; 0 shows everything."""
    exploration: float = 0.1
    """The probability a line under the threshold is shown anyway (its label keeps the gate honest)."""
    version: int = 0
    project_id: str = ""
    policy_version: int = 0
    """The weight version whose logged episodes it was fit on (its logprobs are the features' scale)."""

    def score(self, features: Sequence[float]) -> float:
        """The estimated probability the user accepts the line (plain Python: it runs on every request, and
        seven products need no arrays)."""
        z = self.intercept + sum(c * (x - m) / s for c, x, m, s in zip(self.coef, features, self.mean, self.scale))
        return 1.0 / (1.0 + math.exp(-min(max(z, -40.0), 40.0)))

    def show_probability(self, score: float) -> float:
        """π(show | line): 1 at or above the threshold, ``exploration`` below it."""
        return 1.0 if score >= self.threshold else self.exploration

    def decide(self, score: float, rng: random.Random | None = None) -> tuple[bool, float]:
        """(shown, the probability it had of being shown)."""
        p = self.show_probability(score)
        return (p >= 1.0 or (rng or random).random() < p), p

    def as_record(self) -> dict:
        """The fields of a GateVersion event that describe the gate itself."""
        return {"version": self.version, "project_id": self.project_id, "policy_version": self.policy_version,
                "feature_names": list(FEATURES), "coef": list(self.coef), "intercept": self.intercept,
                "feature_mean": list(self.mean), "feature_scale": list(self.scale), "threshold": self.threshold,
                "exploration": self.exploration}

    @classmethod
    def from_record(cls, record: dict) -> "Gate":
        """The gate a GateVersion event describes; a gate over other features than ours is refused."""
        if list(record["feature_names"]) != list(FEATURES):
            raise ValueError(f"gate v{record['version']} scores features {record['feature_names']}, "
                             f"this build computes {list(FEATURES)}")
        return cls(coef=tuple(record["coef"]), intercept=record["intercept"], mean=tuple(record["feature_mean"]),
                   scale=tuple(record["feature_scale"]), threshold=record["threshold"],
                   exploration=record["exploration"], version=record["version"],
                   project_id=record.get("project_id") or "", policy_version=record.get("policy_version") or 0)


def fit_logistic(X: np.ndarray, y: np.ndarray, w: np.ndarray | None = None, *, l2: float = 1.0,
                 iterations: int = 50) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """Weighted, L2-regularised logistic regression by Newton's method (IRLS) on standardised columns.

    Returns (coef, intercept, mean, scale): score = sigmoid(coef · (x − mean) / scale + intercept). ``w``
    are the samples' weights (1 / show probability: each decided line stands for that many lines served);
    the penalty ``l2`` is on the coefficients, not the intercept, and keeps a fit on a few dozen lines, or
    on separable ones, finite. Weights are normalised to mean 1, so ``l2`` means the same at any scale.
    """
    X = np.asarray(X, dtype=float)
    y = np.asarray(y, dtype=float)
    w = np.ones(len(y)) if w is None else np.asarray(w, dtype=float)
    if X.ndim != 2 or len(X) != len(y) or len(w) != len(y) or len(y) == 0:
        raise ValueError(f"fit_logistic: X {X.shape}, y {y.shape}, w {w.shape} do not describe the same samples")
    w = w * (len(w) / w.sum())
    mean = np.average(X, axis=0, weights=w)
    scale = np.sqrt(np.average((X - mean) ** 2, axis=0, weights=w))
    scale[scale < 1e-9] = 1.0  # a constant column: left as is, its weight stays at 0 under the penalty
    Z = np.hstack([np.ones((len(y), 1)), (X - mean) / scale])
    theta = np.zeros(Z.shape[1])
    penalty = np.full(Z.shape[1], l2)
    penalty[0] = 0.0
    for _ in range(iterations):
        p = sigmoid(Z @ theta)
        gradient = Z.T @ (w * (p - y)) + penalty * theta
        hessian = (Z * (w * p * (1 - p))[:, None]).T @ Z + np.diag(penalty + 1e-9)
        step = np.linalg.solve(hessian, gradient)
        theta -= step
        if np.max(np.abs(step)) < 1e-8:
            break
    return theta[1:], float(theta[0]), mean, scale


def cross_fitted_scores(X: np.ndarray, y: np.ndarray, w: np.ndarray, *, folds: int = 5, l2: float = 1.0,
                        seed: int = 0) -> np.ndarray:
    """Each sample's score from a model fit without it (``folds``-fold): a threshold chosen on in-sample
    scores would believe the model separates better than it does."""
    n = len(y)
    order = np.random.default_rng(seed).permutation(n)
    scores = np.empty(n)
    for k in range(folds):
        held = order[k::folds]
        if len(held) == 0:
            continue
        train = np.setdiff1d(order, held)
        coef, intercept, mean, scale = fit_logistic(X[train], y[train], w[train], l2=l2)
        scores[held] = sigmoid(((X[held] - mean) / scale) @ coef + intercept)
    return scores


def choose_threshold(scores: Sequence[float], accepted_chars: Sequence[float], weights: Sequence[float], *,
                     keep: float = 0.99) -> float:
    """The highest threshold that keeps at least ``keep`` of the accepted characters always-show would get.

    ``scores``: each decided line's (cross-fitted) score; ``accepted_chars``: how many of its characters the
    user kept (0 when rejected), or as ``kept_gains`` counts them; ``weights``: 1 / the probability it had of
    being shown, so the sums stand for all lines served. Lines at or above the threshold are shown. Raising
    the threshold hides the lines scored lowest first; it stops before the kept share falls under ``keep``.
    0.0 (show all) when nothing was accepted.

    >>> choose_threshold([0.1, 0.2, 0.9], [0, 5, 95], [1, 1, 1], keep=0.96)
    0.2
    """
    s = np.asarray(scores, dtype=float)
    gain = np.asarray(accepted_chars, dtype=float) * np.asarray(weights, dtype=float)
    total = gain.sum()
    if total <= 0:
        return 0.0
    order = np.argsort(s, kind="stable")
    lost = np.cumsum(gain[order])  # hiding the i+1 lowest-scored lines loses this much
    best = 0.0
    for i in range(len(order) - 1):
        if lost[i] > (1.0 - keep) * total + 1e-12:
            break
        if s[order[i + 1]] > s[order[i]]:  # a threshold between two distinct scores
            best = float(s[order[i + 1]])
    return best


@dataclass(frozen=True)
class Decided:
    """One decided line as the learner needs it (from an Episode: see ``trainer/show_gate_learner.py``)."""

    features: tuple[float, ...]
    accepted: bool
    accepted_chars: float
    """Characters the user kept: the line's length when accepted, the partial count, 0 when rejected."""
    show_probability: float = 1.0
    line_chars: float | None = None
    """The shown line's characters, accepted or not: what the expected-characters rule weighs a line's score
    by (``KEPT_BY``). None where not known: only the realised rule can then be used."""


KEPT_BY = ("expected", "realised")
"""How the threshold rule counts the accepted characters a threshold keeps (``FitConfig.kept_by``):

* ``expected`` (the default): each line's (cross-fitted) acceptance probability × its characters — what the
  logistic model expects it to keep. Smooth in the threshold: no single line decides it.
* ``realised``: the characters users actually accepted, each line weighed by 1 / its show probability. On a
  small log it over-hides (no accepted line happens to score low: the first SmolLM2 gate, on 50 lines, hid
  54 % of the lines and 43 % of the accepted characters); on a larger one a single accepted low-scored line,
  ten times over when exploration showed it, stops the threshold.

Which, with which ``keep``, was chosen on train tasks by ``tabloop bench gate-replay``
(``docs/bench-loop/gate-replay/``): expected at 0.95 loses about 1 % of the characters users accept (the
model's probabilities are generous at the bottom), and is the one of four that met the issue's goal there.
"""


@dataclass(frozen=True)
class FitConfig:
    keep: float = 0.95
    kept_by: str = "expected"
    """``KEPT_BY``: how the kept characters are counted, for the threshold and for promotion."""
    exploration: float = 0.1
    l2: float = 1.0
    min_decided: int = 50
    min_each: int = 8
    """At least this many accepted and this many rejected lines: a gate fit on one class says nothing."""
    folds: int = 5

    @classmethod
    def from_settings(cls, settings) -> "FitConfig":
        """The fit the ``TABLOOP_GATE_*`` settings describe: the learner's, and the replay's that chooses them."""
        return cls(keep=settings.gate_keep_chars, kept_by=settings.gate_kept_by,
                   exploration=settings.gate_exploration, min_decided=settings.gate_min_decided)


@dataclass(frozen=True)
class Fit:
    gate: Gate
    cross_fitted: np.ndarray
    """Each decided line's score from a model fit without it: the scores the threshold was chosen on, and
    those an off-policy estimate of the gate must use."""


def kept_gains(decided: Sequence[Decided], scores: Sequence[float], kept_by: str) -> list[float]:
    """Each line's accepted characters as ``kept_by`` counts them (``KEPT_BY``): realised, or its score × its
    characters. The expected rule needs every line's ``line_chars``."""
    if kept_by == "realised":
        return [d.accepted_chars for d in decided]
    if kept_by != "expected":
        raise ValueError(f"kept_by must be one of {', '.join(KEPT_BY)}, got {kept_by!r}")
    if any(d.line_chars is None for d in decided):
        raise ValueError("the expected-characters rule needs each decided line's line_chars")
    return [float(s) * d.line_chars for d, s in zip(decided, scores)]


def fit_gate(decided: Sequence[Decided], config: FitConfig = FitConfig(), *, version: int = 0,
             project_id: str = "", policy_version: int = 0) -> Fit | None:
    """A gate fit on decided lines, its threshold chosen on cross-fitted scores; None when there are too
    few lines, or too few of either outcome, to fit one."""
    accepted = sum(d.accepted for d in decided)
    if len(decided) < config.min_decided or min(accepted, len(decided) - accepted) < config.min_each:
        return None
    X = np.array([d.features for d in decided], dtype=float)
    y = np.array([d.accepted for d in decided], dtype=float)
    w = np.array([1.0 / max(d.show_probability, 1e-6) for d in decided])
    coef, intercept, mean, scale = fit_logistic(X, y, w, l2=config.l2)
    scores = cross_fitted_scores(X, y, w, folds=config.folds, l2=config.l2)
    threshold = choose_threshold(scores, kept_gains(decided, scores, config.kept_by), w, keep=config.keep)
    gate = Gate(coef=tuple(float(c) for c in coef), intercept=intercept, mean=tuple(float(m) for m in mean),
                scale=tuple(float(s) for s in scale), threshold=threshold, exploration=config.exploration,
                version=version, project_id=project_id, policy_version=policy_version)
    return Fit(gate, scores)


# -- which gate serves: the one rule of the door, the learner and `tabloop gates` -------------------------


def latest_statuses(records: Iterable[dict], project: str) -> dict[int, dict]:
    """version -> its newest GateVersion record, for one project's gates (what compaction keeps)."""
    out: dict[int, dict] = {}
    for r in records:
        if (r.get("project_id") or "") == project:
            out[r["version"]] = r
    return out


def serving_gate_record(records: Iterable[dict], project: str) -> dict | None:
    """The gate serving a project's own traffic: its newest version whose latest status is PROMOTED and whose
    features this build computes (a version rolled back since is passed over, back to the one promoted
    before it); None: none of its own."""
    promoted = [r for r in latest_statuses(records, project).values()
                if r["status"] == "PROMOTED" and list(r["feature_names"]) == list(FEATURES)]
    return max(promoted, key=lambda r: r["version"]) if promoted else None


def serving_gates(records: Sequence[dict]) -> dict[str, Gate]:
    """Every project's own serving gate ("" the shared one)."""
    out = {}
    for project in dict.fromkeys(r.get("project_id") or "" for r in records):
        record = serving_gate_record(records, project)
        if record is not None:
            out[project] = Gate.from_record(record)
    return out


def gate_for(gates: dict[str, Gate], project: str) -> Gate | None:
    """The gate a project's completions are scored with: its own, else the shared one, else none."""
    return gates.get(project) or gates.get("")
