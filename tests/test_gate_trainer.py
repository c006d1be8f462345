"""The promotion gate in a real trainer on the real broker (TABLOOP_PROMOTE_GATE=ope).

Every episode is a one-token completion, A or B, with the base model's own logprob of that token as its
behaviour logprob (version 0 served it at temperature 1). The training episodes say A is accepted and B
rejected, so the trained version gives A more probability; whether it may go out depends on what the
held-out episodes (never trained on) say about A.
"""

from __future__ import annotations

import pytest

from schemas.events import new_event
from schemas.topics import WEIGHTS
from tests.serving_helpers import find_events
from tests.test_trainer_online import produce, setup, train_once  # noqa: F401  (setup is a fixture)
from trainer.promotion import in_gate_holdout

pytestmark = pytest.mark.kafka

SHARE = 0.5


def _episodes(tok, base: str, n: int, *, held_out_accepts_a: bool) -> tuple[list, int]:
    """(events, how many of them are held out): training episodes reward A, held-out ones as asked."""
    from policy.models import load_model
    from trainer.learner import PolicyTrainer, Sample, UpdateConfig

    model, _ = load_model(base)
    scorer = PolicyTrainer(model, tok, UpdateConfig(), full=True)
    a, b = tok.encode(" x", add_special_tokens=False)[0], tok.encode(" y", add_special_tokens=False)[0]
    events, held = [], 0
    for i in range(n):
        completion_id = f"cmpl-gate-{i}"
        holdout = in_gate_holdout(completion_id, SHARE)
        held += holdout
        prompt = tok.encode(f"def f{i}(x):\n    return", add_special_tokens=False)
        token = a if i % 2 == 0 else b
        accepted = (token == a) if not holdout or held_out_accepts_a else (token == b)
        behaviour = scorer.sequence_logprobs([Sample(prompt, [token], None, 0.0)])[0]
        events.append(new_event(
            "Episode", completion_id=completion_id, project_id="acme", user_id="u", policy_version=0,
            prompt=tok.decode(prompt), prompt_token_ids=prompt, completion_text=tok.decode([token]),
            completion_token_ids=[token], behaviour_logprobs=behaviour, temperature=1.0, top_p=1.0,
            outcome="ACCEPTED" if accepted else "REJECTED", reward=0.75 if accepted else -0.25,
            reward_components={"acceptance": 0.75 if accepted else -0.25}, scorer="acceptance", matched=True))
    return events, held


def _gate_settings(settings, **over):
    return settings.model_copy(update={"promote_gate": "ope", "promote_gate_share": SHARE,
                                       "promote_gate_min_episodes": 10, "trainer_batch_size": 8,
                                       "trainer_save_every": 4, "trainer_full_finetune": True,
                                       "trainer_lr": 2e-2, "trainer_warmup_updates": 0, **over})


def _announced(settings, base):
    return [e.record for e in find_events(settings, WEIGHTS.name, lambda e: e.record["base_model"] == base)]


