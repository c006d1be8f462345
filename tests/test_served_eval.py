"""What `bench loop` measures on held-out tasks (issue 28, items 5 and 6): the served policy (a gate's decision
on sampled draws), the figures' intervals, the served (weight, gate) pairs, the goals. Numbers worked by hand."""

from __future__ import annotations

import math

import pytest

from policy.show_gate import FEATURES, Gate
from rewards.spec import RewardSpec
from trainer.ope import wilson_interval
from trainer.proof.evaluate import Draw
from trainer.proof.served import (Z, ConfidenceThreshold, choose_confidence_threshold, figures, gate_decision,
                                  mean_interval, paired_difference, paired_figures, relative_change, served_rows,
                                  wilson)
from trainer.proof.simulate import UserModel
from trainer.proof.tasks import FimTask


class _Coin:
    """An RNG whose every draw is ``value``."""

    def __init__(self, value: float):
        self.value = value

    def random(self) -> float:
        return self.value


def _gate(probability: float, threshold: float, exploration: float = 0.1, version: int = 1) -> Gate:
    """A gate that scores every line ``probability`` (zero weights, that intercept)."""
    n = len(FEATURES)
    return Gate(coef=(0.0,) * n, intercept=math.log(probability / (1 - probability)), mean=(0.0,) * n,
                scale=(1.0,) * n, threshold=threshold, exploration=exploration, version=version)


def test_the_gate_decides_as_the_door_does():
    assert gate_decision(None, "   ", [-0.1]) == (False, None, 1.0)  # an empty line shows nothing, gate or not
    assert gate_decision(_gate(0.3, 0.5), "", [-0.1]) == (False, None, 1.0)
    assert gate_decision(None, "x = 1", [-0.1]) == (True, None, 1.0)
    shown, score, p = gate_decision(_gate(0.3, 0.5), "x = 1", [-0.1, -2.0])
    assert (shown, round(score, 6), p) == (False, 0.3, 0.0)  # ε = 0: the gate's own decision
    assert gate_decision(_gate(0.6, 0.5), "x = 1", [-0.1])[0] is True
    # With exploration: under the threshold, shown when the coin falls under ε (0.1), with probability ε.
    assert gate_decision(_gate(0.3, 0.5), "x = 1", [-0.1], _Coin(0.05))[::2] == (True, 0.1)
    assert gate_decision(_gate(0.3, 0.5), "x = 1", [-0.1], _Coin(0.5))[::2] == (False, 0.1)
    assert gate_decision(_gate(0.6, 0.5), "x = 1", [-0.1], _Coin(0.99))[::2] == (True, 1.0)


def _tasks():
    return [FimTask("a", "x = ", "\nrest()\n", "compute(1)"), FimTask("b", "y = ", "\nrest()\n", "other(2)")]


def test_served_rows_hide_what_the_gate_hides_and_the_user_decides_the_rest():
    tasks = _tasks()
    draws = [Draw(0, 0, "compute(1)", "compute(1)", (-0.1, -0.2)), Draw(1, 0, "wrong(2)", "wrong(2)", (-3.0,)),
             Draw(0, 1, "", "", ()), Draw(1, 1, "other(2)", "other(2)", (-0.5,))]
    rows = served_rows(tasks, draws, None, UserModel("exact"), RewardSpec(), explore=False)
    assert [r["outcome"] for r in rows] == ["ACCEPTED", "REJECTED", "IGNORED", "ACCEPTED"]
    assert [r["hidden_by_gate"] for r in rows] == [False] * 4
    hidden = served_rows(tasks, draws, _gate(0.2, 0.5), UserModel("exact"), RewardSpec(), explore=False)
    assert [r["outcome"] for r in hidden] == ["IGNORED"] * 4
    assert [r["hidden_by_gate"] for r in hidden] == [True, True, False, True]  # the empty one was nothing anyway
    assert hidden[0]["completion"] == "compute(1)" and hidden[0]["gate_score"] == 0.2
    # With exploration, each row's coin is seeded by its task and draw: the same for any gate and any order.
    a = served_rows(tasks, draws, _gate(0.2, 0.5, exploration=0.5), UserModel("exact"), RewardSpec(), explore=True)
    b = served_rows(tasks, draws[::-1], _gate(0.2, 0.5, exploration=0.5), UserModel("exact"), RewardSpec(),
                    explore=True)
    assert [r["outcome"] for r in a] == [r["outcome"] for r in b][::-1]
    assert {r["show_probability"] for r in a if r["task_index"] == 0 and r["draw"] == 0} == {0.5}


