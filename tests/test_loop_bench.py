"""`tabloop bench loop`: the figures by hand, and one short run of the whole loop with the tiny model (a drill)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rewards.spec import RewardSpec
from tabloop.loop_bench import FIGURES, KEPT, REPORTED, feedback_to_policy_s, goal, heldout_rows
from trainer.metrics import user_figures
from trainer.proof.simulate import UserModel
from trainer.proof.tasks import FimTask

ROOT = Path(__file__).resolve().parents[1]


def _task(i: int, prefix: str, middle: str) -> FimTask:
    return FimTask(f"t{i}", prefix, "\nrest()\n", middle)


def test_heldout_figures_by_hand():
    tasks = [_task(0, "x = ", "compute(1)"), _task(1, "y = ", "other(2)"), _task(2, "z = ", "third(3)"),
             _task(3, "w = ", "fourth(4)")]
    # accepted (10 chars), rejected, nothing shown (whitespace), accepted (9 chars)
    completions = ["compute(1)", "wrong(2)", "   ", "fourth(4)"]
    rows = heldout_rows(3, tasks, completions, UserModel("exact"), RewardSpec())
    assert [r["outcome"] for r in rows] == ["ACCEPTED", "REJECTED", "IGNORED", "ACCEPTED"]
    assert [r["reward"] for r in rows] == [0.75, -0.25, 0.0, 0.75]
    fig = user_figures(rows)
    assert fig == {"n": 4, "accept_rate_shown": round(2 / 3, 4), "shown_share": 0.75,
                   "accepted_chars_per_request": round(19 / 4, 4), "reward_mean": round(1.25 / 4, 4)}
    assert user_figures([])["accept_rate_shown"] is None
    with pytest.raises(ValueError, match="3 tasks but 2 completions"):
        heldout_rows(0, tasks[:3], completions[:2], UserModel("exact"), RewardSpec())


def test_feedback_to_policy_is_first_feedback_to_first_trained_completion():
    records = [
        {"sent_at": 100.0, "latency_ms": 500, "policy_version": 0, "error": None, "feedback_sent_at": 101.0},
        {"sent_at": 102.0, "latency_ms": 500, "policy_version": 0, "error": None, "feedback_sent_at": None},
        {"sent_at": 140.0, "latency_ms": 250, "policy_version": 1, "error": "ReadTimeout", "feedback_sent_at": None},
        {"sent_at": 150.0, "latency_ms": 250, "policy_version": 2, "error": None, "feedback_sent_at": 151.0},
        {"sent_at": 145.0, "latency_ms": 1000, "policy_version": 1, "error": None, "feedback_sent_at": None},
    ]
    assert feedback_to_policy_s(records) == 45.0  # 145 + 1 - 101; the failed request does not count
    assert feedback_to_policy_s(records[:2]) is None


def test_goal_compares_the_last_version_with_the_base():
    base = {"accept_rate_shown": 0.10, "shown_share": 0.80, "accepted_chars_per_request": 1.0}
    better = {"accept_rate_shown": 0.13, "shown_share": 0.60, "accepted_chars_per_request": 1.2}
    g = goal(base, better, 30.0)
    assert g["accept_rate_rel_change"] == 0.3 and g["shown_share_rel_change"] == -0.25 and g["met"]
    assert not goal(base, better, 75.0)["met"]
    worse = {**better, "accepted_chars_per_request": 0.9}
    assert not goal(base, worse, 30.0)["accepted_chars_not_lower"]


def test_the_goals_carry_the_paired_differences():
    base = {"accept_rate_shown": 0.10, "shown_share": 0.80, "accepted_chars_per_request": 1.0,
            "intervals_by_task": {"accept_rate_shown": [0.05, 0.15]}}
    better = {"accept_rate_shown": 0.13, "shown_share": 0.60, "accepted_chars_per_request": 1.2,
              "intervals_by_task": {"accept_rate_shown": [0.09, 0.18]}}
    kept = {"value": 0.1, "low": -0.05, "high": 0.25, "se": 0.09, "tasks": 40}
    assert goal(base, better, 30.0, None, kept)["kept_chars_difference"] == kept
    from tabloop.loop_bench import team_goal

    t = team_goal(base, better, {"value": 0.03, "low": 0.01, "high": 0.05})
    assert t["difference_above_zero"] and t["accept_rate_shown_intervals_by_task"] == {
        "first": [0.05, 0.15], "last": [0.09, 0.18]}
    assert not team_goal(base, better, {"value": 0.03, "low": -0.01, "high": 0.07})["difference_above_zero"]
    assert not team_goal(base, better)["difference_above_zero"]


def test_the_confidence_threshold_baseline_is_chosen_on_train_tasks_and_measured_on_held_out_ones():
    """Issue 41, item 6: "greedy + a fixed logprob threshold chosen on train traffic", beside the reference."""
    import math
    from types import SimpleNamespace

    from tabloop.loop_bench import LoopBenchConfig, threshold_baseline
    from trainer.proof.evaluate import Draw
    from trainer.proof.served import served_rows

    train = [_task(0, "x = ", "compute(1)"), _task(1, "y = ", "other(2)"), _task(2, "z = ", "third(3)")]
    greedy_train = {"t0": ("compute(1)", 0.9), "t1": ("wrong(2)", 0.2), "t2": ("third(3)", 0.4)}
    asked = []

    def sample_greedy(tasks):
        asked.append([t.task_id for t in tasks])
        return [Draw(i, 0, greedy_train[t.task_id][0], greedy_train[t.task_id][0],
                     (math.log(greedy_train[t.task_id][1]),)) for i, t in enumerate(tasks)]

    heldout = [_task(10, "a = ", "alpha()"), _task(11, "b = ", "beta()")]
    draws = [Draw(0, 0, "alpha()", "alpha()", (math.log(0.5),)), Draw(1, 0, "gamma()", "gamma()", (math.log(0.3),))]
    user, spec = UserModel("exact"), RewardSpec()
    reference = served_rows(heldout, draws, None, user, spec, explore=False)
    settings = SimpleNamespace(gate_keep_chars=0.95)
    baseline, rows = threshold_baseline(LoopBenchConfig(threshold_tasks=3), settings, train, draws, reference,
                                        heldout, user, spec, sample_greedy)
    # Train: 18 characters accepted (10 at p 0.9, 8 at p 0.4); keeping 95 % hides only the p 0.2 line: θ = 0.4.
    assert asked == [["t0", "t1", "t2"]] and baseline["threshold"] == 0.4 and baseline["train_tasks"] == 3
    assert baseline["train"]["accepted_chars_per_request"] == 6.0
    # Held out: alpha() at 0.5 shown and accepted (7 characters), gamma() at 0.3 hidden.
    assert [r["outcome"] for r in rows] == ["ACCEPTED", "IGNORED"]
    assert (baseline["shown_share"], baseline["accept_rate_shown"], baseline["accepted_chars_per_request"],
            baseline[KEPT], baseline["reward_mean"]) == (0.5, 1.0, 3.5, 3.5, 0.375)
    # Beside the reference (both shown: 0.75 − 0.25): the same characters, half as much shown, reward +0.125.
    vs = baseline["vs_reference"]
    assert (vs["shown_share"]["value"], vs["accepted_chars_per_request"]["value"], vs["reward_mean"]["value"]) == (
        -0.5, 0.0, 0.125)
    # At most threshold_tasks train tasks, a seeded sample: the same two every time.
    again = [threshold_baseline(LoopBenchConfig(threshold_tasks=2), settings, train, draws, reference, heldout,
                                user, spec, sample_greedy)[0]["train_tasks"] for _ in range(2)]
    assert again == [2, 2] and len(asked[1]) == 2 and asked[1] == asked[2]
    with pytest.raises(ValueError, match="threshold_tasks"):
        LoopBenchConfig(threshold_tasks=-1)


def test_the_team_rule_baseline_rewrites_greedys_quotes_and_is_measured_beside_the_reference():
    """Issue 41, items 5 and 6: "the rule baseline reported beside the learned policy" of the team loop."""
    from tabloop.loop_bench import rule_baseline
    from trainer.proof.evaluate import Draw
    from trainer.proof.served import served_rows
    from trainer.proof.teams import TeamUsers, quote_rule, team_task

    assert quote_rule('f("a", "b")', "single") == "f('a', 'b')" and quote_rule("x['k']", "double") == 'x["k"]'
    assert quote_rule("no quotes", "single") == "no quotes"
    heldout = [team_task(_task(10, "print(", '"alpha")'), "single"), team_task(_task(11, "log(", '"beta")'), "single")]
    assert [t.middle for t in heldout] == ["'alpha')", "'beta')"]
    # Greedy writes task 10's literal in double quotes (the other team's habit), task 11's wrongly altogether.
    draws = [Draw(0, 0, '"alpha")', '"alpha")', ()), Draw(1, 0, '"gamma")', '"gamma")', ())]
    user, spec = TeamUsers(0.3), RewardSpec()
    reference = served_rows(heldout, draws, None, user, spec, explore=False)
    assert [r["outcome"] for r in reference] == ["REJECTED", "REJECTED"]  # the wrong quotes: never taken
    baseline, rows = rule_baseline("single", heldout, draws, reference, user, spec)
    # Re-quoted: 'alpha') is the line itself (accepted, 8 characters); 'gamma') against 'beta') has the quotes
    # but not the text (edit similarity 0.5 ≥ 0.3: accepted too, 8 characters, the similarity user's leniency).
    assert [r["shown"] for r in rows] == ["'alpha')", "'gamma')"]
    assert [r["outcome"] for r in rows] == ["ACCEPTED", "ACCEPTED"]
    assert baseline["accepted_chars_per_request"] == 8.0 and baseline["rule"] == "quotes rewritten to '"
    assert baseline["vs_reference"]["accepted_chars_per_request"]["value"] == 8.0


def test_the_oracle_ceiling_takes_each_tasks_best_completion_by_hand():
    """Issue 41, item 6: "the oracle best-of-k as the ceiling"."""
    from tabloop.loop_bench import oracle_rows

    greedy = [{"task_index": 0, "draw": 0, "accepted_chars": 0}, {"task_index": 1, "draw": 0, "accepted_chars": 5}]
    draws = [{"task_index": 0, "draw": 0, "accepted_chars": 7}, {"task_index": 0, "draw": 1, "accepted_chars": 3},
             {"task_index": 1, "draw": 0, "accepted_chars": 5}, {"task_index": 1, "draw": 1, "accepted_chars": 0}]
    best = oracle_rows(greedy, draws)
    # Task 0: the first draw's 7 beats greedy's 0 and the second's 3. Task 1: a tie at 5 keeps greedy's row.
    assert [r["accepted_chars"] for r in best] == [7, 5]
    assert best[0] is draws[0] and best[1] is greedy[1]
    assert oracle_rows(greedy) == greedy  # one candidate: the ceiling is greedy itself


def test_the_printed_table_shows_kept_beside_accepted_with_the_clustered_intervals():
    from tabloop.loop_bench import results_table

    def entry(n, values, by_task=None, vs=None):
        e = {"n": n, **dict(zip(REPORTED, values))}
        if by_task is not None:
            e["intervals_by_task"] = dict(zip(REPORTED, by_task))
        if vs is not None:
            e["vs_reference"] = vs
        return e

    reference = entry(8, [0.25, 1.0, 2.0, 1.5, -0.05], [[0.1, 0.4], [1.0, 1.0], [1.0, 3.0], [0.5, 2.5], [-0.2, 0.1]])
    reference["threshold_baseline"] = {**entry(8, [0.5, 0.5, 2.0, 1.5, 0.2]), "threshold": 0.4,
                                       "vs_reference": {"accepted_chars_per_request": {"value": 0.0, "low": None},
                                                        KEPT: {"value": 0.0, "low": -0.5, "high": 0.5}}}
    served = {**entry(16, [0.3, 0.9, 2.5, 2.25, 0.0], [[0.2, 0.4], [0.8, 1.0], [1.5, 3.5], [1.25, 3.25], [-0.1, 0.1]],
                      {"accepted_chars_per_request": {"value": 0.5, "low": -0.25, "high": 1.25},
                       KEPT: {"value": 0.75, "low": 0.125, "high": 1.375}}), "version": 3, "gate_version": 2}
    table = results_table({"reference": reference, "versions": [served]}).splitlines()
    assert table[0] == ("| policy | n | accept rate among shown | share shown | accepted chars/req | kept chars/req | "
                        "mean reward | Δ accepted chars/req vs reference | Δ kept chars/req vs reference |")
    assert table[2] == ("| v0 greedy, always shown (reference) | 8 | 0.250 [0.100, 0.400] | 1.000 [1.000, 1.000] | "
                        "2.000 [1.000, 3.000] | 1.500 [0.500, 2.500] | -0.050 [-0.200, 0.100] | – | – |")
    assert table[3] == ("| v0 greedy, mean token prob ≥ 0.4 (chosen on train) | 8 | 0.500 | 0.500 | 2.000 | 1.500 | "
                        "0.200 | +0.000 | +0.000 [-0.500, +0.500] |")
    assert table[4] == ("| v3 + gate v2, served | 16 | 0.300 [0.200, 0.400] | 0.900 [0.800, 1.000] | "
                        "2.500 [1.500, 3.500] | 2.250 [1.250, 3.250] | 0.000 [-0.100, 0.100] | "
                        "+0.500 [-0.250, +1.250] | +0.750 [+0.125, +1.375] |")
    assert "clustered by task" in table[-1] and "paired by task" in table[-1]


# The loop bench's drills: about 400 s alone, past 540 s beside three other drills on a busy day (two CI runs
# at 1f5ef00); the limits guard a hang, they time nothing.
LOOP_DRILL_S = 840


@pytest.mark.drill
@pytest.mark.timeout(LOOP_DRILL_S + 60)
def test_bench_loop_runs_the_whole_system_and_its_figures_come_from_its_records(tiny_model, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TABLOOP_STATE_DIR": str(tmp_path / "base"),
           "TABLOOP_SHOW_GATE": "true", "TABLOOP_GATE_KEEP_CHARS": "0.9"}
    proc = subprocess.run(
        [sys.executable, "-m", "tabloop.cli", "bench", "loop", "--quick", "--model", tiny_model, "--minutes", "1.0",
         "--train-limit", "60", "--heldout", "8", "--exploration-temperature", "1.0",
         "--eval-temperature", "1.0", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=LOOP_DRILL_S)  # inside the test's limit
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    assert set(result) >= {"versions", "feedback_to_policy_s", "online", "goal", "reference", "served_pairs",
                           "intervals_note", "differences_last_vs_first"}
    # The gate's settings, as the run's environment gave them, are in the result.
    assert (result["show_gate"]["keep_chars"], result["show_gate"]["kept_by"]) == (0.9, "expected")
    versions = result["versions"]
    assert versions[0]["version"] == 0 and versions[0]["gate_version"] is None and len(versions) >= 2, result
    assert [v["version"] for v in versions] == sorted(v["version"] for v in versions)  # trained versions appeared
    assert result["draws"] == 2 and result["eval_temperature"] == 1.0
    for v in versions:  # the served policy: 8 tasks, 2 draws each, every figure with its two intervals
        assert set(v) >= {"version", "gate_version", *REPORTED, "n", "intervals", "intervals_by_task",
                          "vs_reference", "deterministic"} and v["n"] == 16
        for key in REPORTED:
            for kind in ("intervals", "intervals_by_task"):
                low, high = v[kind][key]
                assert v[key] is None or low <= v[key] <= high
        assert v[KEPT] <= v["accepted_chars_per_request"]
        # Beside the greedy always-show reference, paired by task over the 8 tasks both hold.
        assert v["vs_reference"][KEPT]["tasks"] == 8
    reference = result["reference"]  # version 0 greedy, always shown: one completion per task
    assert (reference["version"], reference["decoding"], reference["n"]) == (0, "greedy", 8)
    assert set(reference["intervals"]) == set(REPORTED) == set(reference["intervals_by_task"])
    threshold = reference["threshold_baseline"]  # version 0 greedy under a threshold chosen on 16 train tasks
    assert threshold["train_tasks"] == 16 and threshold["n"] == 8 and 0 <= threshold["threshold"] <= 1
    assert threshold["shown"] <= reference["shown"]
    # The ceiling: per task the best of greedy and the 2 draws, never below greedy on any task.
    oracle = reference["oracle"]
    assert oracle["candidates"] == 3 and oracle["n"] == 8
    assert oracle["vs_reference"]["accepted_chars_per_request"]["value"] >= 0
    table = (out / "table.md").read_text()
    assert "v0 greedy, always shown (reference)" in table and "clustered by task" in table
    assert result["feedback_to_policy_s"] is not None and result["feedback_to_policy_s"] > 0
    assert (out / "loop.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "loop.json").read_text())["versions"] == versions

    # Every held-out figure is recomputed from the bench's own recorded completions.
    rows = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    for v in versions:
        mine = [r for r in rows if (r["version"], r["gate_version"], r["policy"]) == (
            v["version"], v["gate_version"], "served")]
        shown = [r for r in mine if r["shown"] is not None]
        assert len(mine) == v["n"]
        assert v["shown_share"] == round(len(shown) / len(mine), 4)
        if shown:
            assert v["accept_rate_shown"] == round(sum(r["accepted"] for r in shown) / len(shown), 4)
        assert v["reward_mean"] == round(sum(r["reward"] for r in mine) / len(mine), 4)
        assert v[KEPT] == round(sum(r["kept_chars"] for r in mine) / len(mine), 4)
    # And feedback→policy from the recorded requests.
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert feedback_to_policy_s(requests) == result["feedback_to_policy_s"]
    assert {o["version"] for o in result["online"]} == {r["policy_version"] for r in requests
                                                         if r["error"] is None and r["policy_version"] is not None}


@pytest.mark.drill
@pytest.mark.timeout(LOOP_DRILL_S + 60)
def test_bench_loop_team_runs_one_teams_users_with_lora_updates_and_no_gate(tiny_model, tmp_path):
    """Issue 28, item 5: the team loop through the real front door, streams worker and trainer."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TABLOOP_STATE_DIR": str(tmp_path / "base")}
    proc = subprocess.run(
        [sys.executable, "-m", "tabloop.cli", "bench", "loop", "--quick", "--team", "single", "--model", tiny_model,
         "--minutes", "1.0", "--train-limit", "40", "--heldout", "6", "--exploration-temperature", "1.0",
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=LOOP_DRILL_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["team"] == "single" and result["trainer"]["show_gate"] is False
    assert (result["rule"], result["user_threshold"]) == ("team", 0.3)  # TeamUsers decide, not the stdlib rule
    assert result["show_gate"] is None  # no gate, so no gate settings to report
    assert result["trainer"]["lora_rank"] >= 1 and result["heldout_tasks"] == 6
    versions = result["versions"]
    assert len(versions) >= 2 and all(v["gate_version"] is None and v["n"] == 12 for v in versions), versions
    assert set(result["goal"]) >= {"accept_rate_rel_change", "accept_rate_up_50pct", "met"}
    rows = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert {r["policy"] for r in rows} == {"served", "reference", "reference_threshold", "reference_rule",
                                           "reference_oracle"}
    assert result["reference"]["rule_baseline"]["n"] == 6  # the rule baseline beside the learned policy
    # The team's tasks: the cursor before a string literal, the team's quotes in the rest of the line.
    assert all(not r["reference"].startswith('"') for r in rows)
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert requests and all(r["gate_version"] is None for r in requests)


def _start_time(pid: int) -> str | None:
    """The process's start time from /proc (a pid reused later has another); None: no such live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def test_sigterm_ends_the_bench_through_its_cleanup(tmp_path):
    """`kill` of a running loop bench (or a CI timeout) must go through the bench's ``finally``, which stops its
    Kafka broker and components and removes its state dir; Python's default for SIGTERM ends the process at
    once, and left the broker and the trainer running. A process set up as ``run_loop_bench`` sets itself up,
    with a child of its own, is sent SIGTERM: its cleanup runs, the child goes, the exit status says why."""
    import signal
    import textwrap

    cleaned = tmp_path / "cleaned"
    script = tmp_path / "bench_like.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, time
        from pathlib import Path
        from tabloop.bench import stop_cleanly_on_sigterm

        child = subprocess.Popen(["sleep", "600"])
        restore = stop_cleanly_on_sigterm()
        try:
            print(child.pid, flush=True)
            time.sleep(600)
        finally:
            child.terminate()
            child.wait()
            Path({str(cleaned)!r}).write_text("cleaned up")
            restore()
    """))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        started = _start_time(child)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert started is not None and cleaned.read_text() == "cleaned up" and _start_time(child) != started


