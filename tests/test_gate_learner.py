"""The trainer's show-gate learner (trainer/show_gate_learner.py): decided lines from episodes, the off-policy estimate
of a candidate by hand, when a gate is fit and published, and on a real broker: episodes in, a PROMOTED gate
version out, a restart that does not republish, and `tabloop gates rollback`."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner

from policy.show_gate import FEATURES, Decided, Gate, line_features, serving_gate_record
from schemas.events import new_event
from rewards.spec import RewardSpec, RewardSpecs
from tests.conftest import make_settings
from trainer.episodes import drop_reason
from trainer.show_gate_learner import (GateLearner, decided_from_episode, estimate_show_rule, evaluate_candidate,
                               expected_keep, promotion, restated, weighted_auc)

T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)


def episode(i: int, *, outcome: str = "ACCEPTED", text: str = "return x", logprobs=(-0.5, -1.0, -0.1),
            project: str = "acme", show_probability: float = 1.0, gate_shown: bool = True, matched: bool = True,
            acceptance: float | None = None, joined_at: datetime | None = None) -> dict:
    reward = {"ACCEPTED": 0.75, "REJECTED": -0.25, "IGNORED": 0.0, "PARTIAL": 0.25}[outcome]
    return new_event("Episode", completion_id=f"c-{project}-{i}", project_id=project, user_id="u",
                     policy_version=0, prompt="def f(x):\n    ", completion_text=text,
                     completion_token_ids=list(range(len(logprobs))), behaviour_logprobs=list(logprobs),
                     temperature=0.7, top_p=0.95, outcome=outcome, reward=reward,
                     reward_components={"acceptance": reward if acceptance is None else acceptance},
                     scorer="acceptance", matched=matched, gate_shown=gate_shown,
                     show_probability=show_probability, joined_at=joined_at or T0 + timedelta(seconds=i)).record


def synthetic(n: int, *, seed: int = 0, project: str = "acme", start: int = 0, accept=None) -> list[dict]:
    """Lines whose acceptance depends on how sure the model was (the mean logprob): a gate can learn it."""
    rng = random.Random(seed)
    out = []
    for i in range(start, start + n):
        sure = rng.uniform(-3.0, 0.0)
        logprobs = [min(0.0, sure + rng.gauss(0, 0.3)) for _ in range(rng.randint(2, 8))]
        accepted = rng.random() < 1 / (1 + math.exp(-3 * (sure + 1.5))) if accept is None else accept
        out.append(episode(i, outcome="ACCEPTED" if accepted else "REJECTED", logprobs=logprobs, project=project,
                           text="x" * rng.randint(3, 30)))
    return out


# -- decided lines ------------------------------------------------------------------------------------------


def test_decided_from_episode_by_hand():
    d = decided_from_episode(episode(1, text="  return x  ", show_probability=0.1))
    assert d == Decided(features=tuple(line_features("  return x  ", [-0.5, -1.0, -0.1])), accepted=True,
                        accepted_chars=8.0, show_probability=0.1, line_chars=8.0)
    rejected = decided_from_episode(episode(2, outcome="REJECTED"))
    assert (rejected.accepted, rejected.accepted_chars, rejected.show_probability) == (False, 0.0, 1.0)
    # PARTIAL: accepted, with the share of the line kept read back from the acceptance reward: 0.15 is 40 % of
    # the way from -0.25 to 0.75 (the default spec), so 40 % of 10 characters.
    partial = decided_from_episode(episode(3, outcome="PARTIAL", text="abcdefghij", acceptance=0.15))
    assert partial.accepted and partial.accepted_chars == pytest.approx(4.0)
    # ... by the project's own spec when it has one: 0.15 is half way from -0.35 to 0.65.
    specs = RewardSpecs(projects={"acme": RewardSpec(accepted=0.65, rejected=-0.35)})
    assert decided_from_episode(episode(3, outcome="PARTIAL", text="abcdefghij", acceptance=0.15),
                                specs).accepted_chars == pytest.approx(5.0)
    # Nothing decided about a line the user saw: no decided line.
    assert decided_from_episode(episode(4, outcome="IGNORED")) is None
    assert decided_from_episode(episode(5, gate_shown=False, outcome="IGNORED")) is None
    assert decided_from_episode(episode(6, gate_shown=False, outcome="REJECTED")) is None
    assert decided_from_episode(episode(7, matched=False)) is None
    assert decided_from_episode(episode(8, text="  \n")) is None


def test_a_multi_line_episode_is_scored_on_its_first_line_as_the_door_scored_it():
    """The door decides on the first line and the tokens up to the one that ended it; a learner that scored
    the whole episode would fit a gate on figures the door never sees."""
    from policy.show_gate import line_features

    record = {**episode(1, text="ab\ncd", logprobs=(-1.0, -2.0, -3.0, -4.0)), "completion_token_ends": [1, 3, 4, 5]}
    assert decided_from_episode(record).features == tuple(line_features("ab", [-1.0, -2.0]))
    assert decided_from_episode(record).accepted_chars == 5  # the user kept all of what was shown
    assert decided_from_episode({**record, "completion_token_ends": []}) is None  # no ends: cannot cut it


def test_the_ppo_trainer_drops_gate_hidden_episodes():
    """A completion the gate hid was never the model's choice to show nothing: never trained on."""
    hidden = episode(1, outcome="IGNORED", gate_shown=False, show_probability=0.9)
    assert drop_reason(hidden, 0, 4) == "gate_hidden"
    assert drop_reason(episode(2, outcome="IGNORED"), 0, 4) is None  # shown and ignored: trained as before
    assert drop_reason(episode(3, gate_shown=True, show_probability=0.1), 0, 4) is None  # explored, decided