def test_wilson_and_mean_intervals_by_hand():
    assert Z == pytest.approx(1.644854, abs=1e-6)  # 90 %, two-sided
    # 2 of 4: centre (0.5 + z²/8) / (1 + z²/4) = 0.5; half z / (1 + z²/4) · √(1/16 + z²/64) = 0.3176
    assert wilson(2, 4) == {"value": 0.5, "low": 0.1824, "high": 0.8176}
    assert wilson(0, 0) == {"value": None, "low": None, "high": None}
    assert wilson(0, 10)["low"] == 0.0 and wilson(0, 10)["high"] > 0
    # mean 2, sample sd 1: half z / √3 = 0.9497
    assert mean_interval([1.0, 2.0, 3.0]) == {"value": 2.0, "low": 1.0503, "high": 2.9497}
    assert mean_interval([4.0]) == {"value": 4.0, "low": 4.0, "high": 4.0}
    assert mean_interval([])["value"] is None


def _row(task: int, shown: bool, accepted: bool, chars: int = 0, hidden: bool = False, kept: int | None = None) -> dict:
    reward = 0.75 if accepted else (-0.25 if shown else 0.0)
    return {"task_index": task, "shown": "x" if shown else None, "accepted": accepted, "accepted_chars": chars,
            "kept_chars": chars if kept is None else kept, "reward": reward, "hidden_by_gate": hidden}


def test_figures_count_draws_and_take_the_means_intervals_over_tasks():
    # task 0: accepted (6 chars, 3 of them right) and rejected; task 1: hidden and accepted (2); task 2: rejected twice
    rows = [_row(0, True, True, 6, kept=3), _row(0, True, False), _row(1, False, False, hidden=True),
            _row(1, True, True, 2), _row(2, True, False), _row(2, True, False)]
    f = figures(rows)
    assert (f["n"], f["tasks"], f["shown"], f["accepted"], f["hidden_by_gate"]) == (6, 3, 5, 2, 1)
    assert (f["accept_rate_shown"], f["shown_share"]) == (0.4, 0.8333)
    assert f["accepted_chars_per_request"] == round(8 / 6, 4)
    # per task means 3, 1, 0: mean 4/3, sample sd √(7/3), half z · √(7/3) / √3
    half = Z * math.sqrt(7 / 3) / math.sqrt(3)
    assert f["intervals"]["accepted_chars_per_request"] == [round(4 / 3 - half, 4), round(4 / 3 + half, 4)]
    assert f["intervals"]["accept_rate_shown"] == [wilson(2, 5)["low"], wilson(2, 5)["high"]]
    assert f["reward_mean"] == round((0.75 - 0.25 + 0 + 0.75 - 0.25 - 0.25) / 6, 4)
    # Kept: 3 + 2 of the 8 accepted characters; per task means 1.5, 1, 0.
    assert f["kept_chars_per_request"] == round(5 / 6, 4)
    assert f["intervals"]["kept_chars_per_request"] == [mean_interval([1.5, 1.0, 0.0])["low"],
                                                        mean_interval([1.5, 1.0, 0.0])["high"]]
    # Clustered by task: the means' are the per-task means' (two draws in every task) ...
    by_task = f["intervals_by_task"]
    assert set(by_task) == {"accept_rate_shown", "shown_share", "accepted_chars_per_request",
                            "kept_chars_per_request", "reward_mean"}
    assert by_task["accepted_chars_per_request"] == f["intervals"]["accepted_chars_per_request"]
    # ... the accept rate's is Wilson at the effective number of shown: (accepted, shown) per task (1, 2), (1, 1),
    # (0, 2); R = 0.4; residuals 0.2, 0.6, −0.8: Σ² = 1.04; se² = 3/2 · 1.04 / 25 = 0.0624; n_eff = 0.24 / 0.0624.
    want = wilson_interval(0.4, 0.24 / 0.0624, Z)
    assert by_task["accept_rate_shown"] == [round(want.low, 4), round(want.high, 4)]
    assert by_task["accept_rate_shown"][1] - by_task["accept_rate_shown"][0] > (
        f["intervals"]["accept_rate_shown"][1] - f["intervals"]["accept_rate_shown"][0])  # wider than over draws


