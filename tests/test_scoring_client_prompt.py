"""The tests scorer finds a task's tests by the prompt the client sent, not only by the prompt the model was
served: a request with a ``suffix`` is served a FIM prompt built from it, whose hash no tests file knows."""

from __future__ import annotations

import asyncio
import hashlib
import json

from policy.fim import build_fim_prompt
from rewards.spec import RewardSpec
from rewards.scoring import Scorers, UnitTestsScorer, UnitTestsIndex

SPEC = RewardSpec(weights={"acceptance": 0.5, "tests": 0.5})
PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
TESTS = "assert add(2, 3) == 5\n"


def test_tests_keyed_by_the_client_prompt_score_a_request_that_sent_a_suffix(tmp_path):
    client_sha = hashlib.sha256(PREFIX.encode()).hexdigest()  # the request's `prompt`: the prefix alone
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"prompt_sha256": client_sha, "tests": TESTS}) + "\n")
    scorers = Scorers.of(UnitTestsScorer(UnitTestsIndex.from_jsonl(path), timeout_s=20))
    episode = {"completion_id": "c1", "project_id": "p", "prompt": build_fim_prompt(PREFIX, SUFFIX),
               "prompt_sha256": client_sha, "completion_text": "a + b", "completion_token_ids": [1, 2],
               "matched": True, "reward_components": {"acceptance": 0.75}}
    assert scorers.wanted(SPEC, episode) == ["tests"]
    components, errors = asyncio.run(scorers.score(SPEC, episode, ["tests"]))
    assert (components, errors) == ({"tests": 0.75}, {})
    # Episodes written before they carried the client's hash still find tests keyed by the served prompt.
    served = {k: v for k, v in episode.items() if k != "prompt_sha256"}
    by_served = UnitTestsIndex({hashlib.sha256(served["prompt"].encode()).hexdigest(): TESTS})
    assert by_served.for_episode(served) == TESTS and by_served.for_episode(episode) == TESTS


def test_an_episode_served_the_prefix_alone_is_scored_with_the_clients_suffix(tmp_path):
    """A model without FIM tokens (SmolLM2) is served the prefix alone, so the episode's prompt has no suffix
    to parse: the episode's own prefix and suffix (v6) rebuild the file. The tests need the suffix here."""
    suffix = "\n\ndef twice(x):\n    return add(x, x)\n"
    tests = "assert twice(3) == 6\n"
    scorers = Scorers.of(UnitTestsScorer(UnitTestsIndex({"sha": tests}), timeout_s=20))
    episode = {"completion_id": "c1", "project_id": "p", "prompt": PREFIX, "prompt_sha256": "sha",
               "prefix": PREFIX, "suffix": suffix, "completion_text": "a + b", "completion_token_ids": [1, 2],
               "matched": True, "reward_components": {"acceptance": 0.75}}
    assert scorers.wanted(SPEC, episode) == ["tests"]
    assert asyncio.run(scorers.score(SPEC, episode, ["tests"])) == ({"tests": 0.75}, {})
    assert asyncio.run(scorers.score(SPEC, {**episode, "completion_text": "a - b"}, ["tests"]))[0] == {"tests": -0.25}
    # Without them (an episode written before v6) the prefix-only prompt says nothing of the cursor: no score.
    older = {k: v for k, v in episode.items() if k not in ("prefix", "suffix")}
    assert scorers.wanted(SPEC, older) == []