def test_versions_to_evaluate_keeps_the_base_and_the_last():
    from tabloop.loop_bench import versions_to_evaluate

    assert versions_to_evaluate([1, 2, 3], None) == [0, 1, 2, 3]
    assert versions_to_evaluate([1, 2, 3], 10) == [0, 1, 2, 3]
    assert versions_to_evaluate([1, 2, 3, 4], 3) == [0, 2, 4]
    picked = versions_to_evaluate(list(range(1, 41)), 12)
    assert len(picked) == 12 and picked[0] == 0 and picked[-1] == 40


def test_bench_settings_turn_unanswered_completions_into_ignored_episodes(tmp_path):
    from tests.conftest import make_settings
    from tabloop.loop_bench import LoopBenchConfig, bench_settings

    base = make_settings(tmp_path)
    on = bench_settings(base, LoopBenchConfig(ignored_ttl_s=15.0), tmp_path / "s", "m")
    assert (on.emit_ignored, on.completion_ttl_s) == (True, 15.0)
    assert on.idle_close_s <= 5.0  # a quiet partition still closes its completions soon after the TTL
    assert on.rate_limit_per_minute >= 100_000  # the users share open auth's one bucket
    assert on.trainer_max_staleness == LoopBenchConfig().max_staleness
    off = bench_settings(base, LoopBenchConfig(ignored_ttl_s=None), tmp_path / "s", "m")
    assert (off.emit_ignored, off.completion_ttl_s, off.idle_close_s) == (
        base.emit_ignored, base.completion_ttl_s, base.idle_close_s)
    with pytest.raises(ValueError, match="ignored_ttl_s"):
        LoopBenchConfig(ignored_ttl_s=0.0)
    with pytest.raises(ValueError, match="abandon_share"):
        LoopBenchConfig(abandon_share=1.0)


