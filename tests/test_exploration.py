"""Exploit by default, explore on a budget (issue 41): what users are shown is the policy's greedy completion;
the seeded exploration coin makes a share of the requests exploration samples at the exploration temperature,
logged on CompletionServed, carried onto the Episode, and only those are importance-weighted by the trainer.

The front door runs for real (the tiny model, HTTP clients, the session's broker); the join is the streams
worker's own (``JoinPipeline`` over the events read back from Kafka); the trainer is ``OnlineTrainer`` on an
episode topic of its own."""

from __future__ import annotations

import hashlib
import shutil
import uuid

import httpx
import openai
import pytest

from infra.bus import EventProducer, admin_client, ensure_topics
from policy.exploration import GREEDY, Sampling, choose_sampling, explores, served_temperature, subject_to_coin
from schemas.topics import COMPLETIONS, FEEDBACK
from tests.conftest import make_settings
from tests.serving_helpers import find_events, start_door

PROMPT = "def total(values):\n    result = 0\n    for v in values:\n"


# -- the rule, by hand (no broker) ----------------------------------------------------------------------------


def test_the_coin_by_hand():
    # The coin is sha256("tabloop-explore/<seed>/<completion id>"): its first 8 bytes, as a fraction of 2^64,
    # below the share. Worked here for two ids and two seeds, from hashlib directly.
    def fraction(seed: int, cid: str) -> float:
        return int.from_bytes(hashlib.sha256(f"tabloop-explore/{seed}/{cid}".encode()).digest()[:8], "big") / 2 ** 64

    for cid in ("cmpl-a", "cmpl-b", "cmpl-0123"):
        for seed in (0, 7):
            u = fraction(seed, cid)
            assert explores(cid, 0.25, seed) == (u < 0.25)
            assert explores(cid, u + 1e-9, seed) and not explores(cid, u, seed)  # the boundary, both sides
    # 0 never explores, 1 always does, whatever the hash.
    assert not any(explores(f"c{i}", 0.0) for i in range(200))
    assert all(explores(f"c{i}", 1.0) for i in range(200))
    with pytest.raises(ValueError, match="share"):
        explores("c", 1.5)
    # Over many ids the share explores; another seed explores other ids; the promotion gate's held-out hash
    # (the bare id) is independent of it (a shared hash would hold out exactly the explored episodes).
    from trainer.promotion import in_gate_holdout

    ids = [f"cmpl-{i}" for i in range(4000)]
    picked = [explores(c, 0.25, 0) for c in ids]
    assert abs(sum(picked) / len(ids) - 0.25) < 0.03
    assert picked != [explores(c, 0.25, 1) for c in ids]
    held = [in_gate_holdout(c, 0.25) for c in ids]
    both = sum(p and h for p, h in zip(picked, held)) / len(ids)
    assert abs(both - 0.25 * 0.25) < 0.02


def test_the_temperature_rule_by_hand():
    rule = dict(exploration_temperature=0.7, min_temperature=0.1)
    # No temperature, or a near-greedy one (older Continue's 0.01, an explicit 0): greedy unless explored.
    for requested in (None, 0.0, 0.01, 0.099):
        assert subject_to_coin(requested, min_temperature=0.1)
        assert served_temperature(requested, False, **rule) == GREEDY == 0.0
        assert served_temperature(requested, True, **rule) == 0.7
    # A client asking for a real temperature keeps it, whatever the coin says: no coin is flipped.
    for requested in (0.1, 0.5, 1.3):
        assert not subject_to_coin(requested, min_temperature=0.1)
        assert served_temperature(requested, False, **rule) == served_temperature(requested, True, **rule) == requested
    # The operator's override serves everything at it, greedy included; no coin either.
    assert not subject_to_coin(None, min_temperature=0.1, override=0.0)
    assert served_temperature(None, True, **rule, override=0.0) == 0.0
    assert served_temperature(1.3, False, **rule, override=0.4) == 0.4

    cid = next(f"cmpl-{i}" for i in range(100) if explores(f"cmpl-{i}", 0.5, 3))
    other = next(f"cmpl-{i}" for i in range(100) if not explores(f"cmpl-{i}", 0.5, 3))
    full = dict(share=0.5, seed=3, **rule)
    assert choose_sampling(None, cid, **full) == Sampling(0.7, True, 0.5)
    assert choose_sampling(0.01, other, **full) == Sampling(0.0, False, 0.5)
    assert choose_sampling(0.9, cid, **full) == Sampling(0.9, False, None)  # the client's own: no coin
    assert choose_sampling(None, cid, **full, override=0.2) == Sampling(0.2, False, None)


