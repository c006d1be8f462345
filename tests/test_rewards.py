"""Reward math against numbers worked by hand."""

import pytest

from rewards.spec import RewardSpec, RewardSpecs, acceptance_reward, composite_reward


def test_cursor_defaults():
    spec = RewardSpec()
    assert acceptance_reward(spec, "ACCEPTED") == 0.75
    assert acceptance_reward(spec, "REJECTED") == -0.25
    assert acceptance_reward(spec, "IGNORED") == 0.0
    # Showing pays exactly at 25 % acceptance: 0.25 * 0.75 + 0.75 * -0.25 = 0.
    assert 0.25 * acceptance_reward(spec, "ACCEPTED") + 0.75 * acceptance_reward(spec, "REJECTED") == 0.0


def test_partial_accept_credit():
    spec = RewardSpec()
    # -0.25 + (0.75 - -0.25) * 0.4 = 0.15
    assert acceptance_reward(spec, "PARTIAL", 0.4) == pytest.approx(0.15)
    assert acceptance_reward(spec, "PARTIAL", 1.0) == 0.75
    assert acceptance_reward(spec, "PARTIAL", 7.0) == 0.75  # clamped
    assert acceptance_reward(spec, "PARTIAL", None) == -0.25
    with pytest.raises(ValueError, match="unknown outcome"):
        acceptance_reward(spec, "MAYBE")


def test_composite_40_30_20_10_and_length_penalty():
    spec = RewardSpec(weights={"acceptance": 0.4, "judge": 0.3, "tests": 0.2, "style": 0.1},
                      length_penalty_per_token=0.001)
    components = {"acceptance": 0.75, "judge": 0.6, "tests": 1.0, "style": 0.5}
    # 0.4*0.75 + 0.3*0.6 + 0.2*1.0 + 0.1*0.5 = 0.3 + 0.18 + 0.2 + 0.05 = 0.73; minus 20 * 0.001
    assert composite_reward(spec, components, completion_tokens=20) == pytest.approx(0.71)
    # No judge score: its weight leaves, the rest renormalise: (0.3 + 0.2 + 0.05) / 0.7
    del components["judge"]
    assert composite_reward(spec, components) == pytest.approx(0.55 / 0.7)
    with pytest.raises(ValueError, match="none of the weighted components"):
        composite_reward(spec, {"other": 1.0})


def test_spec_validation_and_yaml(tmp_path):
    with pytest.raises(ValueError, match="non-negative"):
        RewardSpec(weights={"acceptance": -1})
    with pytest.raises(ValueError, match="order"):
        RewardSpec(accepted=-1.0)
    path = tmp_path / "rewards.yaml"
    path.write_text("default: {rejected: -0.5}\nprojects:\n  acme: {accepted: 1.0, weights: {acceptance: 1, judge: 1}}\n")
    specs = RewardSpecs.from_yaml(path)
    assert specs.for_project("other").rejected == -0.5 and specs.for_project("other").accepted == 0.75
    assert specs.for_project("acme").weights == {"acceptance": 1, "judge": 1}
    path.write_text("projects:\n  acme: {acepted: 1.0}\n")
    with pytest.raises(ValueError, match="projects.acme has unknown key.*acepted"):
        RewardSpecs.from_yaml(path)


def test_length_penalty_reaches_unmatched_episodes():
    """Unmatched feedback has no served token ids; its text is what the trainer encodes and trains on, so the
    penalty is charged on the text's tokens (here a counter of words), not on zero tokens."""
    from tests.test_join import feedback, run

    spec = RewardSpec(length_penalty_per_token=0.01)
    specs = RewardSpecs(spec, count_tokens=lambda text: len(text.split()))
    eps, _ = run([("f", feedback(0, cache_hit=True, shown="return a + b", client_id="k"))], specs=specs)
    [ep] = eps
    assert ep.record["matched"] is False
    assert ep.record["reward"] == pytest.approx(0.75 - 0.01 * 4)  # "return", "a", "+", "b"
    assert specs.completion_tokens(spec, [5, 6], "ignored text") == 2  # served tokens when known
    assert specs.completion_tokens(RewardSpec(), [], "no penalty, no tokenizer needed") == 0


def test_served_token_counter_uses_the_served_models_tokenizer(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from rewards.spec import served_token_counter
    from tests.conftest import make_settings

    count = served_token_counter(make_settings(tmp_path, model=tiny_model))
    text = "def f(x):\n    return x  # é"
    assert count(text) == len(AutoTokenizer.from_pretrained(tiny_model).encode(text, add_special_tokens=False)) > 4