# -- the off-policy estimate by hand ---------------------------------------------------------------------------


LINES = [Decided((0.0,) * 7, True, 10.0, 1.0), Decided((0.0,) * 7, False, 0.0, 1.0),
         Decided((0.0,) * 7, True, 4.0, 0.5), Decided((0.0,) * 7, False, 0.0, 0.5)]
SCORES = [0.9, 0.6, 0.2, 0.1]


def test_the_ope_of_a_show_rule_by_hand():
    """Weights 1, 1, 2, 2 (Σ 6): the two lines shown half the time stand for two lines each."""
    always = estimate_show_rule(LINES, [True] * 4)
    assert always["accepted_chars"] == pytest.approx((10 + 2 * 4) / 6)
    assert always["shown_share"] == pytest.approx(1.0)
    assert always["accept_rate_shown"] == pytest.approx((1 + 2) / 6)
    gate = estimate_show_rule(LINES, [s >= 0.5 for s in SCORES])
    assert gate["accepted_chars"] == pytest.approx(10 / 6)
    assert gate["shown_share"] == pytest.approx(2 / 6)
    assert gate["accept_rate_shown"] == pytest.approx(1 / 2)
    assert gate["accept_rate_shown_low"] < 0.5 < gate["accept_rate_shown_high"]
    # Unweighted, the same lines would say always-show accepts half of them: the weights matter.
    assert estimate_show_rule([Decided(d.features, d.accepted, d.accepted_chars) for d in LINES],
                              [True] * 4)["accept_rate_shown"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="4 decided"):
        estimate_show_rule(LINES, [True])