def test_paired_figures_difference_every_figure_by_task():
    before = [_row(0, True, False), _row(1, True, True, 4, kept=2), _row(2, True, True, 2)]
    after = [_row(0, True, True, 3), _row(0, False, False), _row(1, True, True, 4), _row(2, True, False),
             _row(2, True, False)]
    before.append(_row(3, True, True, 9))  # a task only one of them holds: left out
    d = paired_figures(after, before)
    # Per request over the three tasks both hold: accepted chars (3 + 4 + 0) / 5 − (0 + 4 + 2) / 3 = 1.4 − 2
    assert d["accepted_chars_per_request"]["value"] == -0.6 and d["accepted_chars_per_request"]["tasks"] == 3
    # kept: (3 + 4 + 0) / 5 − (0 + 2 + 2) / 3
    assert d["kept_chars_per_request"]["value"] == round(1.4 - 4 / 3, 4)
    # accept rate among shown: after 2 of 4 shown, before 2 of 3
    assert d["accept_rate_shown"]["value"] == round(2 / 4 - 2 / 3, 4) and d["accept_rate_shown"]["tasks"] == 3
    assert d["shown_share"]["value"] == round(4 / 5 - 1, 4)


def test_paired_difference_is_over_the_tasks_both_hold():
    before = [_row(0, True, False), _row(1, True, True, 4), _row(2, True, True, 2)]
    after = [_row(0, True, True, 3), _row(0, True, True, 1), _row(1, True, True, 4), _row(3, True, True, 9)]
    d = paired_difference(after, before, "accepted_chars")
    # tasks 0 and 1: differences 2 − 0 and 4 − 4 → mean 1, sd √2, half z · √2 / √2 = z
    assert d == {"value": 1.0, "low": round(1 - Z, 4), "high": round(1 + Z, 4)}
    assert relative_change(0.26, 0.2) == 0.3 and relative_change(0.1, 0.0) is None


