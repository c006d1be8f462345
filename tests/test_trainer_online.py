"""The online trainer on the real broker: versions, manifests, offsets, staleness, restarts, SIGKILL."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import NewTopic

from infra.bus import EventProducer, admin_client, ensure_topics
from infra.settings import to_environ
from schemas.events import new_event
from schemas.topics import WEIGHTS
from tests.conftest import TEST_PARTITIONS, make_settings
from tests.serving_helpers import find_events
from tests.system_helpers import poll, wait
from policy.weight_store import WeightStore, version_event

pytestmark = pytest.mark.kafka


def episode(tok, i: int, project: str, policy_version: int | None = 0, accepted: bool = True):
    ids = tok.encode(f" x + {i}\n", add_special_tokens=False)
    return new_event("Episode", completion_id=f"cmpl-{project}-{i}", project_id=project, user_id="u",
                     policy_version=policy_version, prompt=f"def f{i}(x):\n    return", completion_text="",
                     completion_token_ids=ids, behaviour_logprobs=[-7.5] * len(ids),
                     outcome="ACCEPTED" if accepted else "REJECTED", reward=0.75 if accepted else -0.25,
                     reward_components={"acceptance": 0.75 if accepted else -0.25}, scorer="acceptance", matched=True)


@pytest.fixture
def setup(kafka, tiny_model, tmp_path):
    """A base model of its own (the weights topic is shared), an episode topic and group of its own."""
    base = str(tmp_path / "base")
    shutil.copytree(tiny_model, base)
    topic = f"test.episodes.{uuid.uuid4().hex[:8]}"
    settings = make_settings(tmp_path / "state", kafka_bootstrap=kafka.settings.kafka_bootstrap, model=base,
                             trainer_group=f"g-{uuid.uuid4().hex[:8]}", trainer_batch_size=4, trainer_save_every=1,
                             trainer_batch_wait_s=100, trainer_lora_rank=4, trainer_lr=1e-3,
                             trainer_max_staleness=1, trainer_device="cpu")
    ensure_topics(settings)
    admin = admin_client(settings)  # kept alive until the topic exists
    admin.create_topics([NewTopic(topic, TEST_PARTITIONS, 1)])[topic].result(30)
    from policy.models import load_model

    _, tok = load_model(base)
    return settings, topic, tok, base


def produce(settings, topic, events) -> None:
    with EventProducer(settings) as producer:
        for e in events:
            producer.publish(e, topic=topic)


def train_once(settings, topic, **run) -> None:
    """A trainer started, run (``OnlineTrainer.run``'s stopping rules) and closed: one process's life."""
    from trainer.online import OnlineTrainer

    trainer = OnlineTrainer(settings, topic=topic)
    try:
        trainer.run(**run)
    finally:
        trainer.close()


def end_offsets(settings, topic) -> dict[str, int]:
    c = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": "probe"})
    try:
        return {str(p): c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in range(TEST_PARTITIONS)}
    finally:
        c.close()


def committed(settings, topic) -> dict[str, int]:
    c = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": settings.trainer_group})
    try:
        tps = c.committed([TopicPartition(topic, p) for p in range(TEST_PARTITIONS)], timeout=10)
        return {str(tp.partition): tp.offset for tp in tps if tp.offset >= 0}
    finally:
        c.close()


def assert_exactly_once(manifests, topic_end: dict[str, int]) -> None:
    """Each version starts where its parent stopped; together they cover every offset of the topic once."""
    previous: dict[str, int] = {}
    total = 0
    for m in manifests:
        assert m.source_offsets_start == previous, f"version {m.version} does not start where {m.parent_version} ended"
        span = sum(m.source_offsets.get(p, 0) - m.source_offsets_start.get(p, 0) for p in topic_end)
        assert span == m.episodes_consumed, f"version {m.version}: offsets span {span}, consumed {m.episodes_consumed}"
        assert m.episodes_consumed == m.episodes_trained + sum(m.episodes_dropped.values())
        total += m.episodes_consumed
        assert m.episodes_consumed_total == total
        previous = m.source_offsets
    assert {p: o for p, o in previous.items() if o} == {p: o for p, o in topic_end.items() if o}
    assert total == sum(topic_end.values())


def test_versions_offsets_staleness_and_resume(setup):
    from trainer.online import OnlineTrainer

    settings, topic, tok, base = setup
    produce(settings, topic, [episode(tok, i, "acme", accepted=i % 3 != 0) for i in range(8)])
    trainer = OnlineTrainer(settings, topic=topic)
    try:
        assert trainer.version == 0
        trainer.run(max_versions=2)
    finally:
        trainer.close()
    store = WeightStore(settings.effective_weight_store, base)
    assert store.versions() == [1, 2]
    assert committed(settings, topic) == {p: o for p, o in store.manifest(2).source_offsets.items()}

    # Now at version 2 with max_staleness 1: episodes from version 0 are dropped and counted, version 2's trained.
    produce(settings, topic, [episode(tok, 100 + i, "acme", policy_version=0) for i in range(4)]
            + [episode(tok, 200 + i, "acme", policy_version=2, accepted=i % 2 == 0) for i in range(4)])
    trainer = OnlineTrainer(settings, topic=topic)  # a restart: resumes from version 2's adapter and offsets
    try:
        assert trainer.version == 2 and trainer.policy.kind == "LORA"
        trainer.run(max_versions=1)
    finally:
        trainer.close()
    m3 = store.manifest(3)
    assert m3.parent_version == 2 and m3.episodes_consumed == 8 and m3.episodes_trained == 4
    assert m3.episodes_dropped == {"stale": 4}
    assert_exactly_once(store.manifests(), end_offsets(settings, topic))
    for key in ("reward_mean", "accept_rate", "policy_loss", "approx_kl", "clip_fraction", "entropy", "grad_norm",
                "lr", "staleness_mean", "tokens_per_s", "update_seconds"):
        assert key in m3.metrics, key
    assert m3.metrics["baseline_count/acme"] == 12  # the baseline went on from the manifest, not from zero

    events = find_events(settings, WEIGHTS.name, lambda e: e.record["base_model"] == base, want=3)
    assert [(e.record["version"], e.record["status"]) for e in events] == [(1, "PROMOTED"), (2, "PROMOTED"),
                                                                            (3, "PROMOTED")]
    assert events[2].record["uri"] == m3.uri and events[2].record["sha256"] == m3.sha256
    assert events[2].record["source_offsets"] == m3.source_offsets
    log_dir = settings.trainer_dir
    assert (log_dir / "trainer.log").read_text().count("saved") == 3
    assert len((log_dir / "metrics.jsonl").read_text().splitlines()) == 3
    assert any((log_dir / "tensorboard").iterdir())


def test_episodes_that_are_all_dropped_are_committed_without_a_version(setup):
    """Nothing to train (here: episodes with no text at all), so no version: their offsets are committed
    anyway once the trainer is idle, and its group's lag says it is caught up."""
    from trainer.online import OnlineTrainer

    settings, topic, tok, base = setup
    empty = [new_event("Episode", completion_id=f"cmpl-empty-{i}", project_id="acme", user_id="u",
                       policy_version=0, prompt="def f(x):\n", completion_text="", completion_token_ids=[],
                       behaviour_logprobs=[], outcome="REJECTED", reward=-0.25,
                       reward_components={"acceptance": -0.25}, scorer="acceptance", matched=False)
             for i in range(5)]
    produce(settings, topic, empty)
    trainer = OnlineTrainer(settings, topic=topic)
    try:
        trainer.run(idle_exit_s=8)
        assert trainer.progress.dropped == {"empty": 5}
    finally:
        trainer.close()
    assert WeightStore(settings.effective_weight_store, base).versions() == []
    assert committed(settings, topic) == {p: o for p, o in end_offsets(settings, topic).items() if o}


def test_unannounced_version_is_published_on_restart(setup):
    """A crash after the manifest but before the WeightVersion: the next start announces it."""
    from trainer.online import OnlineTrainer

    settings, topic, tok, base = setup
    produce(settings, topic, [episode(tok, i, "acme") for i in range(4)])
    trainer = OnlineTrainer(settings, topic=topic)
    trainer._announce = lambda manifest, **_: None  # the process "dies" before publishing
    try:
        trainer.run(max_versions=1)
    finally:
        trainer.close()
    assert find_events(settings, WEIGHTS.name, lambda e: e.record["base_model"] == base, timeout_s=1) == []
    train_once(settings, topic, idle_exit_s=1)
    events = find_events(settings, WEIGHTS.name, lambda e: e.record["base_model"] == base)
    assert [(e.record["version"], e.record["status"]) for e in events] == [(1, "PROMOTED")]


def _trainer_with_a_canary(setup, min_episodes: int, **more_settings):
    """A trainer whose version 1 (one update on four of the base model's episodes) runs as a canary beside
    version 0 on half the traffic, decided after ``min_episodes`` of each; its settings beside it."""
    from trainer.online import OnlineTrainer

    settings, topic, tok, base = setup
    settings = settings.model_copy(update={"canary_share": 0.5, "canary_min_episodes": min_episodes,
                                           **more_settings})
    produce(settings, topic, [episode(tok, i, "acme") for i in range(4)])
    trainer = OnlineTrainer(settings, topic=topic)
    try:
        trainer.run(max_versions=1)
    except BaseException:
        trainer.close()
        raise
    return settings, trainer


def _decisions_on_version_1(settings, base) -> list[dict]:
    return [e.record for e in find_events(settings, WEIGHTS.name, lambda e: e.record["base_model"] == base
                                          and e.record["version"] == 1 and e.record["status"] != "CANDIDATE")]


def test_the_trainer_runs_its_own_canary_and_decides_it_once(setup):
    """In canary mode the trainer announces a version as a CANDIDATE beside the promoted one, tallies the
    episodes of both, and publishes the decision once: the weights topic it re-reads (its own CANDIDATE
    among them) does not bring the decided canary back."""
    _, topic, tok, base = setup
    settings, trainer = _trainer_with_a_canary(setup, min_episodes=2)
    try:
        announced = find_events(settings, WEIGHTS.name, lambda e: e.record["base_model"] == base)
        assert [(e.record["version"], e.record["status"]) for e in announced] == [(1, "CANDIDATE")]
        metrics = announced[0].record["metrics"]
        assert (metrics["canary_share"], metrics["baseline_version"]) == (0.5, 0.0)
        # Version 1 is rejected, the base model accepted: worse by more than the margin.
        produce(settings, topic, [episode(tok, 10 + i, "acme", policy_version=1, accepted=False) for i in range(2)]
                + [episode(tok, 20 + i, "acme", policy_version=0) for i in range(2)])
        trainer.run(idle_exit_s=3)
        ids = [r["event_id"] for r in trainer.weight_records]
        assert len(ids) == len(set(ids)), "a WeightVersion record kept twice"
    finally:
        trainer.close()
    decisions = _decisions_on_version_1(settings, base)
    assert [d["status"] for d in decisions] == ["ROLLED_BACK"]
    assert decisions[0]["metrics"]["canary_candidate_accept_rate"] == 0.0
    assert decisions[0]["metrics"]["canary_baseline_accept_rate"] == 1.0


@pytest.mark.kafka
@pytest.mark.parametrize("baseline_episodes, min_episodes, staleness", [(8, 2, None), (48, 4, 100)],
                         ids=["two-updates", "twelve-updates"])
def test_the_next_version_waits_for_the_running_canarys_decision(setup, baseline_episodes, min_episodes, staleness):
    """Real broker: a trainer that saves (every update) faster than its canary gathers episodes must not replace
    the canary undecided (then nothing would ever be promoted). Updates go on; the save waits for the decision,
    and the version saved then holds every update made meanwhile: two, and twelve (more than the old ten saves'
    worth)."""
    _, topic, tok, base = setup
    settings, trainer = _trainer_with_a_canary(
        setup, min_episodes, **({"trainer_max_staleness": staleness} if staleness else {}))
    store = WeightStore(settings.effective_weight_store, base)
    try:
        assert trainer.canaries[""].candidate == 1
        # Batches of the baseline's episodes only (four to an update): updates, no decision, no save.
        produce(settings, topic, [episode(tok, 100 + i, "acme") for i in range(baseline_episodes)])
        trainer.run(idle_exit_s=3)
        assert trainer.progress.updates == baseline_episodes // 4 and store.versions() == [1], store.versions()
        assert trainer.canaries[""].candidate == 1
        # The candidate's episodes decide it (as good as the baseline: promoted); the update after them saves.
        produce(settings, topic, [episode(tok, 1000 + i, "acme", policy_version=1) for i in range(4)])
        trainer.run(max_versions=1)
    finally:
        trainer.close()
    # Every update's episodes since version 1: the baseline's and the candidate's.
    assert store.versions() == [1, 2] and store.manifest(2).episodes_trained == baseline_episodes + 4
    records = _weight_records(settings, base, 3)
    assert [(r["version"], r["status"]) for r in records] == [(1, "CANDIDATE"), (1, "PROMOTED"), (2, "CANDIDATE")]
    _assert_every_canary_decided_before_the_next(records)


def test_a_canary_is_decided_from_the_head_of_the_topic_not_the_trainers_read_position(setup):
    """Real broker: the canary's episodes decide it although the trainer's own consumer has not read them (as when
    it trains slower than the traffic comes, or works through a backlog): its canary feed reads from the
    canary's start. An episode both readers bring counts once."""
    from trainer.head_feed import HeadFeed

    _, topic, tok, base = setup
    settings, trainer = _trainer_with_a_canary(setup, min_episodes=3)
    try:
        tally = trainer.canaries[""]
        # Episodes from before the canary started are not its: the feed seeks past them (or the tally drops them).
        produce(settings, topic, [episode(tok, 10 + i, "acme", policy_version=1) for i in range(3)]
                + [episode(tok, 20 + i, "acme", policy_version=0, accepted=i == 0) for i in range(3)])
        trainer.head_feed = HeadFeed(settings, topic, trainer.group_id)

        def decided() -> bool:
            trainer._read_head_feed()
            return "" not in trainer.canaries

        wait(decided, 60, "the canary decided from its feed", poll_s=0.1)
        assert trainer.progress.consumed == 0, "the trainer's own consumer read on"
        # The same episodes again, from the trainer's consumer: a tally counts a completion once.
        for i in range(3):
            tally.add(1, "ACCEPTED", tally.since_ms, completion_id=f"cmpl-acme-{10 + i}")
        assert tally.total == {1: 3, 0: 3}
    finally:
        if trainer.head_feed is not None:
            trainer.head_feed.close()
        trainer.close()
    decisions = _decisions_on_version_1(settings, base)
    assert [d["status"] for d in decisions] == ["PROMOTED"]  # 3 of 3 accepted against 1 of 3
    assert decisions[0]["metrics"]["canary_candidate_episodes"] == 3.0


def test_without_auto_promote_a_version_waits_as_a_candidate(setup):
    """``TABLOOP_AUTO_PROMOTE=false`` and no canary: the version is announced, and nothing serves it."""
    settings, topic, tok, base = setup
    settings = settings.model_copy(update={"auto_promote": False})
    produce(settings, topic, [episode(tok, i, "acme") for i in range(4)])
    train_once(settings, topic, max_versions=1)
    events = find_events(settings, WEIGHTS.name, lambda e: e.record["base_model"] == base)
    assert [(e.record["version"], e.record["status"]) for e in events] == [(1, "CANDIDATE")]
    assert "canary_share" not in events[0].record["metrics"]


def _spawn(settings, topic, log_path):
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **to_environ(settings),
           "PYTHONPATH": os.getcwd()}
    return subprocess.Popen([sys.executable, "-m", "tabloop.cli", "train", "--topic", topic], env=env,
                            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)


