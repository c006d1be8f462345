"""Offline GRPO/RLOO: group samples → training items (by hand), learning on the tiny model, the CLI end to end."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.proof.offline import (GroupSample, OfflineConfig, OfflineError, make_scorer, offline_update, publish_decision,
                             shown_token_count, task_schedule, training_items)
from trainer.proof.simulate import CONTINUE_STOPS
from trainer.proof.tasks import FimTask, save_tasks


def _g(rewards, first_token=10):
    """A group with one single-token completion per reward; logprobs −1, −2, … to tell the samples apart."""
    return [GroupSample([first_token + i], [-(i + 1.0)], r) for i, r in enumerate(rewards)]


PROMPTS = [[1, 2], [3], [4, 5, 6], [7]]
GROUPS = [_g([1.0, 0.0, 0.0, 1.0]),  # signal
          _g([0.0, 0.0, 0.0]),  # all equal: no signal
          _g([1.0, None, 0.0]),  # one unscored (a judge error); two left, with signal
          _g([None, 1.0])]  # one scored sample left: nothing to compare it with


def test_grpo_items_by_hand():
    batch = training_items(PROMPTS, GROUPS, "grpo")
    # Group 0: mean 0.5, population std 0.5 → ±1. Group 2 (after dropping None): 1 and 0 → ±1.
    got = [(s.prompt_ids, s.completion_ids, s.behaviour_logprobs, round(s.advantage, 4)) for s in batch.samples]
    assert got == [([1, 2], [10], [-1.0], 1.0), ([1, 2], [11], [-2.0], -1.0), ([1, 2], [12], [-3.0], -1.0),
                   ([1, 2], [13], [-4.0], 1.0),
                   ([4, 5, 6], [10], [-1.0], 1.0), ([4, 5, 6], [12], [-3.0], -1.0)]
    assert (batch.groups, batch.groups_with_signal, batch.groups_without_signal, batch.unscored) == (4, 2, 2, 2)
    # The update's mean reward is over every scored sample, trained on or not: 4 ones out of 10.
    assert len(batch.rewards) == 10 and sum(batch.rewards) / len(batch.rewards) == pytest.approx(0.4)


def test_rloo_items_by_hand():
    batch = training_items(PROMPTS, GROUPS, "rloo")
    # Group 0: 1 − (0+0+1)/3 = 2/3, 0 − (1+0+1)/3 = −2/3. Group 2: 1 − 0 = 1, 0 − 1 = −1.
    assert [round(s.advantage, 4) for s in batch.samples] == [0.6667, -0.6667, -0.6667, 0.6667, 1.0, -1.0]
    assert [s.prompt_ids for s in batch.samples] == [[1, 2]] * 4 + [[4, 5, 6]] * 2


def test_graded_rewards_by_hand():
    """Judge-like rewards 0.7, 0.3, 0.5: mean 0.5, std √(0.08/3) = 0.1633."""
    grpo = training_items([[1]], [_g([0.7, 0.3, 0.5])], "grpo")
    assert [round(s.advantage, 3) for s in grpo.samples] == [1.225, -1.225, 0.0]
    rloo = training_items([[1]], [_g([0.7, 0.3, 0.5])], "rloo")
    assert [round(s.advantage, 4) for s in rloo.samples] == [0.3, -0.3, 0.0]


def test_no_signal_means_no_items_and_bad_input_is_named():
    batch = training_items([[1], [2]], [_g([0.0, 0.0]), _g([1.0, 1.0])], "rloo")
    assert batch.samples == [] and batch.groups_without_signal == 2 and batch.rewards == [0.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="algo must be one of grpo, rloo"):
        training_items(PROMPTS, GROUPS, "ppo")
    with pytest.raises(ValueError, match="4 prompts but 3 groups"):
        training_items(PROMPTS, GROUPS[:3], "grpo")
    with pytest.raises(ValueError, match="group-size must be at least 2"):
        OfflineConfig(group_size=1)
    with pytest.raises(ValueError, match="--algo"):
        OfflineConfig(algo="dpo")


def test_a_completion_ends_where_the_editor_ends_it():
    line = ["x", "x =", "x = 1\n", "x = 1\ny"]
    assert shown_token_count(line, single_line=True, stops=CONTINUE_STOPS) == 3  # the newline's token is kept
    assert shown_token_count(line, single_line=False, stops=CONTINUE_STOPS) == 4  # one newline: no stop
    assert shown_token_count(["a\n", "a\n\n", "a\n\nb"], single_line=False, stops=CONTINUE_STOPS) == 2
    assert shown_token_count(["a", "a<|endoftext|>", "a<|endoftext|>z"], single_line=False,
                             stops=CONTINUE_STOPS) == 2
    assert shown_token_count(["\n", "\nx"], single_line=True, stops=CONTINUE_STOPS) == 1


def test_publish_decision():
    assert publish_decision(None, True, "h:1") is True and publish_decision(None, False, "h:1") is False
    assert publish_decision(False, True, "h:1") is False and publish_decision(True, True, "h:1") is True
    with pytest.raises(OfflineError, match="no Kafka answers on h:1"):
        publish_decision(True, False, "h:1")


def test_schedule_covers_every_task_before_repeating():
    schedule = task_schedule(10, 4, 5, seed=3)
    flat = [i for update in schedule for i in update]
    assert [len(u) for u in schedule] == [4] * 5
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert schedule == task_schedule(10, 4, 5, seed=3) and schedule != task_schedule(10, 4, 5, seed=4)
    assert task_schedule(2, 4, 1, seed=0)[0] in ([0, 1], [1, 0])  # fewer tasks than asked: each once


def test_exact_scorer_rewards_what_the_editor_would_show():
    score = make_scorer("exact")
    tasks = [FimTask("a", "x = ", "\n", "foo(1)\nbar"), FimTask("b", "\n", "", "y = 2", solutions=("y = 2", "y=2"))]
    # Single-line (cursor after text): the first line of the reference counts; multi-line: the whole of one solution.
    assert score(tasks * 2, ["foo(1)", "y=2", "foo(2)", "y = 2\nz"]) == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="judge scorer needs a judge"):
        make_scorer("judge")


def test_tests_and_judge_scorers_as_rewards():
    """tests: the task's tests in the sandbox decide 1/0; judge: its 0–10 score / 10, an error stays None."""
    from rewards.judge import JudgeConfig
    from tests.test_judge import FakeJudgeAPI, Reply

    task = FimTask("add", "def add(a, b):\n    return ", "\n", "a + b", test="assert add(2, 3) == 5")
    assert make_scorer("tests")([task, task], ["a + b", "a - b"]) == [1.0, 0.0]
    api = FakeJudgeAPI()
    try:
        api.script = [Reply("Fine.\nSCORE: 7"), Reply(status=400)]
        config = JudgeConfig(api_url=f"{api.url}/v1", api_key="k", model="judge", max_retries=0, max_concurrency=1)
        assert make_scorer("judge", judge_config=config)([task, task], ["a + b", "a * b"]) == [0.7, None]
    finally:
        api.stop()