def test_the_settings_and_what_the_door_serves_users_at(tmp_path):
    from infra.settings import SettingsError, load_settings
    from serving.completions import request_sampling, sampling_temperature

    settings = make_settings(tmp_path)
    assert (settings.exploration_share, settings.exploration_seed, settings.default_temperature,
            settings.min_temperature) == (0.1, 0, 0.7, 0.1)
    # What users get by default (the coin saying exploit): greedy for none or near-greedy, else their own.
    assert sampling_temperature(None, settings) == 0.0 and sampling_temperature(0.01, settings) == 0.0
    assert sampling_temperature(0.5, settings) == 0.5
    assert sampling_temperature(0.5, make_settings(tmp_path, exploration_temperature=0.0)) == 0.0
    cid = next(f"c{i}" for i in range(200) if explores(f"c{i}", 0.1, 0))
    assert request_sampling(None, cid, settings) == Sampling(0.7, True, 0.1)
    # From the environment, the old exploration temperature variable included; the share is checked.
    env = load_settings(environ={"TABLOOP_EXPLORATION_SHARE": "0.25", "TABLOOP_EXPLORATION_SEED": "7",
                                 "TABLOOP_DEFAULT_TEMPERATURE": "0.5"}, state_dir=str(tmp_path))
    assert (env.exploration_share, env.exploration_seed, env.default_temperature) == (0.25, 7, 0.5)
    for bad in ("-0.1", "1.01"):
        with pytest.raises(SettingsError, match="exploration_share|EXPLORATION_SHARE"):
            load_settings(environ={"TABLOOP_EXPLORATION_SHARE": bad}, state_dir=str(tmp_path))


def test_the_show_gate_reads_a_greedy_episodes_logprobs_at_the_exploration_temperature():
    """A greedy episode's behaviour logprobs are 0 (a point mass); its gate figures are made of the logprobs
    at the exploration temperature the door scored it on, the same scale as an explored episode's."""
    from policy.show_gate import line_features
    from schemas.events import new_event
    from trainer.show_gate_learner import decided_from_episode

    fields = dict(completion_id="c", project_id="p", user_id="u", policy_version=0, prompt="x = ",
                  completion_text="foo()", completion_token_ids=[1, 2, 3], outcome="ACCEPTED", reward=0.75,
                  reward_components={"acceptance": 0.75}, scorer="acceptance", matched=True)
    greedy = new_event("Episode", **fields, behaviour_logprobs=[0.0, 0.0, 0.0], temperature=0.0,
                       exploration_share=0.1, gate_logprobs=[-0.5, -1.0, -0.25]).record
    assert decided_from_episode(greedy).features == tuple(line_features("foo()", [-0.5, -1.0, -0.25]))
    explored = new_event("Episode", **fields, behaviour_logprobs=[-0.5, -1.0, -0.25], temperature=0.7,
                         explored=True, exploration_share=0.1).record
    assert decided_from_episode(explored).features == decided_from_episode(greedy).features
    old = new_event("Episode", **fields, behaviour_logprobs=[-0.1, -0.2, -0.3], temperature=0.7).record
    assert decided_from_episode(old).features == tuple(line_features("foo()", [-0.1, -0.2, -0.3]))


# -- the real front door, the join and the trainer ------------------------------------------------------------


def ask(server, temperature=None, *, http: bool = True) -> str:
    """One completion of ``PROMPT`` (sent one at a time: no batch row shares its step), its completion id."""
    if http:
        body = {"prompt": PROMPT, "max_tokens": 6, "stream": True}
        if temperature is not None:
            body["temperature"] = temperature
        resp = httpx.post(f"{server.completions_url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.headers["x-tabloop-completion-id"]
    client = openai.OpenAI(base_url=f"{server.completions_url}/v1", api_key="none", max_retries=0)
    extra = {} if temperature is None else {"temperature": temperature}
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, **extra).id