def _wait_for(path, text: str, count: int, proc, timeout_s: float = 120) -> None:
    def seen() -> bool:
        if path.exists() and path.read_text().count(text) >= count:
            return True
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}): {path.read_text()[-3000:]}")
        return False

    wait(seen, timeout_s, f"{count}x {text!r} in {path}", poll_s=0.02, explain=lambda: path.read_text()[-3000:])


@pytest.mark.drill  # about 110 s: three trainer processes start on two shared cores
def test_sigkill_between_and_during_updates(setup, tmp_path):
    """SIGKILL the trainer mid-update and between updates; across all versions each episode counts once."""
    settings, topic, tok, base = setup
    # Updates lost with a killed process are redone; no episode is too stale here.
    settings = settings.model_copy(update={"trainer_save_every": 2, "trainer_max_staleness": 100})
    produce(settings, topic, [episode(tok, i, f"p{i % 2}", accepted=i % 2 == 0) for i in range(64)])
    log_file = settings.trainer_dir / "trainer.log"
    out = tmp_path / "train-out.log"

    proc = _spawn(settings, topic, out)
    _wait_for(log_file, "update 3 started", 1, proc)
    proc.send_signal(signal.SIGKILL)  # during update 3 (version 1 is saved; update 3 is lost)
    proc.wait(10)

    proc = _spawn(settings, topic, out)
    _wait_for(log_file, "saved", 3, proc)
    _wait_for(log_file, "update", log_file.read_text().count("update") + 1, proc)  # a little after a save
    proc.send_signal(signal.SIGKILL)  # between updates, or just after a save
    proc.wait(10)

    proc = _spawn(settings, topic, out)
    try:
        store = WeightStore(settings.effective_weight_store, base)
        poll(store.manifests, lambda got: got and got[-1].episodes_consumed_total == 64, timeout_s=180)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    manifests = store.manifests()
    # 64 episodes in batches of 4, a version every 2 updates: 8 versions however often it was killed.
    assert [m.version for m in manifests] == list(range(1, 9)), [m.version for m in manifests]
    assert all(m.episodes_consumed == 8 and m.episodes_trained == 8 for m in manifests)
    assert_exactly_once(manifests, end_offsets(settings, topic))
    assert [m.parent_version for m in manifests] == list(range(0, 8))
    assert log_file.read_text().count("resuming at version") == 3
    events = find_events(settings, WEIGHTS.name, lambda e: e.record["base_model"] == base, want=8)
    assert sorted({e.record["version"] for e in events}) == list(range(1, 9))


