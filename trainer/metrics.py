"""Completion quality metrics. Pure functions, checkable by hand.

* ``exact_match`` — the suggestion is the reference (trailing whitespace aside);
* ``line_match`` — its first line is the reference's first line: what the
  default simulated user accepts (the rest of the line the cursor is on);
* ``edit_similarity`` — 1 − Levenshtein distance / length of the longer text;
* ``is_empty`` — nothing worth showing (whitespace only);
* pass@1 and judge scores come from the test scorer and the judge;
* ``user_figures`` — accept rate among shown, share shown, accepted characters
  per request and mean reward of a simulated user's decisions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from policy.agreement import edit_similarity
from policy.shown import first_line


def exact_match(prediction: str, reference: str) -> bool:
    return prediction.rstrip() == reference.rstrip()


def line_match(prediction: str, reference: str) -> bool:
    """The first lines agree and are not empty: the default user's reason to press Tab."""
    want = first_line(reference).rstrip()
    return bool(want) and first_line(prediction).rstrip() == want


def is_empty(prediction: str) -> bool:
    return not prediction.strip()


@dataclass(frozen=True)
class Scored:
    """One completion of one task, scored. ``passed``/``judge`` are None when that scorer did not run."""

    task_id: str
    completion: str
    reference: str
    solutions: tuple[str, ...] = ()
    single_line: bool = False
    """The editor shows one line here (the cursor follows text): only the references' first lines can match."""
    passed: bool | None = None
    judge: float | None = None
    judge_error: str | None = None

    def _target(self, text: str) -> str:
        return first_line(text) if self.single_line else text

    @property
    def exact(self) -> bool:
        return any_exact(self.completion, [self._target(r) for r in self.solutions or (self.reference,)])

    @property
    def line(self) -> bool:
        return line_match(self.completion, self.reference)

    @property
    def similarity(self) -> float:
        return edit_similarity(self.completion.rstrip(), self._target(self.reference).rstrip())

    @property
    def empty(self) -> bool:
        return is_empty(self.completion)


def any_exact(prediction: str, references: Iterable[str]) -> bool:
    return any(exact_match(prediction, r) for r in references)


def summarize(scored: Sequence[Scored]) -> dict:
    """Means over the scored completions; pass@1 and judge only over those that were scored so."""
    n = len(scored)
    tested = [s.passed for s in scored if s.passed is not None]
    judged = [s.judge for s in scored if s.judge is not None]
    return {
        "n": n,
        "exact_match": _mean([s.exact for s in scored]),
        "line_match": _mean([s.line for s in scored]),
        "edit_similarity": _mean([s.similarity for s in scored]),
        "empty_share": _mean([s.empty for s in scored]),
        "pass_at_1": _mean(tested) if tested else None,
        "n_tested": len(tested),
        "judge_score": _mean(judged) if judged else None,
        "n_judged": len(judged),
        "judge_errors": sum(1 for s in scored if s.judge_error is not None),
    }


def user_figures(rows: Sequence[dict]) -> dict:
    """What Cursor's Tab RL measured, over some requests' user decisions (``trainer.proof.simulate.decision_rows``):
    accept rate among shown suggestions, share of requests shown, accepted characters per request and
    mean reward (an empty suggestion is not shown)."""
    n = len(rows)
    shown = [r for r in rows if r["shown"] is not None]
    accepted = [r for r in shown if r["accepted"]]
    return {
        "n": n,
        "accept_rate_shown": _ratio(len(accepted), len(shown)),
        "shown_share": _ratio(len(shown), n),
        "accepted_chars_per_request": _ratio(sum(r["accepted_chars"] for r in accepted), n),
        "reward_mean": _ratio(sum(r["reward"] for r in rows), n),
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def _mean(xs: Sequence[float | bool]) -> float | None:
    return round(sum(float(x) for x in xs) / len(xs), 4) if xs else None


def markdown_table(rows: Sequence[tuple[str, dict]]) -> str:
    """A table with one row per (label, summary); the simulated user's columns only when a summary has them."""
    columns = [("n", "n"), ("exact_match", "exact"), ("line_match", "line"), ("edit_similarity", "edit sim"),
               ("pass_at_1", "pass@1"), ("judge_score", "judge"), ("empty_share", "empty")]
    if any("shown_share" in summary for _, summary in rows):
        columns += [("shown_share", "shown"), ("accept_rate_shown", "accepted/shown"),
                    ("accepted_chars_per_request", "acc. chars/req")]
        if any("kept_chars_per_request" in summary for _, summary in rows):
            columns.append(("kept_chars_per_request", "kept chars/req"))
        columns.append(("reward_mean", "reward"))
    head = "| run | " + " | ".join(title for _, title in columns) + " |"
    rule = "|---|" + "|".join("---:" for _ in columns) + "|"
    lines = [head, rule]
    for label, summary in rows:
        cells = [_cell(summary.get(key)) for key, _ in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