def test_user_scorer_rewards_the_users_decision_as_the_online_trainer_would():
    """Accepted, rejected, nothing shown → the reward spec's accepted, rejected, ignored (Cursor's by default)."""
    from rewards.spec import RewardSpec
    from trainer.proof.simulate import UserModel

    line = FimTask("a", "x = ", "\n", "compute(1)")
    tested = FimTask("add", "def add(a, b):\n    return ", "\n", "a + b", test="assert add(2, 3) == 5")
    tasks, completions = [line] * 4, ["compute(1)", "compute(2)", "  ", "compute(1)\nmore"]
    assert make_scorer("user")(tasks, completions) == [0.75, -0.25, 0.0, 0.75]
    lenient = make_scorer("user", user_model=UserModel("similarity", 0.8), reward_spec=RewardSpec(rejected=-1.0))
    assert lenient(tasks, completions) == [0.75, 0.75, 0.0, 0.75]  # "compute(2)" is 0.9 similar
    assert make_scorer("user", user_model=UserModel("similarity", 0.95),
                       reward_spec=RewardSpec(rejected=-1.0))(tasks, completions) == [0.75, -1.0, 0.0, 0.75]
    assert make_scorer("user", user_model=UserModel("tests"))([tested] * 2, ["a + b", "a - b"]) == [0.75, -0.25]