def test_a_rollback_makes_the_trainer_go_on_from_the_promoted_version(setup):
    """After `weights rollback`, the next version builds on what serves, not on the rejected weights."""
    from trainer.online import OnlineTrainer
    from policy.weight_store import base_version_event

    settings, topic, tok, base = setup
    produce(settings, topic, [episode(tok, i, "acme") for i in range(4)])
    trainer = OnlineTrainer(settings, topic=topic)
    try:
        trainer.run(max_versions=1)
        store = WeightStore(settings.effective_weight_store, base)
        with EventProducer(settings) as producer:  # what `tabloop weights rollback` publishes
            producer.publish(version_event(store.manifest(1), "ROLLED_BACK"))
            producer.publish(base_version_event(base))
        produce(settings, topic, [episode(tok, 10 + i, "acme", policy_version=1) for i in range(4)])
        trainer.run(max_versions=1)
    finally:
        trainer.close()
    m2 = store.manifest(2)
    assert m2.parent_version == 0, "version 2 was trained on from the rolled-back version 1"
    assert m2.episodes_consumed == 4 and m2.episodes_trained == 4
    assert "training goes on from version 0" in (settings.trainer_dir / "trainer.log").read_text()
    assert_exactly_once(store.manifests(), end_offsets(settings, topic))


