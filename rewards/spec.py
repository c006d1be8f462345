"""Rewards: pure functions of an outcome and its scores, per a project's reward spec.

The defaults are Cursor's Tab RL numbers: +0.75 accepted, −0.25 rejected, 0 for
showing nothing; showing then pays only when acceptance is at least 25 %, and a
rejected completion gets a negative reward (a gradient), unlike the reference
recipe's 0/1. A composite reward mixes components (acceptance, judge, tests,
style, …) by weight; weights of components an episode lacks are left out and
the rest renormalised, so a missing judge score is not a zero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import yaml

from infra.settings import Settings

OUTCOMES = ("ACCEPTED", "REJECTED", "PARTIAL", "IGNORED")


@dataclass(frozen=True)
class RewardSpec:
    accepted: float = 0.75
    rejected: float = -0.25
    ignored: float = 0.0
    length_penalty_per_token: float = 0.0
    """Subtracted per completion token: long suggestions must earn their length."""
    weights: Mapping[str, float] = field(default_factory=lambda: {"acceptance": 1.0})
    """Composite weights by component, e.g. {acceptance: .4, judge: .3, tests: .2, style: .1}."""

    def __post_init__(self) -> None:
        if not self.weights or any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError(f"reward weights must be non-negative and not all zero: {dict(self.weights)}")
        if not self.rejected <= self.ignored <= self.accepted:
            raise ValueError("reward spec must order rejected <= ignored <= accepted")


def on_acceptance_scale(spec: RewardSpec, fraction: float) -> float:
    """A 0..1 score as a reward comparable with the acceptance component: 0 → rejected, 1 → accepted (a
    fraction outside 0..1 is clamped). A partial accept and every extra component land on this scale, so a
    weighted mean of components means something."""
    f = min(max(fraction, 0.0), 1.0)
    return spec.rejected + (spec.accepted - spec.rejected) * f


def acceptance_reward(spec: RewardSpec, outcome: str, accepted_fraction: float | None = None) -> float:
    """The user's decision as a reward. PARTIAL earns the accepted fraction of the way from rejected
    to accepted (Continue's partial accepts take a prefix of the suggestion)."""
    if outcome == "ACCEPTED":
        return spec.accepted
    if outcome == "REJECTED":
        return spec.rejected
    if outcome == "IGNORED":
        return spec.ignored
    if outcome == "PARTIAL":
        return on_acceptance_scale(spec, accepted_fraction if accepted_fraction is not None else 0.0)
    raise ValueError(f"unknown outcome {outcome!r}; expected one of {', '.join(OUTCOMES)}")


def composite_reward(spec: RewardSpec, components: Mapping[str, float], completion_tokens: int = 0) -> float:
    """Weighted mean of the components the spec weighs and the episode has, minus the length penalty."""
    present = {k: w for k, w in spec.weights.items() if k in components and w > 0}
    if not present:
        raise ValueError(f"none of the weighted components {sorted(spec.weights)} is in {sorted(components)}")
    total = sum(present.values())
    mixed = sum(w * components[k] for k, w in present.items()) / total
    return mixed - spec.length_penalty_per_token * completion_tokens


@dataclass(frozen=True)
class RewardSpecs:
    """A default spec and per-project overrides."""

    default: RewardSpec = field(default_factory=RewardSpec)
    projects: Mapping[str, RewardSpec] = field(default_factory=dict)
    count_tokens: Callable[[str], int] | None = field(default=None, compare=False, repr=False)
    """Tokens of a completion text the join has no token ids for (unmatched feedback: the trainer
    re-encodes its text), for the length penalty; None: the served model's tokenizer
    (``served_token_counter``), loaded the first time a penalised unmatched episode needs it."""

    def completion_tokens(self, spec: RewardSpec, token_ids, text: str) -> int:
        """The token count ``spec``'s length penalty is charged on: the served tokens when known, else the
        text's tokens as the trainer will encode them (never 0 for a non-empty text, which would let an
        unmatched episode escape the penalty)."""
        if token_ids or not spec.length_penalty_per_token or not text:
            return len(token_ids)
        return (self.count_tokens or served_token_counter())(text)

    def for_project(self, project_id: str) -> RewardSpec:
        return self.projects.get(project_id, self.default)

    @classmethod
    def from_settings(cls, settings) -> "RewardSpecs":
        """The specs in ``settings.reward_spec_file``; the defaults when none is set."""
        return cls.from_yaml(settings.reward_spec_file) if settings.reward_spec_file else cls()

    @classmethod
    def from_yaml(cls, path: Path) -> "RewardSpecs":
        """``default: {accepted: .75, …, weights: {…}}`` and ``projects: {name: {…}}``; errors name the key."""
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"reward spec {path}: {exc}") from None

        def spec(where: str, raw) -> RewardSpec:
            if not isinstance(raw, dict):
                raise ValueError(f"reward spec {path}: {where} must be a mapping")
            unknown = raw.keys() - RewardSpec.__dataclass_fields__.keys()
            if unknown:
                raise ValueError(f"reward spec {path}: {where} has unknown key(s) {', '.join(sorted(unknown))}")
            try:
                return RewardSpec(**raw)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"reward spec {path}: {where}: {exc}") from None

        default = spec("default", data.get("default", {}))
        projects = {name: spec(f"projects.{name}", raw) for name, raw in (data.get("projects") or {}).items()}
        return cls(default, projects)


def served_token_counter(settings=None) -> Callable[[str], int]:
    """Counts tokens with the served model's tokenizer (``TABLOOP_MODEL``; ``settings`` or the
    environment's), the way the trainer encodes a completion text: without special tokens."""
    if settings is None:
        settings = Settings()
    from policy.named_models import resolve_model_spec  # lazy: torch (seconds) the streams worker mostly skips

    return _counter(resolve_model_spec(settings))


@functools.cache
def _counter(model_spec: str) -> Callable[[str], int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_spec)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