def test_evaluate_candidate_and_promotion_by_hand():
    m = evaluate_candidate(LINES, SCORES, 0.15, hidden_scores=[0.3, 0.05])
    # Threshold 0.15 hides the last line only, which was rejected: every accepted character is kept.
    assert m["keep_chars"] == pytest.approx(1.0)
    assert m["gate_accept_rate_shown"] == pytest.approx(3 / 4) and m["always_accept_rate_shown"] == pytest.approx(0.5)
    assert (m["lines"], m["hidden"], m["hidden_would_show"]) == (4.0, 2.0, 0.5)
    assert m["ess"] == pytest.approx(36 / 10)
    assert promotion(m, keep=0.99, serving_version=None)[0] == "PROMOTED"
    # Threshold 0.5 also hides the line of 4 characters shown half the time: keeps 10 of 18.
    m = evaluate_candidate(LINES, SCORES, 0.5)
    assert m["keep_chars"] == pytest.approx(10 / 18)
    status, reason = promotion(m, keep=0.99, serving_version=None)
    assert status == "ROLLED_BACK" and "0.556 of always-show's accepted characters" in reason
    # A serving gate that accepts more among what it shows than the candidate: the candidate waits.
    serving = Gate(coef=(0.0,) * 7, intercept=0.0, mean=(0.0,) * 7, scale=(1.0,) * 7, threshold=0.5)  # shows all
    m = evaluate_candidate(LINES, SCORES, 0.15, serving=serving)
    assert m["serving_accept_rate_shown"] == pytest.approx(0.5) and m["serving_keep_chars"] == pytest.approx(1.0)
    assert promotion(m, keep=0.99, serving_version=3)[0] == "PROMOTED"
    worse = {**m, "gate_accept_rate_shown": 0.4}
    status, reason = promotion(worse, keep=0.99, serving_version=3)
    assert status == "ROLLED_BACK" and "gate v3's 0.500" in reason


@pytest.mark.parametrize("kept_by", ["realised", "expected"])
def test_a_serving_gate_that_hides_too_much_is_no_bar_to_one_that_keeps_enough(kept_by):
    """A first gate fit on 50 lines can hide far more than it believed: judged on the log as it now is, it
    keeps 60 % of the accepted characters. A candidate keeping 99.5 % replaces it though its accept rate among
    shown is lower (it shows more); when the serving gate keeps enough, the lower accept rate still bars it."""
    key = "keep_chars_expected" if kept_by == "expected" else "keep_chars"
    m = {key: 0.995, "gate_accept_rate_shown": 0.30, "serving_accept_rate_shown": 0.45, f"serving_{key}": 0.6}
    status, reason = promotion(m, keep=0.99, serving_version=3, kept_by=kept_by)
    assert status == "PROMOTED" and "gate v3 keeps only 0.600" in reason
    status, reason = promotion({**m, f"serving_{key}": 0.995}, keep=0.99, serving_version=3, kept_by=kept_by)
    assert status == "ROLLED_BACK" and "0.300 < gate v3's 0.450" in reason
    # Served the shared gate (no version of the project's own): said so, not "gate vNone".
    assert "the shared gate keeps only" in promotion(m, keep=0.99, serving_version=None, kept_by=kept_by)[1]


def test_promotion_counts_the_kept_characters_as_the_fit_did():
    """Expected gains (score × line characters × weight): 0.9·10, 0.6·6, 2·0.2·4, 2·0.1·8 = 9, 3.6, 1.6, 1.6
    of 15.8; threshold 0.5 keeps 12.6 of them. Realised, the same threshold keeps 10 of 18."""
    lines = [replace(d, line_chars=c) for d, c in zip(LINES, (10.0, 6.0, 4.0, 8.0))]
    shows = [s >= 0.5 for s in SCORES]
    assert expected_keep(lines, SCORES, shows) == pytest.approx(12.6 / 15.8)
    m = {**evaluate_candidate(lines, SCORES, 0.5), "keep_chars_expected": expected_keep(lines, SCORES, shows)}
    assert promotion(m, keep=0.75, serving_version=None, kept_by="expected")[0] == "PROMOTED"
    status, reason = promotion(m, keep=0.75, serving_version=None, kept_by="realised")
    assert status == "ROLLED_BACK" and "0.556" in reason


