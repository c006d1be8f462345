"""Offline evaluation with the tiny model: generation, the three scorers, policies from directories, the CLI."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tabloop.cli import main
from tests.test_judge import FakeJudgeAPI, Reply
from trainer.proof.evaluate import apply_weights, cut_completion, evaluate, generate, load_policy
from policy.models import build_tiny_model, load_model
from trainer.proof.tasks import FimTask, save_tasks

TASKS = [FimTask(f"t{i}", prefix=p, suffix=s, middle="x") for i, (p, s) in enumerate([
    ("def add(a, b):\n    return a", "\n"),
    ("import os\nprint(os.pa", ")\n"),
    ("class A:\n    ", "\n"),
])]


def test_cut_completion_is_what_continue_inserts():
    assert cut_completion(" + b\nprint(1)", "    return a") == " + b"  # the cursor follows text: one line
    assert cut_completion("if x:\n    y()\n\nz", "def f():\n    ") == "if x:\n    y()"
    assert cut_completion("abc<|endoftext|>junk", "x = ") == "abc"
    assert cut_completion("   ", "x = ") == ""


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return load_model(tiny_model)


def test_generation_is_deterministic_and_evaluate_scores_what_it_generated(tiny):
    model, tok = tiny
    first = generate(model, tok, TASKS, max_new_tokens=12, batch_size=2)
    assert first == generate(model, tok, TASKS, max_new_tokens=12, batch_size=3), "batching changes nothing"
    assert all("\n" not in c for c, t in zip(first, TASKS) if t.prefix.rsplit("\n", 1)[-1].strip())
    _, scored = evaluate(model, tok, TASKS, max_new_tokens=12)
    assert [s.completion for s in scored] == first
    sampled = generate(model, tok, TASKS, max_new_tokens=12, temperature=1.0, seed=5)
    assert sampled == generate(model, tok, TASKS, max_new_tokens=12, temperature=1.0, seed=5)


def test_exact_match_and_empty_share_by_hand(tiny, monkeypatch):
    """Completions fixed here (the tiny model writes empty ones): the figures follow from them alone."""
    model, tok = tiny
    written = [" + b", "th.exists", ""]
    monkeypatch.setattr("trainer.proof.evaluate.generate", lambda model, tok, tasks, **kw: list(written))
    refs = [FimTask(t.task_id, t.prefix, t.suffix, middle=m) for t, m in zip(TASKS, [" + b", "th.join", "pass"])]
    summary, scored = evaluate(model, tok, refs, max_new_tokens=12)
    assert summary["exact_match"] == pytest.approx(1 / 3, abs=1e-4) and summary["n"] == 3  # only t0 is right
    assert summary["empty_share"] == pytest.approx(1 / 3, abs=1e-4)
    assert [s.completion for s in scored] == written and [s.reference for s in scored] == [r.middle for r in refs]


def test_tests_scorer_gives_pass_at_1(tiny):
    """Tests whose verdict does not depend on the completion (it lands in a comment): one passes, one fails."""
    model, tok = tiny
    tasks = [FimTask("passes", "x = 1\n# ", "\n", middle="", test="assert x == 1\n"),
             FimTask("fails", "x = 1\n# ", "\n", middle="", test="assert x == 2\n")]
    summary, scored = evaluate(model, tok, tasks, scorer="tests", max_new_tokens=8)
    assert summary["n_tested"] == 2 and [s.passed for s in scored] == [True, False]
    assert summary["pass_at_1"] == pytest.approx(0.5, abs=1e-4)
    with pytest.raises(ValueError, match="needs tasks with tests"):
        evaluate(model, tok, TASKS, scorer="tests")


def test_judge_scorer_asks_an_openai_compatible_judge(tiny):
    from rewards.judge import JudgeConfig

    model, tok = tiny
    api = FakeJudgeAPI()
    try:
        api.script = [Reply("Fine.\nSCORE: 7"), Reply("Poor.\nSCORE: 3"), Reply(status=400)]
        config = JudgeConfig(api_url=f"{api.url}/v1", api_key="k", model="judge", max_retries=0, max_concurrency=1)
        summary, scored = evaluate(model, tok, TASKS, scorer="judge", judge_config=config, max_new_tokens=6)
    finally:
        api.stop()
    assert len(api.requests) == 3
    assert sorted(s.judge for s in scored if s.judge is not None) == [3.0, 7.0]
    assert summary["judge_score"] == 5.0 and summary["n_judged"] == 2 and summary["judge_errors"] == 1
    with pytest.raises(ValueError, match="needs a judge"):
        evaluate(model, tok, TASKS, scorer="judge")


def test_policy_from_a_weights_directory(tiny_model, tmp_path):
    from tests.conftest import make_settings

    other = build_tiny_model(tmp_path / "v1", seed=1)
    settings = make_settings(tmp_path, model=tiny_model)
    base, _, base_label = load_policy(settings)
    policy, _, label = load_policy(settings, str(other))
    assert base_label.endswith("(base)") and label == "v1 (full)"
    b, p = base.state_dict(), policy.state_dict()
    assert any(not (b[k] == p[k]).all() for k in b)
    with pytest.raises(ValueError, match="unknown weight kind"):
        apply_weights(base, str(other), "DIFF")
    with pytest.raises(ValueError, match="version number or a weights directory"):
        load_policy(settings, "latest")


def test_eval_cli_prints_a_table_and_json(tiny_model, tmp_path):
    data = tmp_path / "tasks.jsonl"
    save_tasks(TASKS, data)
    out = tmp_path / "result.json"
    env = {"TABLOOP_STATE_DIR": str(tmp_path), "TABLOOP_MODEL": tiny_model}
    result = CliRunner().invoke(main, ["eval", str(data), "--max-new-tokens", "6", "--out", str(out)], env=env)
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    last = json.loads(lines[-1])
    assert last["n"] == 3 and last["scorer"] == "exact" and last["policy"] == "base"
    assert any(line.startswith("| run |") for line in lines)
    assert len(json.loads(out.read_text())["completions"]) == 3
    bad = CliRunner().invoke(main, ["eval", str(tmp_path / "none.jsonl")], env=env)
    assert bad.exit_code == 1 and "does not exist" in bad.output
    judge = CliRunner().invoke(main, ["eval", str(data), "--scorer", "judge"], env=env)
    assert judge.exit_code == 1 and "--judge-url" in judge.output


def test_eval_cli_user_scorer_reports_what_the_user_made_of_it(tiny_model, tmp_path):
    """--scorer user: the simulated user's figures, from the completions printed, under the settings' reward spec."""
    data, out, spec = tmp_path / "tasks.jsonl", tmp_path / "result.json", tmp_path / "rewards.yaml"
    save_tasks(TASKS, data)
    spec.write_text("default: {accepted: 1.0, rejected: -1.0}\n")
    env = {"TABLOOP_STATE_DIR": str(tmp_path), "TABLOOP_MODEL": tiny_model, "TABLOOP_REWARD_SPEC_FILE": str(spec)}
    figures = {}
    for rule, threshold in (("similarity", "0"), ("exact", "0.8")):
        result = CliRunner().invoke(main, ["eval", str(data), "--scorer", "user", "--rule", rule, "--threshold",
                                           threshold, "--max-new-tokens", "6", "--temperature", "1", "--samples", "4",
                                           "--out", str(out)], env=env)
        assert result.exit_code == 0, result.output
        figures[rule] = json.loads(result.output.strip().splitlines()[-1])
        assert "accepted/shown" in result.output
    # Sampling is seeded: both runs saw the same completions (those of the last run are in --out).
    completions = [c["completion"] for c in json.loads(out.read_text())["completions"]]
    shown, n = [c for c in completions if c.strip()], len(completions)
    assert n == 12 and shown, "the tiny model wrote nothing for any task: nothing to check"
    # Similarity ≥ 0 accepts whatever is shown; the random model never writes the exact reference.
    sim, exact = figures["similarity"], figures["exact"]
    assert sim["shown_share"] == exact["shown_share"] == round(len(shown) / n, 4)
    assert sim["accept_rate_shown"] == 1.0 and exact["accept_rate_shown"] == 0.0
    assert sim["accepted_chars_per_request"] == round(sum(len(c) for c in shown) / n, 4)
    assert exact["accepted_chars_per_request"] == 0.0
    # Kept characters: of what similarity ≥ 0 accepts, the agreement with each task's true continuation.
    from trainer.proof.simulate import kept_chars_of
    from policy.shown import shown_text, single_line_mode

    by_id = {t.task_id: t for t in TASKS}
    kept = [kept_chars_of(by_id[c["task_id"]], shown_text(c["completion"],
                                                          single_line=single_line_mode(by_id[c["task_id"]].prefix)),
                          True) for c in json.loads(out.read_text())["completions"]]
    assert sim["kept_chars_per_request"] == round(sum(kept) / n, 4) <= sim["accepted_chars_per_request"]
    assert exact["kept_chars_per_request"] == 0.0 and "kept chars/req" in result.output
    assert sim["reward_mean"] == round(len(shown) / n, 4) and exact["reward_mean"] == round(-len(shown) / n, 4)
    assert (exact["user_rule"], exact["user_threshold"]) == ("exact", 0.8)
    stray = CliRunner().invoke(main, ["eval", str(data), "--rule", "similarity"], env=env)
    assert stray.exit_code == 2 and "only apply with --scorer user" in stray.output


@pytest.mark.kafka
def test_policy_version_comes_from_the_weights_topic(kafka, tiny_model, tmp_path):
    import shutil

    from infra.bus import EventProducer, ensure_topics
    from schemas.topics import WEIGHTS
    from tests.conftest import make_settings
    from tests.test_weight_swap import make_lora, weight_event

    base = str(tmp_path / "base")
    shutil.copytree(tiny_model, base)  # a base model of its own: the weights topic outlives this test
    settings = make_settings(tmp_path / "state", kafka_bootstrap=kafka.settings.kafka_bootstrap, model=base)
    ensure_topics(settings)
    lora = make_lora(base, tmp_path / "v2")
    full = str(build_tiny_model(tmp_path / "v3", seed=3))
    producer = EventProducer(settings)
    for event in (weight_event(base, 2, f"file://{lora}", "LORA"), weight_event(base, 3, full, "FULL")):
        producer.publish_acked(event, topic=WEIGHTS.name).result(30)
    producer.close()

    base_model = load_policy(settings)[0].state_dict()
    v2, _, label2 = load_policy(settings, "2")
    v3, _, label3 = load_policy(settings, "3")
    assert (label2, label3) == ("v2", "v3")
    for policy in (v2.state_dict(), v3.state_dict()):
        assert set(policy) == set(base_model) and any(not (policy[k] == base_model[k]).all() for k in base_model)
    with pytest.raises(ValueError, match="version 9 .* is not on tabloop.weights"):
        load_policy(settings, "9")


def test_eval_cli_judge_from_settings(tiny_model, tmp_path):
    data = tmp_path / "tasks.jsonl"
    save_tasks(TASKS[:2], data)
    api = FakeJudgeAPI()
    try:
        api.default = Reply("SCORE: 6.5")
        env = {"TABLOOP_STATE_DIR": str(tmp_path), "TABLOOP_MODEL": tiny_model,
               "TABLOOP_JUDGE_API_URL": f"{api.url}/v1", "TABLOOP_JUDGE_MODEL": "judge",
               "TABLOOP_JUDGE_API_KEY": "sk-test"}
        result = CliRunner().invoke(main, ["eval", str(data), "--scorer", "judge", "--max-new-tokens", "4"], env=env)
    finally:
        api.stop()
    assert result.exit_code == 0, result.output
    last = json.loads(result.output.strip().splitlines()[-1])
    assert (last["judge_score"], last["n_judged"]) == (6.5, 2)
    assert api.requests[0]["headers"]["authorization"] == "Bearer sk-test"
    assert api.requests[0]["body"]["model"] == "judge"