@pytest.mark.parametrize("held_out_accepts_a", [True, False])
def test_the_gate_lets_out_only_a_version_the_held_out_log_favours(setup, held_out_accepts_a):
    settings, topic, tok, base = setup
    settings = _gate_settings(settings)
    events, held = _episodes(tok, base, 72, held_out_accepts_a=held_out_accepts_a)
    assert 20 <= held <= 52
    produce(settings, topic, events)
    train_once(settings, topic, max_versions=1)
    [record] = _announced(settings, base)
    m = record["metrics"]
    # The held-out episodes were kept out of training and counted as such in the manifest. The gate judged on
    # those and on any the head feed brought beyond the trainer's read position (trainer/head_feed.py).
    from policy.weight_store import WeightStore

    manifest = WeightStore(settings.effective_weight_store, base).manifest(1)
    assert 10 <= manifest.episodes_dropped["gate_holdout"] <= m["ope_held_out"] <= held
    assert manifest.episodes_trained == 32
    assert m["ope_serving_version"] == 0.0 and m["ope_episodes"] == m["ope_held_out"]
    assert m["ope_serving_reward_mean"] == pytest.approx(0.25, abs=0.1)  # half A, half B
    assert m["ope_reward_mean_dr_low"] <= m["ope_reward_mean_dr"] <= m["ope_reward_mean_dr_high"]
    if held_out_accepts_a:  # the users the version was not trained on agree with it
        assert m["ope_reward_mean_dr_low"] > m["ope_serving_reward_mean"], m
        assert (record["status"], m["ope_gate_passed"]) == ("PROMOTED", 1.0)
    else:  # they reject what it learnt to show more
        assert m["ope_reward_mean_dr"] < m["ope_serving_reward_mean"], m
        assert (record["status"], m["ope_gate_passed"]) == ("CANDIDATE", 0.0)


def test_too_few_held_out_episodes_hold_the_version_and_its_canary_back(setup):
    settings, topic, tok, base = setup
    settings = _gate_settings(settings, promote_gate_min_episodes=1000, canary_share=0.5)
    events, held = _episodes(tok, base, 72, held_out_accepts_a=True)
    produce(settings, topic, events)
    train_once(settings, topic, max_versions=1)
    [record] = _announced(settings, base)
    assert record["status"] == "CANDIDATE"
    assert "canary_share" not in record["metrics"], "a version the gate refused must not be served to anyone"
    assert record["metrics"]["ope_gate_passed"] == 0.0 and "ope_episodes" not in record["metrics"]
    assert 10 <= record["metrics"]["ope_held_out"] <= held


def test_in_shadow_the_verdict_is_published_and_nothing_is_held_back(setup):
    settings, topic, tok, base = setup
    settings = _gate_settings(settings, promote_gate="shadow")
    events, _ = _episodes(tok, base, 72, held_out_accepts_a=False)
    produce(settings, topic, events)
    train_once(settings, topic, max_versions=1)
    [record] = _announced(settings, base)
    m = record["metrics"]
    assert (record["status"], m["ope_gate_passed"]) == ("PROMOTED", 0.0), "shadow must not hold a version back"
    assert m["ope_reward_mean_dr"] < m["ope_serving_reward_mean"]


def test_the_gates_pool_is_fed_from_the_head_of_the_topic(setup):
    """Real broker: held-out episodes reach the gate's pool although the trainer's own consumer has not read them
    (a trainer behind the traffic would otherwise judge the next version without the serving version's newest
    episodes: right after a canary promotes it, it has none). Episodes already kept are not kept twice."""
    from tests.system_helpers import wait
    from trainer.head_feed import HeadFeed
    from trainer.online import OnlineTrainer

    settings, topic, tok, base = setup
    settings = _gate_settings(settings)
    trainer = OnlineTrainer(settings, topic=topic)
    trainer.head_feed = HeadFeed(settings, topic, trainer.group_id)
    try:
        trainer._read_head_feed()  # no canary: the gate on, so it reads from the head
        events, held = _episodes(tok, base, 12, held_out_accepts_a=True)
        produce(settings, topic, events)

        def kept() -> bool:
            trainer._read_head_feed()
            return len(trainer.gate_episodes) >= held

        wait(kept, 60, f"{held} held-out episodes in the gate's pool", poll_s=0.1)
        held_out = [e.record for e in events if in_gate_holdout(e.record["completion_id"], SHARE)]
        assert sorted(ep["completion_id"] for ep in trainer.gate_episodes) == sorted(
            r["completion_id"] for r in held_out)
        assert trainer.progress.consumed == 0, "the trainer's own consumer read them"
        assert not trainer.gate_episodes.add(held_out[0])  # as when the trainer's consumer brings it later
    finally:
        trainer.head_feed.close()
        trainer.close()