def test_bench_settings_with_the_vllm_engine_have_the_supervisor_start_a_replica_of_its_own(tmp_path):
    from infra.vllm_env import manages_replicas
    from tests.conftest import make_settings
    from tabloop.loop_bench import LoopBenchConfig, bench_settings

    base = make_settings(tmp_path).model_copy(update={"vllm_urls": "http://elsewhere:8000", "vllm_port": 8090})
    on = bench_settings(base, LoopBenchConfig(engine="vllm", vllm_dtype="bfloat16"), tmp_path / "s", "m")
    assert (on.engine, on.vllm_replicas, on.vllm_dtype) == ("vllm", 1, "bfloat16") and manages_replicas(on)
    assert on.vllm_port not in (8090, on.completions_port, on.feedback_port)  # a port of the bench's own
    assert bench_settings(base, LoopBenchConfig(), tmp_path / "s", "m").engine == "transformers"
    with pytest.raises(ValueError, match="engine must be transformers or vllm"):
        LoopBenchConfig(engine="tgi")


def test_episode_outcomes_count_one_project_and_the_empty_ignored_ones():
    from tabloop.loop_bench import episode_outcomes

    eps = [{"project_id": "p", "outcome": "ACCEPTED", "completion_text": "x"},
           {"project_id": "p", "outcome": "REJECTED", "completion_text": "y = 1"},
           {"project_id": "p", "outcome": "IGNORED", "completion_text": ""},
           {"project_id": "p", "outcome": "IGNORED", "completion_text": "  \n"},
           {"project_id": "p", "outcome": "IGNORED", "completion_text": "abandoned start"},
           {"project_id": "other", "outcome": "IGNORED", "completion_text": ""}]
    assert episode_outcomes(eps, "p") == {"ACCEPTED": 1, "REJECTED": 1, "PARTIAL": 0, "IGNORED": 3,
                                          "ignored_empty": 2}