def served_events(settings, ids: list[str]) -> dict[str, dict]:
    found = find_events(settings, COMPLETIONS.name, lambda e: e.record["completion_id"] in ids, want=len(ids))
    assert len(found) == len(ids)
    return {e.record["completion_id"]: e.record for e in found}


def joined(settings, completions: dict[str, dict], feedback_ids: set[str]) -> dict[str, "object"]:
    """The join's own pipeline over the events the door put on Kafka, in the order the worker would see them:
    completion id → its Episode event."""
    from streams.join import JoinPipeline

    feedbacks = find_events(settings, FEEDBACK.name, lambda e: e.event_id in feedback_ids, want=len(feedback_ids))
    assert len(feedbacks) == len(feedback_ids)
    pipe = JoinPipeline()
    episodes = []
    for c in sorted(completions.values(), key=lambda r: r["served_at"]):
        episodes += pipe.completion(c)
    for f in sorted(feedbacks, key=lambda e: e.record["received_at"]):
        episodes += pipe.feedback(f.record)
    return {e.record["completion_id"]: e for e in episodes}


@pytest.mark.kafka
def test_a_seeded_share_explores_exactly_the_requests_its_coin_names_and_the_episodes_carry_it(
        kafka, tiny_model, tmp_path):
    """Share 0.25, seed 7: the requests with no or a near-greedy temperature that the coin names are sampled
    at the exploration temperature and logged explored; the rest are greedy (point-mass logprobs 0, the
    argmax: every greedy completion of the same prompt is the same), their gate figures the logprobs at the
    exploration temperature. A client's own temperature is served as asked, with no coin. The fields reach
    the Episode through the join; the trainer then trains the sampled episodes and drops the greedy ones."""
    # The show-gate on (no gate published yet: everything is shown): greedy lines then carry its figures.
    server = start_door(kafka, tiny_model, tmp_path / "door", exploration_share=0.25, exploration_seed=7,
                        show_gate=True)
    try:
        asked: dict[str, float | None] = {}
        for i in range(80):  # until both branches have 3 requests (a greedy one is ~3 of 4)
            temperature = (None, 0.01, 0.0)[i % 3]
            asked[ask(server, temperature, http=i % 2 == 0)] = temperature
            named = [explores(c, 0.25, 7) for c in asked]
            if sum(named) >= 3 and len(named) - sum(named) >= 3:
                break
        own = ask(server, 1.0)  # the client's own temperature
        events = served_events(server.settings, [*asked, own])

        explored_ids = {c for c in asked if explores(c, 0.25, 7)}
        assert 3 <= len(explored_ids) <= len(asked) - 3
        greedy_tokens = set()
        for cid, requested in asked.items():
            r = events[cid]
            assert r["requested_temperature"] == requested and r["exploration_share"] == 0.25
            assert len(r["completion_logprobs"]) == len(r["completion_token_ids"]) >= 1
            if cid in explored_ids:
                assert r["explored"] is True and r["temperature"] == 0.7, cid
                # Drawn from the distribution at 0.7 (2,000 tokens: no token has probability 1 there); its
                # behaviour logprobs are the gate's figures, so none are stored apart.
                assert all(lp < 0 for lp in r["completion_logprobs"]) and r["completion_gate_logprobs"] == []
            else:
                assert r["explored"] is False and r["temperature"] == 0.0, cid
                assert r["completion_logprobs"] == [0.0] * len(r["completion_token_ids"])  # a point mass
                gate = r["completion_gate_logprobs"]
                assert len(gate) == len(r["completion_token_ids"]) and all(lp < 0 for lp in gate)
                greedy_tokens.add(tuple(r["completion_token_ids"]))
        assert len(greedy_tokens) == 1  # the argmax: the same completion for the same prompt, every time
        r = events[own]
        assert (r["temperature"], r["requested_temperature"], r["explored"], r["exploration_share"]) == \
            (1.0, 1.0, False, None)

        # Feedback on every completion, through the door's feedback route; the join makes the episodes.
        feedback_ids = set()
        for n, cid in enumerate([*asked, own]):
            resp = httpx.post(f"{server.feedback_url}/v1/feedback", json={"completion_id": cid, "accepted": n % 2 == 0},
                              timeout=30)
            assert resp.status_code == 202, resp.text
            feedback_ids.add(resp.json()["event_id"])
        episodes = joined(server.settings, events, feedback_ids)
        assert set(episodes) == {*asked, own}
        for cid, served in events.items():
            ep = episodes[cid].record
            assert (ep["explored"], ep["exploration_share"], ep["temperature"]) == \
                (served["explored"], served["exploration_share"], served["temperature"]), cid
            assert ep["behaviour_logprobs"] == served["completion_logprobs"][:len(ep["completion_token_ids"])]
            assert ep["gate_logprobs"] == served["completion_gate_logprobs"][:len(ep["completion_token_ids"])]
    finally:
        server.stop()

    # The trainer: the explored episodes and the client's sampled one are trained, weighed against their
    # behaviour logprobs; the greedy ones are dropped as point masses and counted. Were a greedy episode
    # weighed as a sample, it would be trained (or fail as "invalid") and these counts would differ.
    sampled = [episodes[c] for c in [*explored_ids, own]]
    greedy = [episodes[c] for c in asked if c not in explored_ids]
    manifest = train_one_version(kafka, tiny_model, tmp_path / "trainer", greedy + sampled, batch=len(sampled))
    assert (manifest.episodes_consumed, manifest.episodes_trained) == (len(greedy) + len(sampled), len(sampled))
    assert manifest.episodes_dropped == {"greedy": len(greedy)}