def test_weighted_auc_by_hand():
    assert weighted_auc([0.9, 0.1], [True, False], [1, 1]) == 1.0
    assert weighted_auc([0.1, 0.9, 0.5], [True, False, False], [1, 1, 1]) == 0.0
    # One accepted at 0.5 over rejected at 0.4 (weight 3) and 0.6 (weight 1); a tie counts a half.
    assert weighted_auc([0.5, 0.4, 0.6], [True, False, False], [1, 3, 1]) == pytest.approx(0.75)
    assert weighted_auc([0.5, 0.5], [True, False], [1, 1]) == 0.5
    assert weighted_auc([0.5], [True], [1]) is None


def test_the_serving_gate_is_the_newest_promoted_not_rolled_back():
    def rec(v, status, project=""):
        return {"project_id": project, "version": v, "status": status, "feature_names": list(FEATURES)}

    records = [rec(1, "PROMOTED"), rec(2, "PROMOTED"), rec(3, "ROLLED_BACK"), rec(1, "PROMOTED", "acme")]
    assert serving_gate_record(records, "")["version"] == 2
    assert serving_gate_record(records + [rec(2, "ROLLED_BACK")], "")["version"] == 1
    assert serving_gate_record(records, "acme")["version"] == 1
    assert serving_gate_record(records, "other") is None


# -- when the learner fits ---------------------------------------------------------------------------------------


def learner(tmp_path, **over) -> GateLearner:
    settings = make_settings(tmp_path, gate_min_decided=50, gate_refit_every=20, **over)
    gl = GateLearner(settings, "base")
    gl.mark_caught_up()
    return gl


def test_the_first_gate_comes_after_min_decided_lines_of_both_outcomes_then_every_refit_every(tmp_path):
    gl = learner(tmp_path)
    lines = synthetic(90, seed=1)
    assert 10 < sum(r["outcome"] == "ACCEPTED" for r in lines[:50]) < 40
    for r in lines[:49]:
        gl.add_episode(r)
        assert gl.refit_due() == []
    gl.add_episode(episode(1000, outcome="IGNORED"))  # not a decided line: still 49
    gl.add_episode(episode(1001, outcome="IGNORED", gate_shown=False))  # a hidden one: still 49
    assert gl.refit_due() == []
    gl.add_episode(lines[49])
    [first] = gl.refit_due()
    r = first.record
    assert (r["version"], r["project_id"], r["status"], r["parent_version"], r["episodes_used"]) == (1, "", "PROMOTED", None, 50)
    # The settings' rule (expected characters, 0.95) decided it: the promotion checked that figure.
    assert r["metrics"]["auc_cross_fitted"] > 0.6 and r["metrics"]["keep_chars_expected"] >= 0.95
    assert r["metrics"]["hidden"] == 1.0 and r["exploration"] == 0.1
    assert 0 < r["threshold"] < 1
    # The next refit after 20 new decided lines, not before; its parent is the gate now serving.
    for r in lines[50:69]:
        gl.add_episode(r)
        assert gl.refit_due() == []
    gl.add_episode(lines[50])  # the same event again (a replay: an Episode's id is its identity): not new
    assert gl.refit_due() == []
    gl.add_episode(lines[69])
    [second] = gl.refit_due()
    assert (second.record["version"], second.record["parent_version"], second.record["episodes_used"]) == (2, 1, 70)


def test_no_gate_from_one_outcome_and_a_refit_after_a_promoted_weight_version(tmp_path):
    gl = learner(tmp_path)
    for r in synthetic(80, seed=2, accept=True):
        gl.add_episode(r)
        assert gl.refit_due() == []  # everything accepted: nothing to separate
    for r in synthetic(60, seed=3, start=100):
        gl.add_episode(r)
    [gate] = gl.refit_due()
    assert gate.record["policy_version"] == 0
    gl.add_weight_record({"event_id": "w1", "base_model": "base", "project_id": "", "version": 7,
                          "status": "PROMOTED"})
    [refit] = gl.refit_due()  # no new line: the promoted weights moved the logprobs the features are made of
    assert refit.record["policy_version"] == 7 and refit.record["version"] == 2
    assert gl.refit_due() == []