# -- learning on the tiny model ------------------------------------------------------------------------


def _first_token_answers(model, tok, tasks, share: float) -> tuple[str, ...]:
    """Short strings the base policy writes first with probability ≈ ``share`` together.

    The tiny random model spreads its first token over the whole vocabulary (top token ≈ 0.1 %), so no
    single fixed string is ever sampled; a set of answers — the tokens nearest (by embedding) to its
    likeliest one — gives the reward a starting rate to improve on, as a weak pretrained model would.
    """
    from trainer.proof.evaluate import cut_completion
    from trainer.proof.offline import prompt_ids

    with torch.no_grad():
        probs = sum(torch.softmax(model(input_ids=torch.tensor([prompt_ids(tok, t, 256)])).logits[0, -1], -1)
                    for t in tasks) / len(tasks)
    emb = model.get_input_embeddings().weight
    texts = {i: cut_completion(tok.decode([i]), tasks[0].prefix) for i in range(len(probs))}
    usable = torch.tensor([bool(texts[i]) for i in range(len(probs))])
    likeliest = int(torch.argmax(probs * usable))
    order = [i for i in torch.argsort(torch.nn.functional.cosine_similarity(emb, emb[likeliest][None], dim=-1),
                                      descending=True).tolist() if usable[i]]
    answers, mass = [], 0.0
    for i in order:
        if mass >= share:
            break
        answers.append(texts[i])
        mass += float(probs[i])
    return tuple(dict.fromkeys(answers))


