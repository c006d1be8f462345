"""Scorers beyond the user's decision: the LLM judge and unit tests, as reward components of an episode.

A project's reward spec weighs components (``rewards.spec``). When it gives
weight to ``judge`` or ``tests`` and the scorer can say something about the
episode, the streams worker scores the episode before publishing it:

- ``judge``: the judge's 0–10 score of (prefix, completion, suffix), for matched
  episodes whose prompt is a FIM prompt;
- ``tests``: prefix + completion + suffix, then the task's tests, run in the
  sandbox (``rewards.sandbox``: a pass it can't forge), for prompts listed in the
  tests file (``TABLOOP_TESTS_FILE``).

Both land on the acceptance scale of the spec (0 → ``rejected``, 1 → ``accepted``)
so that a weighted mean of components means something. A scorer that fails
(a malformed judge answer, an API that keeps refusing, a sandbox that cannot
start) records its error in ``scoring_errors`` and its weight is left out of the
reward: never a crash, never a silent default.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from policy.fim import parse_prompt
from schemas.token_ids import PACKED, packed_field
from rewards.judge import JudgeClient, JudgeConfig
from rewards.spec import RewardSpec, composite_reward, on_acceptance_scale
from rewards.sandbox import run_tests

def judge_component(spec: RewardSpec, score_0_to_10: float) -> float:
    return on_acceptance_scale(spec, score_0_to_10 / 10.0)


def unit_tests_component(spec: RewardSpec, passed: bool) -> float:
    return on_acceptance_scale(spec, 1.0 if passed else 0.0)


def rescored(episode: dict, spec: RewardSpec, extra: dict[str, float], errors: dict[str, str]) -> dict:
    """The episode record with the extra components, its reward recomputed, the scorers named."""
    components = {**episode["reward_components"], **extra}
    # Packed ids come back from the worker's JSON as base64 text (streams.app.plain): bytes again to encode.
    return {**episode, PACKED: packed_field(episode.get(PACKED)), "reward_components": components,
            "reward": composite_reward(spec, components, len(episode["completion_token_ids"])),
            "scorer": "+".join(sorted(components, key=lambda c: (c != "acceptance", c))),
            "scoring_errors": {**episode.get("scoring_errors", {}), **errors}}


class ScoringError(RuntimeError):
    """A scorer could say nothing of this episode (a malformed answer, a sandbox that could not start): the
    message goes to ``scoring_errors`` and the component's weight is left out of the reward."""


class UnitTestsIndex:
    """Unit tests by prompt: a JSONL file of ``{"prompt" or "prompt_sha256": …, "tests": "<python>"}``."""

    def __init__(self, tests_by_sha: dict[str, str]):
        self.tests_by_sha = tests_by_sha

    @classmethod
    def from_jsonl(cls, path: Path) -> "UnitTestsIndex":
        tests: dict[str, str] = {}
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"tests file {path}: {exc}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"tests file {path} line {n}: not JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("tests"), str):
                raise ValueError(f"tests file {path} line {n}: needs a \"tests\" string")
            sha = row.get("prompt_sha256") or (
                hashlib.sha256(row["prompt"].encode()).hexdigest() if isinstance(row.get("prompt"), str) else None)
            if sha is None:
                raise ValueError(f"tests file {path} line {n}: needs \"prompt\" or \"prompt_sha256\"")
            tests[sha] = row["tests"]
        return cls(tests)

    def for_prompt(self, prompt: str) -> str | None:
        return self.tests_by_sha.get(hashlib.sha256(prompt.encode()).hexdigest())

    def for_episode(self, episode: dict) -> str | None:
        """The tests of the prompt the client sent (its hash: what feedback and tests files know), else of
        the prompt the model was served (they differ when the request sent a ``suffix``, or was trimmed)."""
        by_client = self.tests_by_sha.get(episode.get("prompt_sha256") or "")
        return by_client if by_client is not None else self.for_prompt(episode["prompt"])


def episode_cursor(episode: dict) -> tuple[str, str] | None:
    """(prefix, suffix) around the completion: the episode's own fields (the client's cursor), else parsed from
    a FIM prompt (episodes written before they carried them); None when neither says where the cursor was."""
    if episode.get("prefix") is not None and episode.get("suffix") is not None:
        return episode["prefix"], episode["suffix"]
    parsed = parse_prompt(episode["prompt"])
    return (parsed.prefix or "", parsed.suffix or "") if parsed.is_fim else None