def test_a_project_with_its_own_policy_gets_its_own_gate_and_the_shared_one_sees_everyone(tmp_path):
    gl = learner(tmp_path, project_policies="acme")
    for r in synthetic(50, seed=4, project="acme") + synthetic(50, seed=5, project="other", start=500):
        gl.add_episode(r)
    events = {e.record["project_id"]: e.record for e in gl.refit_due()}
    assert set(events) == {"", "acme"}
    assert events["acme"]["episodes_used"] == 50 and events["acme"]["version"] == 1


def test_after_a_restart_only_lines_newer_than_the_newest_gate_count(tmp_path):
    gl = GateLearner(make_settings(tmp_path, gate_min_decided=50, gate_refit_every=20), "base")
    lines = synthetic(100, seed=6)
    for r in lines:
        gl.add_episode(r)
    assert gl.refit_due() == []  # reading the history: nothing is fit
    gl.add_gate_record(gate_record(1, created_at=lines[89]["joined_at"]))
    gl.mark_caught_up()
    assert gl.windows[""].new == 10 and gl.refit_due() == []
    for r in synthetic(10, seed=7, start=100):
        gl.add_episode(r)
    [refit] = gl.refit_due()
    assert refit.record["version"] == 2


def gate_record(version: int, status: str = "PROMOTED", **over) -> dict:
    gate = Gate(coef=(1.0,) + (0.0,) * 6, intercept=0.0, mean=(0.0,) * 7, scale=(1.0,) * 7, threshold=0.2,
                version=version)
    return new_event("GateVersion", **{**gate.as_record(), "parent_version": None, "episodes_used": 5,
                                       "metrics": {}, "status": status, **over}).record


def test_restated_keeps_the_gate_and_changes_the_status():
    record = gate_record(3)
    again = restated(record, "ROLLED_BACK", "why").record
    assert (again["status"], again["reason"], again["version"], again["threshold"]) == ("ROLLED_BACK", "why", 3, 0.2)
    assert again["event_id"] != record["event_id"]


# -- on a real broker --------------------------------------------------------------------------------------------


def gate_records(settings) -> list[dict]:
    from infra.bus import read_topic
    from schemas.topics import GATES

    return [r.event.record for r in read_topic(settings, GATES.name) if r.event is not None]