def test_trainer_figures_take_each_promoted_version_of_the_base_once():
    from tabloop.loop_bench import trainer_figures

    def rec(version, status, base="m", **metrics):
        return {"version": version, "status": status, "base_model": base, "metrics": metrics}

    records = [rec(0, "PROMOTED"), rec(2, "CANDIDATE", policy_loss=9.0), rec(1, "PROMOTED", reward_mean=-0.25,
               policy_loss=0.0), rec(2, "PROMOTED", reward_mean=-0.1, accept_rate=0.1, policy_loss=0.0123456789),
               rec(2, "ROLLED_BACK", policy_loss=5.0), rec(3, "PROMOTED", base="other", policy_loss=1.0)]
    figs = trainer_figures(records, "m")
    assert [f["version"] for f in figs] == [1, 2]
    assert figs[0]["policy_loss"] == 0.0 and figs[0]["accept_rate"] is None
    assert (figs[1]["reward_mean"], figs[1]["accept_rate"], figs[1]["policy_loss"]) == (-0.1, 0.1, 0.012346)
    assert figs[1]["logprob_gap_mean"] is None  # a figure the version's metrics lack is None, not 0


def test_ope_vs_canary_pairs_each_versions_estimate_with_its_canarys_measurement():
    from tabloop.loop_bench import ope_vs_canary

    def rec(version, status, base="m", **metrics):
        return {"version": version, "status": status, "base_model": base, "metrics": metrics}

    est = dict(ope_accept_rate_shown=0.3, ope_accept_rate_shown_low=0.2, ope_accept_rate_shown_high=0.4, ope_ess=50.0,
               ope_held_out=120.0, ope_serving_version=0.0, ope_serving_accept_rate_shown=0.25, ope_gate_passed=0.0)
    records = [rec(1, "CANDIDATE", **est, canary_share=0.5),
               rec(1, "PROMOTED", **est, canary_candidate_accept_rate=0.35, canary_candidate_episodes=60.0),
               rec(2, "CANDIDATE", **{**est, "ope_accept_rate_shown_high": 0.31}),
               rec(2, "ROLLED_BACK", **{**est, "ope_accept_rate_shown_high": 0.31}, canary_candidate_accept_rate=0.33),
               rec(3, "CANDIDATE", **est),  # replaced before its canary was decided: nothing measured
               rec(4, "PROMOTED", base="other", **est, canary_candidate_accept_rate=0.9)]
    got = ope_vs_canary(records, "m")
    assert (got["compared"], got["inside"]) == (2, 1)
    one, two, three = got["versions"]
    assert one["inside"] is True and one["measured"] == 0.35 and one["decision"] == "PROMOTED" and one["ess"] == 50.0
    assert two["inside"] is False and two["decision"] == "ROLLED_BACK"
    assert "measured" not in three and "inside" not in three