# -- an episode as a training sample (no broker needed) -----------------------------------


def _served_episode(tok, **over):
    fields = dict(completion_id="cmpl-s", project_id="p", user_id="u", policy_version=0, prompt="def f(x):\n    return",
                  completion_text=" x\n", completion_token_ids=[11, 12, 13], behaviour_logprobs=[-1.0, -2.0, -3.0],
                  outcome="ACCEPTED", reward=0.75, reward_components={"acceptance": 0.75}, scorer="acceptance",
                  matched=True)
    return new_event("Episode", **{**fields, **over}).record


def test_an_episode_is_trained_as_it_was_served(tiny_model):
    """The served prompt ids, the event's completion ids (never re-derived from the text), and the sampler."""
    from policy.models import load_model
    from trainer.online import episode_sample

    _, tok = load_model(tiny_model)
    served = tok.encode("# café", add_special_tokens=False)[:-1] + [5]  # ids a decode/encode would not give back
    assert tok.encode(tok.decode(served), add_special_tokens=False) != served
    ep = _served_episode(tok, prompt=tok.decode(served), prompt_token_ids=served, temperature=0.6, top_p=0.9)
    s = episode_sample(ep, tok, max_prompt_tokens=2048)
    assert s.prompt_ids == served
    assert s.completion_ids == [11, 12, 13] and s.behaviour_logprobs == [-1.0, -2.0, -3.0]
    assert (s.temperature, s.top_p) == (0.6, 0.9)
    # An episode written before the ids and the sampler were recorded: the prompt text re-encoded, T = 1, top-p 1.
    old = {k: v for k, v in _served_episode(tok).items() if k not in ("prompt_token_ids", "temperature", "top_p")}
    s = episode_sample(old, tok, max_prompt_tokens=2048)
    assert s.prompt_ids == tok.encode("def f(x):\n    return", add_special_tokens=False)
    assert (s.temperature, s.top_p) == (1.0, 1.0)