@pytest.mark.kafka
def test_episodes_in_a_promoted_gate_out_a_restart_quiet_and_a_rollback(own_kafka, tmp_path):
    """A broker of its own: a shared gate published on the session broker would hide other tests' completions."""
    import time

    from infra.bus import EventProducer, ensure_topics
    from infra.settings import to_environ
    from tabloop.cli import main
    from tests.system_helpers import wait
    from trainer.show_gate_learner import GateLearnerThread

    settings = make_settings(tmp_path, kafka_bootstrap=own_kafka.settings.kafka_bootstrap, gate_min_decided=50,
                             gate_refit_every=20)
    ensure_topics(settings)
    now = datetime.now(timezone.utc)
    history = [{**r, "joined_at": now - timedelta(minutes=10) + timedelta(seconds=i)}
               for i, r in enumerate(synthetic(60, seed=8))]
    producer = EventProducer(settings, client_id="test-gate-learner")
    try:
        for r in history:
            producer.publish(new_event("Episode", **r))
        producer.flush()
        thread = GateLearnerThread(settings, "base", producer).start()
        try:
            first = wait(lambda: [r for r in gate_records(settings) if r["status"] == "PROMOTED"], 30,
                         "a PROMOTED gate from 60 decided episodes")
            assert [r["version"] for r in first] == [1] and first[0]["episodes_used"] == 60
            # Live: 20 more decided lines, a second version within seconds of the last one's arrival.
            started = time.monotonic()
            for r in synthetic(20, seed=9, start=100):
                producer.publish(new_event("Episode", **{**r, "joined_at": datetime.now(timezone.utc)}))
            producer.flush()
            second = wait(lambda: [r for r in gate_records(settings) if r["version"] == 2], 20,
                          "the refit after 20 more decided episodes")
            assert time.monotonic() - started < 20 and second[0]["episodes_used"] == 80
            assert second[0]["parent_version"] == 1  # the gate serving when it was fit
        finally:
            thread.stop()
        assert thread.error is None and thread.published == 2
        # A restart reads the history again and has nothing new to fit: it publishes nothing.
        again = GateLearnerThread(settings, "base", producer).start()
        try:
            wait(lambda: again.learner.caught_up, 20, "the restarted learner to read the history")
            assert len(again.learner.windows[""].decided) == 80
            time.sleep(1.0)
            assert again.published == 0 and again.error is None
        finally:
            again.stop()
    finally:
        producer.close()
    # `tabloop gates rollback`: the version is published ROLLED_BACK, and `gates list` says so.
    env = to_environ(settings)
    result = CliRunner().invoke(main, ["gates", "rollback", "--version", "1"], env=env)
    assert result.exit_code == 0, result.output
    assert "version 1 of the shared gate rolled back" in result.output
    rolled = [r for r in gate_records(settings) if r["version"] == 1]
    assert [r["status"] for r in rolled] == ["PROMOTED", "ROLLED_BACK"]
    assert rolled[1]["threshold"] == rolled[0]["threshold"] and "tabloop gates rollback" in rolled[1]["reason"]
    listed = CliRunner().invoke(main, ["gates", "list", "--json"], env=env)
    assert listed.exit_code == 0, listed.output
    import json

    rows = {row["version"]: row for row in map(json.loads, listed.output.splitlines())}
    assert rows[1]["status"] == "ROLLED_BACK" and not rows[1]["serving"]
    again = CliRunner().invoke(main, ["gates", "rollback", "--version", "1"], env=env)
    assert again.exit_code != 0 and "rolled back already" in again.output
    missing = CliRunner().invoke(main, ["gates", "rollback", "--version", "9", "--project", "acme"], env=env)
    assert missing.exit_code != 0 and "no version 9 of project acme's gate" in missing.output


def test_while_no_gate_serves_a_candidate_is_tried_on_every_new_line(tmp_path):
    gl = learner(tmp_path)
    lines = synthetic(90, seed=1)
    for r in lines[:50]:
        gl.add_episode(r)
    [first] = gl.refit_due()
    # As if the first candidate had been rolled back: none serves, so the next new line brings the next fit.
    gl.gate_records[-1] = {**gl.gate_records[-1], "status": "ROLLED_BACK"}
    assert gl.serving_gate("")[0] is None and gl.refit_due() == []  # no new line: nothing to try again
    gl.add_episode(lines[50])
    [second] = gl.refit_due()
    assert (second.record["version"], second.record["episodes_used"]) == (2, 51)
    assert second.record["status"] == "PROMOTED" and second.record["parent_version"] is None
    # Now one serves: the next fit waits for gate_refit_every (20) new lines.
    for r in lines[51:70]:
        gl.add_episode(r)
        assert gl.refit_due() == []
    gl.add_episode(lines[70])
    [third] = gl.refit_due()
    assert third.record["episodes_used"] == 71 and third.record["parent_version"] == 2


def test_fit_due_by_hand():
    from trainer.show_gate_learner import fit_due

    rule = dict(min_decided=50, refit_every=20)
    assert not fit_due(49, 49, serving=False, **rule)  # too few lines
    assert fit_due(50, 50, serving=False, **rule)
    assert fit_due(51, 1, serving=False, **rule)  # none serves: every new line
    assert not fit_due(51, 0, serving=False, **rule)  # nothing new since the last attempt
    assert not fit_due(70, 19, serving=True, **rule)  # one serves: every 20 new lines
    assert fit_due(71, 20, serving=True, **rule)
    assert fit_due(71, 0, serving=True, policy_moved=True, **rule)  # new logprobs: new features
    assert not fit_due(49, 0, serving=False, policy_moved=True, **rule)
