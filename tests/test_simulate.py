"""Simulated Continue users: their decisions and payloads (pure), then a run against a real front door and broker."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from types import SimpleNamespace

import pytest

from infra.bus import ensure_topics
from policy.shown import shown_text, single_line_mode
from schemas.topics import COMPLETIONS, FEEDBACK
from serving import feedback
from infra.auth import KeyStore
from tests.conftest import make_settings
from tests.serving_helpers import ThreadServer, find_events, unique
from trainer.proof.simulate import (CONTINUE_STOPS, EVENT_SOURCES, SimConfig, UserModel, api_payload, completion_body,
                              data_event, decision_rows, fork_payload, sandbox_passes, simulate, summary_rate)
from trainer.proof.tasks import FimTask, build_source_tasks, humaneval_tasks

TASK = FimTask("t", prefix="def area(w, h):\n    return w", suffix="\n\nprint(area(1, 2))\n", middle=" * h",
               filepath="geo.py", repo="geo")


def test_single_line_mode_and_what_is_shown():
    assert single_line_mode("x = fo") and not single_line_mode("def f():\n    ")
    assert shown_text(" * h\n\nprint(2)", single_line=True) == " * h"
    assert shown_text("if x:\n    y()\n\n", single_line=False) == "if x:\n    y()"
    assert shown_text("\nfoo", single_line=True) is None  # a newline first: nothing on this line
    assert shown_text("  \n ", single_line=False) is None


def test_exact_rule_is_the_rest_of_the_true_line():
    user = UserModel()
    assert user.accepts(TASK, " * h")
    assert user.accepts(TASK, " * h   ")  # trailing whitespace is invisible
    assert not user.accepts(TASK, " * h + 0") and not user.accepts(TASK, "* h")
    multi = FimTask("m", "x = [", "\n", "1,\n    2]")
    assert user.accepts(multi, "1,\n    3]"), "the first line decides"


def test_similarity_rule_uses_the_threshold():
    assert UserModel("similarity", 0.75).accepts(TASK, " * w")  # 3 of 4 characters right
    assert not UserModel("similarity", 0.8).accepts(TASK, " * w")
    with pytest.raises(ValueError, match="threshold"):
        UserModel("similarity", 1.5)
    with pytest.raises(ValueError, match="rule"):
        UserModel("vibes")


def test_tests_rule_runs_the_tasks_tests(monkeypatch):
    task = next(t for t in humaneval_tasks(mode="line") if t.middle.startswith("return "))
    user = UserModel("tests")
    assert user.accepts(task, task.middle, run_tests=sandbox_passes)
    assert not user.accepts(task, "return None", run_tests=sandbox_passes)
    # A suggestion that forges its way past in-program tests (an answer equal to everything) fails the judge's.
    forged = "return type('E', (), {'__eq__': lambda s, o: True, '__ne__': lambda s, o: False})()"
    assert not user.accepts(task, forged, run_tests=sandbox_passes)
    with pytest.raises(ValueError, match="has none"):
        user.accepts(TASK, " * h", run_tests=sandbox_passes)
    # The sandbox the rule runs in is the test scorer's: sandbox_passes hands it the file and, apart, the
    # tests, so the verdict is the judge's (a program holding its own tests could forge it).
    ran = []
    monkeypatch.setattr("rewards.sandbox.run_tests",
                        lambda program, **kw: ran.append((program, kw.get("tests"))) or SimpleNamespace(passed=False))
    assert not user.accepts(task, task.middle, run_tests=sandbox_passes)
    assert ran == [(task.source_with(task.middle), task.test)]


def test_payloads_parse_into_the_events_the_front_door_makes():
    prompt = TASK.fim_prompt(with_context=True)
    fork = feedback.from_fork(fork_payload(TASK, prompt, " * h", True, client_id="c1", decision_ms=420,
                                           unique_id="m1"), project_id="p", user_id="u").record
    assert (fork["source"], fork["outcome"], fork["accepted_chars"], fork["client_time_ms"]) == (
        "continue-fork", "ACCEPTED", 4, 420)
    assert fork["prompt_sha256"] == hashlib.sha256(prompt.encode()).hexdigest() and fork["filepath"] == "geo.py"
    data = feedback.from_continue_data(data_event(TASK, prompt, " * w", False, client_id="c2", decision_ms=9000,
                                                  unique_id="m1", user_id="u"), project_id="p", user_id="u").record
    assert (data["source"], data["outcome"], data["client_completion_id"], data["completion"]) == (
        "continue-data", "REJECTED", "c2", " * w")
    api = feedback.from_api(api_payload("cmpl-1", " * h", True, decision_ms=300), project_id="p", user_id="u").record
    assert (api["source"], api["completion_id"], api["outcome"], api["accepted_chars"]) == ("api", "cmpl-1",
                                                                                           "ACCEPTED", 4)
    rejected = feedback.from_api(api_payload("cmpl-2", "x", False, decision_ms=1), project_id="p", user_id="u")
    assert rejected.record["outcome"] == "REJECTED" and rejected.record["completion"] is None


def test_completion_body_is_continues():
    body = completion_body("<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>", max_tokens=32, temperature=0.01)
    assert body["stream"] is True and body["stop"] == list(CONTINUE_STOPS) and "suffix" not in body
    assert "<|endoftext|>" in body["stop"] and "\n\n" in body["stop"]


def test_kept_characters_count_what_agrees_with_the_true_code():
    """Issue 41, item 4: of an accepted suggestion, the user keeps its common prefix with the true continuation."""
    import doctest

    from trainer.proof import simulate as sim
    from trainer.proof.simulate import kept_characters, kept_chars_of, true_continuations

    assert doctest.DocTestRunner().run(doctest.DocTestFinder().find(sim.kept_characters)[0]).failed == 0
    assert kept_characters("compute(1)", "compute(1)") == 10
    assert kept_characters("compute(2)", "compute(1)") == 8  # "compute(": half-right, not whole
    assert kept_characters("compute(1) + 1", "compute(1)") == 10  # written past the truth: not kept
    assert kept_characters("xompute(1)", "compute(1)") == 0  # a later match after a wrong start counts nothing
    # Single-line mode (the cursor after text): the truth is the rest of the true line, whatever follows.
    one = FimTask("a", "x = com", "\nrest()\n", "pute(1)\ny = 2")
    assert true_continuations(one, single_line=True) == ("pute(1)",)
    assert kept_chars_of(one, "pute(2)", True) == 5 and kept_chars_of(one, "pute(1)", True) == 7
    assert kept_chars_of(one, "pute(1)", False) == 0 and kept_chars_of(one, None, False) == 0  # rejected, not shown
    # Multi-line mode (the cursor at a line's start): the whole middle, not the suffix already in the file.
    block = FimTask("b", "def f(x):\n    ", "\n\nprint(f(1))\n", "y = x + 1\n    return y")
    assert not single_line_mode(block.prefix)
    assert kept_chars_of(block, "y = x + 1\n    return y", True) == 22  # all of it
    assert kept_chars_of(block, "y = x + 1\n    return x", True) == 21  # the last character is wrong
    assert kept_chars_of(block, "y = x + 1\n    return y\n\nprint(f(1))", True) == 22  # the suffix again: not kept
    # Several right answers (HumanEval's solutions): the longest agreement.
    many = FimTask("c", "x = ", "\n", "a + b", solutions=("a + b", "b + a"))
    assert kept_chars_of(many, "b + c", True) == 4


def test_decision_rows_count_kept_beside_accepted_characters():
    from rewards.spec import RewardSpec

    tasks = [FimTask("a", "x = ", "\n", "compute(1)"), FimTask("b", "y = ", "\n", "other(2)"),
             FimTask("c", "z = ", "\n", "third(3)")]
    # The similarity user takes a half-right line; exact would not.
    rows = decision_rows(tasks, ["compute(2)", "other(2)", "zzz"], UserModel("similarity", 0.8), RewardSpec())
    assert [r["accepted"] for r in rows] == [True, True, False]
    assert [r["accepted_chars"] for r in rows] == [10, 8, 0] and [r["kept_chars"] for r in rows] == [8, 8, 0]


def test_summary_by_hand():
    from trainer.proof.simulate import RequestRecord, SimReport

    def rec(shown, accepted, version, error=None, kept=None):
        return RequestRecord(user=0, task_id="t", route="api", completion_id="c", prompt_sha256="s",
                             with_context=False, shown=shown, accepted=accepted,
                             accepted_chars=len(shown) if accepted else 0,
                             kept_chars=(len(shown) if accepted else 0) if kept is None else kept,
                             policy_version=version, error=error, feedback_event_id="e" if shown else None)

    report = SimReport(records=[rec("abcd", True, 0, kept=1), rec("xy", False, 0), rec(None, False, 0),
                                rec("abcdef", True, 1), rec(None, False, 1), rec(None, False, None, error="boom")],
                       abandoned=2, errors=1)
    s = report.summary()
    assert (s["requests"], s["completed"], s["shown"], s["accepted"], s["errors"]) == (8, 5, 3, 2, 1)
    assert s["accept_rate_shown"] == pytest.approx(2 / 3, abs=1e-4) and s["shown_share"] == 0.6
    assert s["accepted_chars_per_request"] == 2.0  # (4 + 6) / 5
    assert s["kept_chars_per_request"] == 1.4  # (1 + 6) / 5
    assert "2.00 accepted chars/request, 1.40 kept" in summary_rate(s)
    v = report.by_version()
    assert set(v) == {0, 1}
    assert (v[0]["completed"], v[0]["shown"], v[0]["accept_rate_shown"], v[0]["shown_share"]) == (3, 2, 0.5, 0.6667)
    assert (v[1]["accepted_chars_per_request"], v[1]["shown_share"]) == (3.0, 0.5)
    assert (v[0]["kept_chars_per_request"], v[1]["kept_chars_per_request"]) == (0.3333, 3.0)


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="routes"):
        SimConfig(routes=("fork", "carrier-pigeon"))
    with pytest.raises(ValueError, match="requests or a duration"):
        SimConfig(requests=None)


# -- against the real front door and broker ---------------------------------------------------------

@pytest.mark.kafka
def test_simulated_users_feedback_lands_on_kafka_as_reported(kafka, tiny_model, tmp_path):
    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap, model=tiny_model,
                             completions_port=0, feedback_port=0)
    ensure_topics(settings)
    project = unique("sim")
    keys = KeyStore(settings.keys_file)
    api_keys = [keys.add(project, f"user{i}") for i in range(6)]
    tasks = build_source_tasks(split="train", max_files=20, per_file=2)
    server = ThreadServer(settings)
    try:
        config = SimConfig(completions_url=server.completions_url, feedback_url=server.feedback_url, users=6,
                           requests=30, rule="similarity", threshold=0.2, abandon_share=0.3, context_share=0.5,
                           debounce_s=0.01, max_tokens=16, temperature=1.0, api_keys=api_keys, seed=1)
        report = simulate(tasks, config, log=lambda _: None)
    finally:
        server.stop()
    summary = report.summary()
    assert summary["completed"] == 30 and summary["errors"] == 0 and summary["feedback_errors"] == 0
    assert summary["abandoned"] > 0 and summary["requests"] == 30 + summary["abandoned"]
    assert any(r.with_context for r in report.records) and any(not r.with_context for r in report.records)
    reported = {r.feedback_event_id: r for r in report.records if r.feedback_event_id}
    assert len(reported) == summary["shown"] == summary["feedback_sent"] > 0
    assert {r.route for r in reported.values()} == {"fork", "data", "api"}
    # Every HTTP call is on record with its answer: completions (abandoned ones too) and feedback.
    kinds = Counter((c.kind, c.status) for c in report.calls)
    assert kinds == {("completion", 200): 30, ("abandoned", 200): summary["abandoned"],
                     ("feedback", 202): len(reported)}
    assert all(c.started_at <= c.ended_at for c in report.calls)
    assert all(r.feedback_status == 202 for r in reported.values())
    # Each record's kept characters are its shown text's agreement with its task's true continuation.
    from trainer.proof.simulate import kept_chars_of

    by_id = {t.task_id: t for t in tasks}
    assert all(r.kept_chars == kept_chars_of(by_id[r.task_id], r.shown, r.accepted) <= r.accepted_chars
               for r in report.records)

    events = find_events(settings, FEEDBACK.name, lambda e: e.record["project_id"] == project, want=len(reported))
    assert sorted(e.event_id for e in events) == sorted(reported)  # every report, once, and nothing else
    for e in events:
        r, rec = reported[e.event_id], e.record
        assert rec["source"] == EVENT_SOURCES[r.route]
        assert rec["outcome"] == ("ACCEPTED" if r.accepted else "REJECTED")
        assert rec["user_id"] == f"user{r.user % 6}"
        if r.route == "api":
            assert rec["completion_id"] == r.completion_id
        else:
            assert rec["prompt_sha256"] == r.prompt_sha256 and rec["completion"] == r.shown
            assert json.loads(rec["raw_payload"])  # the original payload kept for replay
    served = find_events(settings, COMPLETIONS.name, lambda e: e.record["project_id"] == project,
                         want=summary["requests"])
    assert len(served) == summary["requests"]  # abandoned requests were served (and recorded) too
    assert sum(e.record["aborted"] for e in served) >= summary["abandoned"]
    by_id = {e.record["completion_id"]: e.record for e in served}
    for r in report.records:
        assert by_id[r.completion_id]["completion_text"].startswith(r.suggestion)
        assert by_id[r.completion_id]["prompt_sha256"] == r.prompt_sha256


@pytest.mark.kafka
def test_simulate_cli_makes_keys_and_ends_with_json(kafka, tiny_model, tmp_path):
    from click.testing import CliRunner

    from tabloop.cli import main
    from trainer.proof.tasks import save_tasks

    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap, model=tiny_model,
                             completions_port=0, feedback_port=0)
    ensure_topics(settings)
    data = tmp_path / "tasks.jsonl"
    save_tasks([TASK], data)
    server = ThreadServer(settings)
    project = unique("simcli")
    try:
        result = CliRunner().invoke(main, [
            "simulate", str(data), "--users", "2", "--requests", "4", "--max-tokens", "4", "--project", project,
            "--completions-url", server.completions_url, "--feedback-url", server.feedback_url],
            env={"TABLOOP_STATE_DIR": str(tmp_path), "TABLOOP_KAFKA_BOOTSTRAP": kafka.settings.kafka_bootstrap})
    finally:
        server.stop()
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["completed"] == 4 and summary["errors"] == 0
    assert {p.user_id for p in KeyStore(settings.keys_file).list() if p.project_id == project} == {"sim-0", "sim-1"}
    served = find_events(settings, COMPLETIONS.name, lambda e: e.record["project_id"] == project,
                         want=summary["requests"])
    assert len(served) == summary["requests"]