def test_greedy_episodes_are_dropped_and_counted_not_weighed(tiny_model):
    from policy.models import load_model
    from trainer.online import drop_reason

    _, tok = load_model(tiny_model)
    assert drop_reason(_served_episode(tok, temperature=1e-4), 0, 4) == "greedy"
    assert drop_reason(_served_episode(tok, temperature=0.01), 0, 4) is None  # older Continue's 0.01 is sampled
    # Feedback on a completion we never served has no sampler: trained on-policy from its text, not "greedy".
    assert drop_reason(_served_episode(tok, completion_token_ids=[], behaviour_logprobs=[], temperature=0.0), 0, 4) is None


def test_showing_nothing_is_an_action_the_trainer_trains(tiny_model):
    """An episode that showed nothing (end of text first, the ``ignored`` reward) is trained on its one token,
    not dropped as empty: it is how the policy learns when not to show a suggestion."""
    from policy.models import load_model
    from trainer.online import drop_reason, episode_sample

    _, tok = load_model(tiny_model)
    ep = _served_episode(tok, completion_text="", completion_token_ids=[tok.eos_token_id], behaviour_logprobs=[-0.7],
                         outcome="IGNORED", reward=0.0, reward_components={"acceptance": 0.0}, temperature=0.7)
    assert drop_reason(ep, 0, 4) is None
    s = episode_sample(ep, tok, max_prompt_tokens=2048)
    assert s.completion_ids == [tok.eos_token_id] and s.behaviour_logprobs == [-0.7] and s.temperature == 0.7


