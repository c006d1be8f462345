"""Judge and tests scores as reward components: the arithmetic by hand, the scorers for real (a local
server speaking the OpenAI chat API as the judge, the sandbox running the tests)."""

from __future__ import annotations

import asyncio
import json

import pytest

from policy.fim import build_fim_prompt
from rewards.judge import JudgeClient, JudgeConfig
from rewards.scoring import (SCORERS, JudgeScorer, Scorers, UnitTestsScorer, UnitTestsIndex, judge_component, rescored,
                             unit_tests_component)
from rewards.spec import RewardSpec, on_acceptance_scale
from tests.conftest import make_settings
from tests.test_judge import FakeJudgeAPI, Reply
from tests.test_sandbox import FORGE_TOKEN

SPEC = RewardSpec(weights={"acceptance": 0.4, "judge": 0.3, "tests": 0.2, "style": 0.1})
PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def episode(text: str = "a + b", matched: bool = True, prompt: str | None = None) -> dict:
    return {"completion_id": "c1", "project_id": "p", "prompt": prompt or build_fim_prompt(PREFIX, SUFFIX),
            "completion_text": text, "completion_token_ids": [1, 2, 3], "matched": matched,
            "reward_components": {"acceptance": 0.75}, "reward": 0.75, "scorer": "acceptance",
            "scoring_errors": {}}


@pytest.fixture(scope="module")
def judge_api():
    api = FakeJudgeAPI()
    yield api
    api.stop()


def test_scores_land_on_the_acceptance_scale():
    assert on_acceptance_scale(SPEC, 0.0) == pytest.approx(-0.25)
    assert on_acceptance_scale(SPEC, 1.0) == pytest.approx(0.75)
    assert on_acceptance_scale(SPEC, 0.5) == pytest.approx(0.25)
    assert on_acceptance_scale(SPEC, 7.0) == pytest.approx(0.75)  # clamped
    assert judge_component(SPEC, 8) == pytest.approx(-0.25 + 0.8)
    assert (unit_tests_component(SPEC, True), unit_tests_component(SPEC, False)) == (0.75, -0.25)


def test_rescored_mixes_the_weighted_components_and_names_the_scorers():
    out = rescored(episode(), SPEC, {"judge": 0.55, "tests": -0.25}, {})
    # (0.4·0.75 + 0.3·0.55 + 0.2·(−0.25)) / 0.9 — style has weight but no score: left out.
    assert out["reward"] == pytest.approx((0.3 + 0.165 - 0.05) / 0.9)
    assert out["scorer"] == "acceptance+judge+tests"
    failed = rescored(episode(), SPEC, {"tests": 0.75}, {"judge": "malformed answer"})
    assert failed["reward"] == pytest.approx((0.4 * 0.75 + 0.2 * 0.75) / 0.6)
    assert failed["scoring_errors"] == {"judge": "malformed answer"} and "judge" not in failed["reward_components"]


def test_tests_file_errors_name_the_line(tmp_path):
    good = {"prompt": build_fim_prompt(PREFIX, SUFFIX), "tests": TESTS}
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(good) + "\n\n")
    assert UnitTestsIndex.from_jsonl(path).for_prompt(good["prompt"]) == TESTS
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2: not JSON"):
        UnitTestsIndex.from_jsonl(path)
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match='line 1: needs a "tests" string'):
        UnitTestsIndex.from_jsonl(path)
    with pytest.raises(ValueError, match="tests file .*missing"):
        UnitTestsIndex.from_jsonl(tmp_path / "missing.jsonl")


def test_only_weighted_scorers_that_can_say_something_are_wanted(judge_api):
    index = UnitTestsIndex({})
    judge = JudgeClient(JudgeConfig(api_url=judge_api.url + "/v1", api_key="k", model="m"))
    scorers = Scorers.of(JudgeScorer(judge), UnitTestsScorer(index))
    assert scorers.wanted(SPEC, episode()) == ["judge"]  # no tests for this prompt
    assert scorers.wanted(SPEC, episode(matched=False)) == []  # off-policy: nothing to judge
    assert scorers.wanted(SPEC, episode(prompt="not a FIM prompt")) == []
    assert scorers.wanted(RewardSpec(), episode()) == []  # the default spec weighs acceptance only
    assert Scorers().wanted(SPEC, episode()) == []  # nothing configured
    asyncio.run(judge.aclose())


def test_the_scorers_a_worker_gets_are_the_registered_ones_its_settings_configure(tmp_path):
    assert set(SCORERS) == {"judge", "tests"}  # the names a reward spec weighs
    assert Scorers.from_settings(make_settings(tmp_path)).active == {}  # nothing configured
    with_tests = make_settings(tmp_path, tests_file=_tasks(tmp_path), tests_timeout_s=7.0)
    active = Scorers.from_settings(with_tests).active
    assert list(active) == ["tests"] and active["tests"].timeout_s == 7.0
    assert active["tests"].index.for_prompt(build_fim_prompt(PREFIX, SUFFIX)) == TESTS
    both = Scorers.from_settings(make_settings(tmp_path, tests_file=_tasks(tmp_path), judge_model="m",
                                               judge_api_url="http://127.0.0.1:9/v1"))
    assert list(both.active) == ["judge", "tests"]
    asyncio.run(both.aclose())


def test_judge_and_tests_scores_for_real(judge_api, tmp_path):
    judge_api.reset()
    judge_api.script = [Reply(content="Fine.\nSCORE: 9"), Reply(content="no score here"),
                        Reply(content="still none")]
    index = UnitTestsIndex.from_jsonl(_tasks(tmp_path))

    async def run():
        judge = JudgeClient(JudgeConfig(api_url=judge_api.url + "/v1", api_key="k", model="m", backoff_s=0.01))
        scorers = Scorers.of(JudgeScorer(judge), UnitTestsScorer(index, timeout_s=20))
        good = episode("a + b")
        assert scorers.wanted(SPEC, good) == ["judge", "tests"]
        first = await scorers.score(SPEC, good, ["judge", "tests"])
        # The judge's second and third answers are malformed: a recorded error, not a score.
        second = await scorers.score(SPEC, episode("a - b"), ["judge", "tests"])
        await scorers.aclose()
        return first, second

    (components, errors), (bad_components, bad_errors) = asyncio.run(run())
    assert components == {"judge": pytest.approx(judge_component(SPEC, 9)), "tests": 0.75} and errors == {}
    assert bad_components == {"tests": -0.25}  # a - b fails the tests
    assert set(bad_errors) == {"judge"} and "SCORE" in bad_errors["judge"]


def test_completions_that_game_the_tests_are_scored_as_failing(tmp_path):
    """Issue 18: a completion that wrote the sandbox's end token and left was rewarded as passing."""
    index = UnitTestsIndex.from_jsonl(_tasks(tmp_path))
    scorers = Scorers.of(UnitTestsScorer(index, timeout_s=20))
    games = {"forge_token": "a - b\n" + FORGE_TOKEN, "leave_early": "a - b\nimport os\nos._exit(0)\n"}
    for name, text in games.items():
        components, errors = asyncio.run(scorers.score(SPEC, episode(text), ["tests"]))
        assert (components, errors) == ({"tests": -0.25}, {}), name
    assert asyncio.run(scorers.score(SPEC, episode("a + b"), ["tests"])) == ({"tests": 0.75}, {})


def _tasks(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"prompt": build_fim_prompt(PREFIX, SUFFIX), "tests": TESTS}) + "\n")
    return path