def train_one_version(kafka, tiny_model, tmp_path, episodes: list, *, batch: int):
    """``OnlineTrainer`` on a one-partition topic of its own holding ``episodes`` in order, until it saved one
    version of ``batch`` trained episodes: that version's manifest."""
    from confluent_kafka.admin import NewTopic

    from trainer.online import OnlineTrainer
    from policy.weight_store import WeightStore

    base = str(tmp_path / "base")  # a base of its own: the weights topic is the session's
    shutil.copytree(tiny_model, base)
    topic = f"test.episodes.{uuid.uuid4().hex[:8]}"
    settings = make_settings(tmp_path / "state", kafka_bootstrap=kafka.settings.kafka_bootstrap, model=base,
                             trainer_group=f"g-{uuid.uuid4().hex[:8]}", trainer_batch_size=batch, trainer_save_every=1,
                             trainer_batch_wait_s=100, trainer_lora_rank=4, trainer_device="cpu")
    ensure_topics(settings)
    admin = admin_client(settings)
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    with EventProducer(settings) as producer:
        for e in episodes:
            producer.publish(e, topic=topic)
    trainer = OnlineTrainer(settings, topic=topic)
    try:
        trainer.run(max_versions=1)
    finally:
        trainer.close()
    store = WeightStore(settings.effective_weight_store, base)
    return store.manifest(store.versions()[-1])


@pytest.mark.kafka
@pytest.mark.parametrize("share", [0.0, 1.0], ids=["share0", "share1"])
def test_share_0_serves_everyone_greedily_and_share_1_samples_every_request(kafka, tiny_model, tmp_path, share):
    server = start_door(kafka, tiny_model, tmp_path, exploration_share=share)
    try:
        ids = [ask(server, (None, 0.01)[i % 2]) for i in range(6)]
        events = served_events(server.settings, ids)
    finally:
        server.stop()
    for r in events.values():
        assert (r["explored"], r["exploration_share"]) == (share == 1.0, share)
        if share == 1.0:
            assert r["temperature"] == 0.7 and all(lp < 0 for lp in r["completion_logprobs"])
        else:
            assert r["temperature"] == 0.0 and set(r["completion_logprobs"]) == {0.0}
        # The show-gate is off here (the tests' default): no second distribution was asked of the engine.
        assert r["completion_gate_logprobs"] == []
    if share == 0.0:  # greedy: one completion of the prompt, whichever request asked
        assert len({tuple(r["completion_token_ids"]) for r in events.values()}) == 1