@pytest.fixture
def one_thread():
    """The tiny model gains nothing from intra-op threads, and on a busy machine they cost 3x the wall time."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_learning_with_the_exact_scorer(tiny_model, algo, one_thread):
    """Seeded: 8 single-line tasks whose answers are the same set of short strings, one-token completions,
    8 samples × 8 prompts per update, full fine-tuning. Margin: mean group reward over the last 5 of 20
    updates beats the first 5 by at least 0.3 (seen: 0.23 → 0.9 for both algorithms)."""
    from policy.models import load_model
    from trainer.learner import PolicyTrainer, UpdateConfig

    torch.manual_seed(0)
    model, tok = load_model(tiny_model)
    tasks = [FimTask(f"t{i}", f"def f{i}(x):\n    return ", "\n", "?") for i in range(8)]
    answers = _first_token_answers(model, tok, tasks, share=0.15)
    tasks = [FimTask(t.task_id, t.prefix, t.suffix, answers[0], solutions=answers) for t in tasks]
    policy = PolicyTrainer(model, tok, UpdateConfig(lr=1e-2, warmup_updates=1, micro_batch=64), full=True, seed=0)
    config = OfflineConfig(algo=algo, group_size=8, prompts_per_update=8, max_new_tokens=1, max_prompt_tokens=256,
                           rows_per_batch=64)
    generator = torch.Generator().manual_seed(0)
    score = make_scorer("exact")
    rewards = [offline_update(policy, tasks, config, score, generator)["reward_mean"] for _ in range(20)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= first + 0.3, f"{algo}: mean reward {first:.3f} → {last:.3f}: {[round(r, 3) for r in rewards]}"


# -- the command ------------------------------------------------------------------------------------------


def _learnable_tasks(tiny_model, n: int = 4) -> list[FimTask]:
    from policy.models import load_model

    model, tok = load_model(tiny_model)
    tasks = [FimTask(f"t{i}", f"def f{i}(x):\n    return ", "\n", "?") for i in range(n)]
    answers = _first_token_answers(model, tok, tasks, share=0.3)
    return [FimTask(t.task_id, t.prefix, t.suffix, answers[0], solutions=answers) for t in tasks]


def _train(env, *args):
    from click.testing import CliRunner

    from tabloop.cli import main

    return CliRunner().invoke(main, ["train", *args], env=env)


FAST = ["--group-size", "6", "--prompts-per-update", "2", "--max-new-tokens", "1", "--full", "--lr", "1e-2"]


def test_train_offline_writes_a_version_with_its_manifest(tiny_model, tmp_path):
    from policy.models import load_model
    from policy.weight_store import WeightStore

    data, held = tmp_path / "tasks.jsonl", tmp_path / "held.jsonl"
    tasks = _learnable_tasks(tiny_model)
    save_tasks(tasks, data)
    save_tasks(tasks[:2], held)
    env = {"TABLOOP_STATE_DIR": str(tmp_path / "state"), "TABLOOP_MODEL": tiny_model}
    result = _train(env, "--offline", "--algo", "rloo", *FAST, "--updates", "3", "--eval-dataset", str(held),
                    "--no-publish", str(data))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (summary["algo"], summary["group_size"], summary["scorer"], summary["kind"]) == ("rloo", 6, "exact", "FULL")
    assert [u["update"] for u in summary["updates"]] == [1, 2, 3] and summary["published"] is False
    assert all(u["samples"] == 12 for u in summary["updates"])
    assert any(u["updated"] for u in summary["updates"]), "no update had a group with signal"
    assert summary["eval_before"]["n"] == 2 and summary["eval_after"]["n"] == 2
    assert "train --offline: update 3/3" in result.stderr

    store = WeightStore(str(tmp_path / "state" / "weights"), tiny_model)
    assert store.versions() == [1] and summary["versions"][0]["version"] == 1
    m = store.manifest(1)
    assert m.kind == "FULL" and m.parent_version == 0 and m.episodes_consumed == 0
    assert {k: m.training[k] for k in ("mode", "algo", "group_size", "scorer", "dataset", "eval_dataset")} == {
        "mode": "offline", "algo": "rloo", "group_size": 6, "scorer": "exact", "dataset": str(data),
        "eval_dataset": str(held)}
    rewards = [u["reward_mean"] for u in summary["updates"]]
    assert m.metrics["reward_mean"] == pytest.approx(sum(rewards) / 3, abs=1e-5)
    assert m.metrics["updates"] == 3 and m.metrics["group_size"] == 6
    assert m.metrics["eval_after/exact_match"] == pytest.approx(summary["eval_after"]["exact_match"])
    # The saved weights are the trained policy's, not the base model's.
    trained, base = load_model(str(store.materialize(1, tmp_path / "cache")))[0], load_model(tiny_model)[0]
    b = base.state_dict()
    assert any(not torch.equal(p, b[k]) for k, p in trained.state_dict().items())

    # A second run continues from version 1 and says so.
    again = _train(env, "--offline", *FAST, "--updates", "1", "--no-publish", str(data))
    assert again.exit_code == 0, again.output
    assert store.versions() == [1, 2] and store.manifest(2).parent_version == 1
    assert store.manifest(2).training["algo"] == "grpo" and store.manifest(2).trainer_step >= m.trainer_step
    lora = _train(env, "--offline", "--lora", "--no-publish", str(data))
    assert lora.exit_code == 1 and "version 2 in the weight store is FULL" in lora.output
    # The user scorer: its user is part of what the version was trained on, and its evaluation has the user's figures.
    user = _train(env, "--offline", *FAST, "--updates", "2", "--scorer", "user", "--rule", "similarity",
                  "--threshold", "0.1", "--eval-dataset", str(held), "--no-publish", str(data))
    assert user.exit_code == 0, user.output
    summary = json.loads(user.stdout.strip().splitlines()[-1])
    assert (summary["scorer"], summary["user_rule"], summary["user_threshold"]) == ("user", "similarity", 0.1)
    assert {"accept_rate_shown", "shown_share", "accepted_chars_per_request"} <= summary["eval_after"].keys()
    assert store.versions() == [1, 2, 3], "neither user-scored update had a group with signal"
    assert (store.manifest(3).training["scorer"], store.manifest(3).training["user_rule"]) == ("user", "similarity")


def test_train_offline_refuses_what_it_cannot_do(tiny_model, tmp_path):
    from trainer.proof.tasks import save_tasks as save

    data = tmp_path / "tasks.jsonl"
    save([FimTask("t", "x = ", "\n", "1")], data)
    env = {"TABLOOP_STATE_DIR": str(tmp_path / "state"), "TABLOOP_MODEL": tiny_model,
           "TABLOOP_KAFKA_BOOTSTRAP": "127.0.0.1:9"}
    cases = [
        (["--offline"], "needs a DATASET"),
        ([str(data)], "DATASET only apply with --offline"),
        (["--algo", "rloo"], "--algo only apply with --offline"),
        (["--offline", "--max-versions", "2", str(data)], "--max-versions is for continuous training"),
        (["--offline", "--scorer", "tests", str(data)], "needs tasks with tests"),
        (["--offline", "--scorer", "judge", str(data)], "--judge-url"),
        (["--offline", "--scorer", "user", "--rule", "tests", str(data)], "--scorer user needs tasks with tests"),
        (["--offline", "--rule", "similarity", str(data)], "only apply with --scorer user"),
        (["--offline", "--publish", str(data)], "no Kafka answers on 127.0.0.1:9"),
        (["--offline", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
    ]
    for args, message in cases:
        result = _train(env, *args)
        assert result.exit_code != 0 and message in result.output, (args, result.output)
    # The random tiny model never writes "1": no group has signal, no update, and no copy of the base as a version.
    idle = _train(env, "--offline", "--group-size", "2", "--max-new-tokens", "1", "--no-publish", str(data))
    assert idle.exit_code == 0, idle.output
    assert json.loads(idle.stdout.strip().splitlines()[-1])["versions"] == [] and "no new version" in idle.stderr
    assert not (tmp_path / "state" / "weights").exists()


@pytest.mark.kafka
def test_train_offline_publishes_the_version(kafka, tiny_model, tmp_path):
    import shutil

    from tests.conftest import make_settings
    from policy.weight_store import read_weight_records

    base = str(tmp_path / "base")
    shutil.copytree(tiny_model, base)  # a base model of its own: the weights topic outlives this test
    data = tmp_path / "tasks.jsonl"
    save_tasks(_learnable_tasks(base, 2), data)
    env = {"TABLOOP_STATE_DIR": str(tmp_path / "state"), "TABLOOP_MODEL": base,
           "TABLOOP_KAFKA_BOOTSTRAP": kafka.settings.kafka_bootstrap,
           "TABLOOP_TOPIC_PARTITIONS": str(kafka.settings.topic_partitions)}
    result = _train(env, "--offline", *FAST, "--updates", "1", "--promote", str(data))  # publishes: a broker answers
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["published"] is True and summary["versions"][0]["status"] == "PROMOTED"
    settings = make_settings(tmp_path / "state", kafka_bootstrap=kafka.settings.kafka_bootstrap, model=base)
    mine = [r for r in read_weight_records(settings) if r["base_model"] == base]
    assert [(r["version"], r["status"], r["kind"]) for r in mine] == [(1, "PROMOTED", "FULL")]
    assert mine[0]["metrics"]["offline"] == 1.0 and mine[0]["metrics"]["group_size"] == 6.0
    assert mine[0]["uri"] == summary["versions"][0]["uri"]


def test_samples_carry_the_sampler_they_were_drawn_with():
    """The update weighs each sample under the temperature/top-p it was drawn at; greedy is refused up front."""
    batch = training_items(PROMPTS, GROUPS, "rloo", temperature=0.5, top_p=0.9)
    assert batch.samples and all((s.temperature, s.top_p) == (0.5, 0.9) for s in batch.samples)
    assert {(s.temperature, s.top_p) for s in training_items(PROMPTS, GROUPS, "grpo").samples} == {(1.0, 1.0)}
    with pytest.raises(ValueError, match="temperature"):
        OfflineConfig(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        OfflineConfig(top_p=0.0)