def test_sample_draws_logs_the_behaviour_logprobs_of_the_scored_tokens(tiny_model):
    from policy.models import load_model
    from trainer.proof.evaluate import generate, sample_draws

    model, tokenizer = load_model(tiny_model)
    tasks = _tasks() * 2
    greedy = sample_draws(model, tokenizer, tasks, draws=1, temperature=0.0, max_new_tokens=8, batch_size=3)
    assert [d.completion for d in greedy] == generate(model, tokenizer, tasks, max_new_tokens=8, batch_size=3)
    assert all(lp == 0.0 for d in greedy for lp in d.line_logprobs)  # a point mass
    sampled = sample_draws(model, tokenizer, tasks, draws=2, temperature=1.0, max_new_tokens=8, batch_size=3)
    assert [(d.task_index, d.draw) for d in sampled] == [(i, k) for k in range(2) for i in range(4)]
    for d in sampled:
        assert "\n" not in d.line and d.completion.startswith(d.line.rstrip()[:1])
        assert 1 <= len(d.line_logprobs) <= 8 and all(lp <= 0 for lp in d.line_logprobs)
    assert any(lp < 0 for d in sampled for lp in d.line_logprobs)
    # The logged figures are log π_T of the sampled tokens, recomputed here by one forward pass of each row alone.
    import torch

    from policy.fim import prompt_format, prompt_token_ids
    from policy.sampling import sampling_log_probs

    fmt, compared = prompt_format(tokenizer), 0
    for d in sampled:
        prompt = prompt_token_ids(tokenizer, tasks[d.task_index].fim_prompt(), 2048, fmt)[0]
        assert len(d.line_token_ids) == len(d.line_logprobs)
        ids = torch.tensor([prompt + list(d.line_token_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1]
        want = sampling_log_probs(logits, 1.0, 1.0).gather(-1, torch.tensor(d.line_token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(d.line_logprobs), want, atol=1e-3), (d, want)
        compared += 1
    assert compared >= 2


def test_feedback_to_policy_counts_a_trained_gate():
    from tabloop.loop_bench import feedback_to_policy_s

    records = [{"sent_at": 100.0, "latency_ms": 0, "policy_version": 0, "gate_version": None, "error": None,
                "feedback_sent_at": 101.0},
               {"sent_at": 120.0, "latency_ms": 500, "policy_version": 0, "gate_version": 1, "error": None,
                "feedback_sent_at": None},
               {"sent_at": 130.0, "latency_ms": 0, "policy_version": 1, "gate_version": None, "error": None,
                "feedback_sent_at": None}]
    assert feedback_to_policy_s(records) == 19.5  # the gate's completion (120.5) came before version 1's
    assert feedback_to_policy_s([records[0], records[2]]) == 29.0


def test_only_versions_that_served_users_are_evaluated():
    """The SmolLM2 run of 2026-12-02 published version 50 after its users stopped: its 'last' entry was v50
    without a gate, while users had last been served v49 with gate 82."""
    from tabloop.loop_bench import versions_served, versions_to_evaluate

    pairs = {0: [1, 2], 25: [13], 49: [82]}
    assert versions_served({v: 0.0 for v in range(1, 51)}, pairs) == [25, 49]
    assert versions_to_evaluate(versions_served(range(1, 51), pairs), 3) == [0, 25, 49]


def test_served_pairs_and_the_gate_each_served_version_was_decided_by():
    from tabloop.loop_bench import gates_by_version, served_pairs

    records = [{"policy_version": 0, "gate_version": None, "error": None},
               {"policy_version": 0, "gate_version": 2, "error": None},
               {"policy_version": 1, "gate_version": 2, "error": None},
               {"policy_version": 1, "gate_version": 3, "error": None},
               {"policy_version": 2, "gate_version": 9, "error": "ReadTimeout"},
               {"policy_version": None, "gate_version": None, "error": None}]
    assert served_pairs(records) == {0: [2], 1: [2, 3]}
    gates = [{"project_id": "", "version": 2, "status": "CANDIDATE", "id": "shared-candidate"},
             {"project_id": "", "version": 2, "status": "PROMOTED", "id": "shared-2"},
             {"project_id": "", "version": 3, "status": "PROMOTED", "id": "shared-3"},
             {"project_id": "p", "version": 3, "status": "PROMOTED", "id": "p-3"},
             {"project_id": "q", "version": 4, "status": "PROMOTED", "id": "q-4"},
             {"project_id": "", "version": 5, "status": "ROLLED_BACK", "id": "shared-5"}]
    assert {v: r["id"] for v, r in gates_by_version(gates, "p").items()} == {2: "shared-2", 3: "p-3"}


def test_the_goals_read_the_paired_interval_and_the_teams_gain():
    from tabloop.loop_bench import goal, team_goal

    base = {"accept_rate_shown": 0.20, "shown_share": 0.90, "accepted_chars_per_request": 3.0}
    better = {"accept_rate_shown": 0.26, "shown_share": 0.70, "accepted_chars_per_request": 2.8}
    assert not goal(base, better, 30.0)["accepted_chars_not_lower"]  # no interval: the point figures
    g = goal(base, better, 30.0, {"value": -0.2, "low": -0.5, "high": 0.1})
    assert g["accepted_chars_not_lower"] and g["accept_rate_rel_change"] == 0.3 and g["met"]
    assert not goal(base, better, 30.0, {"value": -0.4, "low": -0.6, "high": -0.1})["met"]
    first = {"accept_rate_shown": 0.2, "intervals": {"accept_rate_shown": [0.15, 0.26]}}
    last = {"accept_rate_shown": 0.31, "intervals": {"accept_rate_shown": [0.25, 0.37]}}
    t = team_goal(first, last)
    assert t["accept_rate_rel_change"] == 0.55 and t["met"] and t["interval_above_first"]
    assert not team_goal(first, {**last, "accept_rate_shown": 0.29})["met"]


def test_the_team_loop_runs_one_teams_tasks_with_its_user_and_no_gate(tmp_path):
    from tabloop.loop_bench import LoopBenchConfig, bench_settings, tasks_and_user
    from tests.conftest import make_settings
    from trainer.proof.teams import TeamUsers

    config = LoopBenchConfig(team="double", threshold=0.3, heldout=5, train_limit=7)
    train, heldout, user = tasks_and_user(config)
    assert (len(train), len(heldout)) == (7, 5) and user == TeamUsers(0.3)
    assert {t.source for t in train + heldout} == {"team:double"}
    assert all("'" not in t.middle or '"' in t.middle for t in heldout)
    assert not {t.task_id for t in train} & {t.task_id for t in heldout}
    base = make_settings(tmp_path)
    assert bench_settings(base, config, tmp_path / "s", "m").show_gate is False
    assert bench_settings(base, LoopBenchConfig(), tmp_path / "s", "m").show_gate == base.show_gate
    with pytest.raises(ValueError, match="team must be one of"):
        LoopBenchConfig(team="tabs")
    with pytest.raises(ValueError, match="draws"):
        LoopBenchConfig(draws=0)


def test_the_confidence_threshold_baseline_reads_the_mean_token_probability():
    """Issue 41, item 6: a plain server's show rule, its threshold chosen by the show-gate's rule on train rows."""
    from policy.show_gate import line_features

    rule = ConfidenceThreshold(0.5)
    # Mean log-probability of ln 0.8 and ln 0.5: the geometric mean √0.4 = 0.632 ≥ 0.5: shown.
    assert rule.score(line_features("x = 1", [math.log(0.8), math.log(0.5)])) == pytest.approx(math.sqrt(0.4))
    assert gate_decision(rule, "x = 1", [math.log(0.8), math.log(0.5)]) == (True, pytest.approx(math.sqrt(0.4)), 1.0)
    assert gate_decision(rule, "x = 1", [math.log(0.3)])[0] is False
    tasks = _tasks() + [FimTask("c", "z = ", "\nrest()\n", "third(3)")]
    # Train rows: a sure right line (p 0.9, 10 chars accepted), an unsure wrong one (p 0.2), an unsure right one
    # (p 0.4, 8 chars), an empty one (never shown, whatever its score).
    draws = [Draw(0, 0, "compute(1)", "compute(1)", (math.log(0.9),)),
             Draw(1, 0, "wrong(2)", "wrong(2)", (math.log(0.2),)),
             Draw(2, 0, "third(3)", "third(3)", (math.log(0.4),)), Draw(0, 1, "", "", (math.log(0.01),))]
    rows = served_rows(tasks, draws, None, UserModel("exact"), RewardSpec(), explore=False)
    assert [r["accepted_chars"] for r in rows] == [10, 0, 8, 0]
    # Keeping 95 % of the 18 accepted characters allows losing 0.9: hiding the p 0.2 line loses 0, the p 0.4 line 8.
    assert choose_confidence_threshold(rows, draws, keep=0.95) == pytest.approx(0.4)
    # Keeping 50 % allows losing 9: the 8-character line goes too.
    assert choose_confidence_threshold(rows, draws, keep=0.5) == pytest.approx(0.9)
    assert choose_confidence_threshold(rows[1:2], draws[1:2], keep=0.95) == 0.0  # nothing accepted: show all