# -- the resume rule and the canary rule (issue 31) ---------------------------------------


def _adapter_equals(policy, store, version: int, tmp_path) -> bool:
    """Whether the policy's LoRA weights are exactly ``version``'s saved adapter."""
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(store.materialize(version, tmp_path / f"v{version}") / "adapter_model.safetensors"))
    live = get_peft_model_state_dict(policy.model)
    return saved.keys() == live.keys() and all(torch.equal(saved[k].cpu(), live[k].detach().cpu()) for k in saved)


def test_a_restart_resumes_from_the_version_serving_not_an_undecided_canary(setup, tmp_path):
    """Promote v1, put v2 on canary, stop the trainer, start it again while v2 is undecided, then roll v2 back:
    the restarted trainer starts from v1's weights (and says so), never from v2's, so the updates it makes
    before the rollback arrives are kept, and the next version descends from v1."""
    from trainer.online import OnlineTrainer

    settings, topic, tok, base = setup
    store = WeightStore(settings.effective_weight_store, base)
    # Accepts and rejects mixed: a batch of equal rewards has no advantage, and would leave the weights as they are.
    produce(settings, topic, [episode(tok, i, "acme", accepted=i % 2 == 0) for i in range(4)])
    train_once(settings, topic, max_versions=1)  # v1, PROMOTED
    canary = settings.model_copy(update={"canary_share": 0.5, "canary_min_episodes": 50})
    produce(canary, topic, [episode(tok, 10 + i, "acme", policy_version=1, accepted=i % 2 == 1) for i in range(4)])
    train_once(canary, topic, max_versions=1)  # v2, an undecided canary; the trainer stops ("killed")
    assert store.versions() == [1, 2]

    trainer = OnlineTrainer(canary, topic=topic)
    try:
        trainer.run(idle_exit_s=1)  # starts, reads the weights topic, nothing to train
        assert trainer.version == 1
        assert _adapter_equals(trainer.policy, store, 1, tmp_path), "resumed from other weights than v1's"
        assert not _adapter_equals(trainer.policy, store, 2, tmp_path)
        produce(canary, topic, [episode(tok, 20 + i, "acme", policy_version=1) for i in range(4)])
        trainer.run(idle_exit_s=3)  # one update on v1; the save waits for v2's decision
        assert trainer.progress.updates == 1 and store.versions() == [1, 2]
        with EventProducer(canary) as producer:  # `tabloop weights rollback` of the canary
            producer.publish(version_event(store.manifest(2), "ROLLED_BACK"))
        produce(canary, topic, [episode(tok, 30 + i, "acme", policy_version=1) for i in range(4)])
        trainer.run(max_versions=1)
    finally:
        trainer.close()
    m3 = store.manifest(3)
    assert m3.parent_version == 1
    assert m3.episodes_trained == 8 and "rolled_back" not in m3.episodes_dropped, m3.episodes_dropped
    text = (settings.trainer_dir / "trainer.log").read_text()
    assert "resuming at version 1, the version serving" in text, text[-2000:]


