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
from rewards.spec import RewardSpec, composite_reward
from rewards.sandbox import run_tests

EXTRA_COMPONENTS = ("judge", "tests")


def on_acceptance_scale(spec: RewardSpec, fraction: float) -> float:
    """A 0..1 score as a reward comparable with the acceptance component: 0 → rejected, 1 → accepted."""
    f = min(max(fraction, 0.0), 1.0)
    return spec.rejected + (spec.accepted - spec.rejected) * f


def judge_component(spec: RewardSpec, score_0_to_10: float) -> float:
    return on_acceptance_scale(spec, score_0_to_10 / 10.0)


def unit_tests_component(spec: RewardSpec, passed: bool) -> float:
    return spec.accepted if passed else spec.rejected


def rescored(episode: dict, spec: RewardSpec, extra: dict[str, float], errors: dict[str, str]) -> dict:
    """The episode record with the extra components, its reward recomputed, the scorers named."""
    components = {**episode["reward_components"], **extra}
    # Packed ids come back from the worker's JSON as base64 text (streams.app.plain): bytes again to encode.
    return {**episode, PACKED: packed_field(episode.get(PACKED)), "reward_components": components,
            "reward": composite_reward(spec, components, len(episode["completion_token_ids"])),
            "scorer": "+".join(sorted(components, key=lambda c: (c != "acceptance", c))),
            "scoring_errors": {**episode.get("scoring_errors", {}), **errors}}


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


@dataclass
class Scorers:
    """The judge and the tests runner a worker scores with; either may be absent (not configured)."""

    judge: JudgeClient | None = None
    tests: UnitTestsIndex | None = None
    tests_timeout_s: float = 10.0
    tests_memory_bytes: int = 512 * 2**20
    concurrency: int = 8
    _slots: asyncio.Semaphore | None = field(default=None, repr=False)

    @classmethod
    def from_settings(cls, settings) -> "Scorers":
        judge = None
        if settings.judge_api_url or settings.judge_model:
            judge = JudgeClient(JudgeConfig(api_url=settings.judge_api_url, api_key=settings.judge_api_key,
                                            model=settings.judge_model, timeout_s=settings.judge_timeout_s,
                                            max_concurrency=settings.judge_max_concurrency))
        tests = UnitTestsIndex.from_jsonl(settings.tests_file) if settings.tests_file else None
        return cls(judge, tests, settings.tests_timeout_s, settings.tests_memory_mb * 2**20,
                   settings.scoring_concurrency)

    def weighed(self, spec: RewardSpec) -> list[str]:
        """The components scored here (judge, tests) that ``spec`` weighs and this worker can score; empty:
        no episode of the spec waits for scoring, and ``wanted`` need not look at one."""
        return [name for name, scorer in (("judge", self.judge), ("tests", self.tests))
                if spec.weights.get(name, 0) > 0 and scorer is not None]

    def wanted(self, spec: RewardSpec, episode: dict) -> list[str]:
        """The extra components this episode should get under ``spec`` (empty: publish it as it is)."""
        weighed = self.weighed(spec)
        if not weighed or not episode["matched"] or episode_cursor(episode) is None:
            return []
        return [name for name in weighed if name != "tests" or self.tests.for_episode(episode)]

    async def score(self, spec: RewardSpec, episode: dict, wanted: list[str]) -> tuple[dict, dict]:
        """(components, errors) for the ``wanted`` components of one episode."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        prefix, suffix = episode_cursor(episode) or ("", "")
        text = episode["completion_text"]
        components, errors = {}, {}
        async with self._slots:
            if "judge" in wanted:
                result = await self.judge.score(prefix, suffix, text)
                if result.ok:
                    components["judge"] = judge_component(spec, result.score)
                else:
                    errors["judge"] = result.error or "no score"
            if "tests" in wanted:
                # The tests go apart from the file: compiled on their own (a completion can't swallow them
                # into a string) and run with the builtins the completion may have patched restored.
                program, tests = f"{prefix}{text}{suffix}\n", self.tests.for_episode(episode)
                try:
                    result = await asyncio.to_thread(run_tests, program, tests=tests, timeout_s=self.tests_timeout_s,
                                                     memory_bytes=self.tests_memory_bytes)
                except Exception as exc:  # the sandbox itself failed: no score, say why
                    errors["tests"] = f"{type(exc).__name__}: {exc}"
                else:
                    if result.outcome == "error":
                        errors["tests"] = f"sandbox: {result.stderr[-300:]}"
                    else:
                        components["tests"] = unit_tests_component(spec, result.passed)
        return components, errors

    async def aclose(self) -> None:
        if self.judge is not None:
            await self.judge.aclose()