def test_the_plot_draws_every_reported_figure_with_both_baselines(tmp_path):
    from tabloop.loop_bench import plot

    def entry(version, gate, scale):
        values = {k: scale * (i + 1) / 10 for i, k in enumerate(REPORTED)}
        return {"version": version, "gate_version": gate, **values,
                "intervals_by_task": {k: [v - 0.05, v + 0.05] for k, v in values.items()}}

    reference = {**entry(0, None, 1.0), "threshold_baseline": entry(0, None, 0.8)}
    old = {k: v for k, v in entry(2, None, 1.2).items() if k != KEPT}  # a result written before kept characters
    result = {"versions": [entry(0, None, 1.0), entry(1, 3, 1.1), old], "reference": reference,
              "online": [{"version": 0, **{k: 0.1 for k in REPORTED}}], "model_label": "m", "minutes": 1.0,
              "users": 1, "heldout_tasks": 8, "feedback_to_policy_s": None}
    assert plot(result, tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_held_out_chooser_shows_each_tasks_likeliest_candidate_with_its_suffix_read(tiny_model, tmp_path):
    """``chosen_draws`` (the door's chooser, mirrored on held-out tasks): per task greedy and two samples, the
    one with the highest log p(candidate) + log p(suffix after it), computed here row by row on the model."""
    from dataclasses import replace

    from policy.models import load_model
    from policy.show_gate import LOGPROB_CLIP
    from policy.shown import shown_text, single_line_mode
    from policy.value_model import SUFFIX_CHARS, SUFFIX_TOKENS
    from policy.fim import prompt_format, prompt_token_ids
    from tabloop.loop_bench import chosen_draws
    from tests.conftest import make_settings
    from tests.test_candidate_chooser import reference_logprobs
    from trainer.proof.evaluate import sample_draws
    from trainer.proof.tasks import resolve_dataset

    settings = make_settings(tmp_path, model=tiny_model)
    model, tok = load_model(tiny_model)
    tasks = list(resolve_dataset("stdlib:heldout", seed=0, limit=6))
    tasks[5] = replace(tasks[5], suffix="")  # nothing to read after the cursor: greedy, as the door serves it
    common = dict(max_new_tokens=8, top_p=1.0, batch_size=8, max_prompt_tokens=settings.max_prompt_tokens)
    greedy = sample_draws(model, tok, tasks, draws=1, temperature=0.0, **common)
    samples = sample_draws(model, tok, tasks, draws=2, temperature=0.7, seed=3, **common)
    chosen, what = chosen_draws(settings, model, tok, tasks, greedy, samples)

    assert [d.task_index for d in chosen] == list(range(6)) and {d.draw for d in chosen} == {0}
    picks = []
    for i, task in enumerate(tasks):
        cands = [greedy[i]] + [d for d in samples if d.task_index == i]
        texts = [shown_text(d.completion, single_line=single_line_mode(task.prefix)) for d in cands]
        prompt = prompt_token_ids(tok, task.fim_prompt(), settings.max_prompt_tokens, prompt_format(tok))[0]
        suffix = tok.encode(task.suffix[:SUFFIX_CHARS], add_special_tokens=False)[:SUFFIX_TOKENS]
        posterior = []
        for t in texts:
            ids = tok.encode(t, add_special_tokens=False) if t else []
            lps = reference_logprobs(model, prompt + ids + suffix, len(prompt)) if ids or suffix else []
            posterior.append(sum(max(lp, LOGPROB_CLIP) for lp in lps) if t is not None else float("-inf"))
        best = max(posterior)
        expected = 0 if not task.suffix or best == float("-inf") or posterior[0] >= best - 1e-4 \
            else posterior.index(best)
        assert chosen[i].completion == cands[expected].completion or texts[expected] == \
            shown_text(chosen[i].completion, single_line=single_line_mode(task.prefix)), (i, texts, posterior)
        picks.append(expected)
    assert chosen[5].completion == greedy[5].completion
    assert what["candidates"] == 3
    assert what["chose_a_sample"] == sum(1 for p in picks if p) >= 1  # not greedy everywhere