def _weight_records(settings, base, want: int):
    return [e.record for e in find_events(settings, WEIGHTS.name, lambda e: e.record["base_model"] == base,
                                          want=want)]


def _assert_every_canary_decided_before_the_next(records) -> None:
    """Every canary CANDIDATE is decided (PROMOTED, ROLLED_BACK, or withdrawn) before another version goes out."""
    running = None
    for r in records:
        if running is not None and r["version"] != running:
            raise AssertionError(f"version {r['version']} went out while version {running}'s canary was undecided")
        if r["status"] == "CANDIDATE" and r["metrics"].get("canary_share", 0) > 0:
            running = r["version"]
        elif r["version"] == running:
            running = None


def test_a_canary_without_traffic_is_withdrawn_with_its_reason_before_the_next_version(setup):
    """Slow traffic: nobody is served the canary, so it can never be decided. After canary_max_wait_s the trainer
    withdraws it (a WeightVersion saying so: a CANDIDATE with no canary share, canary_withdrawn and its counts),
    and only then does the next version go out; serving drops the canary at the withdrawal."""
    from serving.weights import next_plans
    from trainer.online import OnlineTrainer

    settings, topic, tok, base = setup
    settings = settings.model_copy(update={"canary_share": 0.5, "canary_min_episodes": 4, "canary_max_wait_s": 2.0})
    store = WeightStore(settings.effective_weight_store, base)
    produce(settings, topic, [episode(tok, i, "acme") for i in range(4)])
    trainer = OnlineTrainer(settings, topic=topic)
    try:
        trainer.run(max_versions=1)
        produce(settings, topic, [episode(tok, 100 + i, "acme") for i in range(4)])  # the baseline's only
        trainer.run(max_versions=1, idle_exit_s=20)
    finally:
        trainer.close()
    assert store.versions() == [1, 2] and store.manifest(2).parent_version == 1
    records = _weight_records(settings, base, 3)
    assert [(r["version"], r["status"]) for r in records] == [(1, "CANDIDATE"), (1, "CANDIDATE"), (2, "CANDIDATE")]
    withdrawn = records[1]["metrics"]
    assert withdrawn["canary_share"] == 0 and withdrawn["canary_withdrawn"] == 1.0
    assert withdrawn["canary_baseline_episodes"] == 4.0 and withdrawn["canary_candidate_episodes"] == 0.0
    assert withdrawn["canary_waited_s"] >= 2.0
    _assert_every_canary_decided_before_the_next(records)
    plans = {}
    for i, r in enumerate(records):
        plans = next_plans(plans, r, base)
        assert plans[""].candidate == (None if i == 1 else (r["version"], r["uri"], r["kind"]))
    assert "canary: version 1 withdrawn" in (settings.trainer_dir / "trainer.log").read_text()