class JudgeScorer:
    """``judge``: the LLM judge's 0–10 score of (prefix, completion, suffix), on the acceptance scale."""

    name = "judge"

    def __init__(self, client: JudgeClient):
        self.client = client

    @classmethod
    def from_settings(cls, settings) -> "JudgeScorer | None":
        if not (settings.judge_api_url or settings.judge_model):
            return None
        return cls(JudgeClient(JudgeConfig(api_url=settings.judge_api_url, api_key=settings.judge_api_key,
                                           model=settings.judge_model, timeout_s=settings.judge_timeout_s,
                                           max_concurrency=settings.judge_max_concurrency)))

    def applies(self, episode: dict) -> bool:
        return True

    async def score(self, spec: RewardSpec, prefix: str, suffix: str, text: str, episode: dict) -> float:
        result = await self.client.score(prefix, suffix, text)
        if not result.ok:
            raise ScoringError(result.error or "no score")
        return judge_component(spec, result.score)

    async def aclose(self) -> None:
        await self.client.aclose()


class UnitTestsScorer:
    """``tests``: prefix + completion + suffix, then the task's tests, run in the sandbox's judge (a pass the
    code under test can't forge), for the prompts the tests file lists."""

    name = "tests"

    def __init__(self, index: UnitTestsIndex, timeout_s: float = 10.0, memory_bytes: int = 512 * 2**20):
        self.index, self.timeout_s, self.memory_bytes = index, timeout_s, memory_bytes

    @classmethod
    def from_settings(cls, settings) -> "UnitTestsScorer | None":
        if not settings.tests_file:
            return None
        return cls(UnitTestsIndex.from_jsonl(settings.tests_file), settings.tests_timeout_s,
                   settings.tests_memory_mb * 2**20)

    def applies(self, episode: dict) -> bool:
        return self.index.for_episode(episode) is not None

    async def score(self, spec: RewardSpec, prefix: str, suffix: str, text: str, episode: dict) -> float:
        # The tests go apart from the file: compiled on their own (a completion can't swallow them into a
        # string) and run by the judge, which sees the program only through what the tests call.
        program, tests = f"{prefix}{text}{suffix}\n", self.index.for_episode(episode)
        try:
            result = await asyncio.to_thread(run_tests, program, tests=tests, timeout_s=self.timeout_s,
                                             memory_bytes=self.memory_bytes)
        except Exception as exc:  # the sandbox itself failed: no score, say why
            raise ScoringError(f"{type(exc).__name__}: {exc}") from None
        if result.outcome == "error":
            raise ScoringError(f"sandbox: {result.stderr[-300:]}")
        return unit_tests_component(spec, result.passed)

    async def aclose(self) -> None:
        pass


SCORERS = {scorer.name: scorer.from_settings for scorer in (JudgeScorer, UnitTestsScorer)}
"""Every reward component scored beyond the user's decision, by name: the name a reward spec weighs → how a
worker makes its scorer from the settings (None: not configured here). A new component is a class with
``name``, ``from_settings``, ``applies``, ``score`` and ``aclose``, and one entry here."""


@dataclass
class Scorers:
    """The scorers a worker (or a replay) scores with, by component name: those configured here."""

    active: dict = field(default_factory=dict)
    concurrency: int = 8
    _slots: asyncio.Semaphore | None = field(default=None, repr=False)

    @classmethod
    def of(cls, *scorers, concurrency: int = 8) -> "Scorers":
        return cls({s.name: s for s in scorers}, concurrency)

    @classmethod
    def from_settings(cls, settings) -> "Scorers":
        made = (make(settings) for make in SCORERS.values())
        return cls.of(*(s for s in made if s is not None), concurrency=settings.scoring_concurrency)

    def weighed(self, spec: RewardSpec) -> list[str]:
        """The components scored here that ``spec`` weighs; empty: no episode of the spec waits for scoring,
        and ``wanted`` need not look at one."""
        return [name for name in self.active if spec.weights.get(name, 0) > 0]

    def wanted(self, spec: RewardSpec, episode: dict) -> list[str]:
        """The extra components this episode should get under ``spec`` (empty: publish it as it is)."""
        weighed = self.weighed(spec)
        if not weighed or not episode["matched"] or episode_cursor(episode) is None:
            return []
        return [name for name in weighed if self.active[name].applies(episode)]

    async def score(self, spec: RewardSpec, episode: dict, wanted: list[str]) -> tuple[dict, dict]:
        """(components, errors) for the ``wanted`` components of one episode."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        prefix, suffix = episode_cursor(episode) or ("", "")
        components, errors = {}, {}
        async with self._slots:
            for name in wanted:
                try:
                    components[name] = await self.active[name].score(spec, prefix, suffix,
                                                                     episode["completion_text"], episode)
                except ScoringError as exc:
                    errors[name] = str(exc)
        return components, errors

    async def aclose(self) -> None:
        for scorer in self.active.values():
            await scorer.aclose()
