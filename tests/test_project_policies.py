"""A policy per project: the engine serves each project its own LoRA version, batched with the others."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from serving.engines.base import GenerationRequest
from tests.test_trainer_online import setup  # noqa: F401  (a fixture)
from policy.models import CachedDecoder, load_model

PROMPT = "def mean(values):\n"


def make_adapter(base_dir: str, out_dir, seed: int) -> str:
    """A LoRA adapter with random (non-zero) weights: a version that decodes differently from the base."""
    from peft import LoraConfig, get_peft_model

    from policy.models import lora_target_modules

    torch.manual_seed(seed)
    model, _ = load_model(base_dir)
    config = LoraConfig(r=4, lora_alpha=32, target_modules=lora_target_modules(model), init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out_dir)
    return f"file://{out_dir}"


@pytest.fixture(scope="module")
def versions(tiny_llama, tmp_path_factory) -> dict[int, str]:
    root = tmp_path_factory.mktemp("project-versions")
    return {v: make_adapter(tiny_llama, root / f"v{v}", seed=v) for v in (1, 2, 3)}


def served(engine, project: str, *, seed: int = 7, tokens: int = 8) -> tuple[list[int], list[float], set[int]]:
    async def run():
        ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
        request = GenerationRequest(ids, tokens, 1.0, 1.0, seed=seed, project_id=project)
        return [s async for s in engine.stream(request)]

    steps = asyncio.run(run())
    return [s.token_id for s in steps], [s.logprob for s in steps], {s.policy_version for s in steps}


def test_rows_of_different_adapters_merge_and_keep_their_own_logits(tiny_llama, versions):
    from peft import PeftModel

    model, tokenizer = load_model(tiny_llama)
    peft = PeftModel.from_pretrained(model, versions[1].removeprefix("file://"), adapter_name="v1")
    peft.load_adapter(versions[2].removeprefix("file://"), adapter_name="v2")
    peft.eval()
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in (PROMPT, "import os\nimport sys\n")]
    with torch.inference_mode():
        alone = {}
        for name, prompt in (("v1", prompts[0]), ("v2", prompts[1]), ("__base__", prompts[1])):
            d = CachedDecoder.for_prompts(peft, [prompt], pad_id=0, adapters=[name])
            d.step(torch.tensor([5]))
            alone[name] = d.logits[0]
        mixed = CachedDecoder.for_prompts(peft, [prompts[0]], pad_id=0, adapters=["v1"])
        other = CachedDecoder.for_prompts(peft, [prompts[1], prompts[1]], pad_id=0, adapters=["v2", "__base__"])
        assert mixed.can_merge(other)
        assert not mixed.can_merge(CachedDecoder.for_prompts(model, [prompts[0]], pad_id=0))  # plain rows
        mixed.merge(other)
        mixed.step(torch.tensor([5, 5, 5]))
    assert mixed.adapters == ["v1", "v2", "__base__"]
    for row, name in enumerate(["v1", "v2", "__base__"]):
        torch.testing.assert_close(mixed.logits[row], alone[name], atol=1e-4, rtol=1e-4)
    assert (alone["v2"] - alone["__base__"]).abs().max() > 1e-3  # the adapter does change the logits


def test_each_project_gets_its_version_and_the_others_the_shared_one(tiny_llama, versions):
    from serving.engines.transformers_engine import TransformersEngine

    reference = TransformersEngine(tiny_llama)
    expected = {0: served(reference, "")[:2]}
    for v in (1, 2):
        asyncio.run(reference.load_version(v, versions[v], "LORA"))
        expected[v] = served(reference, "")[:2]
    assert expected[1] != expected[0] and expected[2] != expected[1]

    engine = TransformersEngine(tiny_llama)
    asyncio.run(engine.load_version(1, versions[1], "LORA", project="alpha"))
    asyncio.run(engine.load_version(2, versions[2], "LORA", project="beta"))
    assert engine.served_versions() == {"": (0, None), "alpha": (1, None), "beta": (2, None)}
    assert engine.loaded_adapters() == ["v1", "v2"]

    async def together():  # three projects in flight at once: one batch, three adapters
        ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)

        async def one(project):
            return [s async for s in engine.stream(GenerationRequest(ids, 8, 1.0, 1.0, seed=7, project_id=project))]
        return await asyncio.gather(one("alpha"), one("beta"), one("gamma"))

    for project, steps, version in zip(("alpha", "beta", "gamma"), asyncio.run(together()), (1, 2, 0)):
        assert {s.policy_version for s in steps} == {version}, project
        assert [s.token_id for s in steps] == expected[version][0], project
        assert [s.logprob for s in steps] == pytest.approx(expected[version][1], abs=1e-4), project

    # The shared policy moves on; projects with their own version keep it.
    asyncio.run(engine.load_version(3, versions[3], "LORA"))
    assert engine.served_versions() == {"": (3, None), "alpha": (1, None), "beta": (2, None)}
    assert served(engine, "gamma")[2] == {3}
    assert served(engine, "alpha")[2] == {1}


def test_a_projects_canary_promotion_and_drop(tiny_llama, versions):
    from serving.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(tiny_llama)
    asyncio.run(engine.load_version(1, versions[1], "LORA", project="alpha"))
    asyncio.run(engine.load_candidate(2, versions[2], "LORA", 0.5, project="alpha"))
    assert engine.candidate_version is None  # the shared policy has no canary
    seen = set().union(*(served(engine, "alpha", seed=i, tokens=2)[2] for i in range(30)))
    assert seen == {1, 2}
    assert set().union(*(served(engine, "gamma", seed=i, tokens=2)[2] for i in range(10))) == {0}

    asyncio.run(engine.promote_candidate(project="alpha"))
    assert engine.served_versions()["alpha"] == (2, None)
    assert set().union(*(served(engine, "alpha", seed=i, tokens=2)[2] for i in range(10))) == {2}
    assert engine.loaded_adapters() == ["v2"]  # v1 is no longer served: unloaded

    asyncio.run(engine.drop_project("alpha"))
    assert served(engine, "alpha")[2] == {0}
    assert engine.loaded_adapters() == []
    with pytest.raises(ValueError, match="shared policy cannot be dropped"):
        asyncio.run(engine.drop_project(""))

    # A canary for a project with no version of its own: its other requests take the shared policy.
    asyncio.run(engine.load_candidate(3, versions[3], "LORA", 0.5, project="beta"))
    assert set().union(*(served(engine, "beta", seed=i, tokens=2)[2] for i in range(30))) == {0, 3}
    asyncio.run(engine.drop_candidate(project="beta"))
    assert "beta" not in engine.served_versions()


def test_past_max_adapters_the_least_recently_used_project_is_unloaded_and_comes_back(tiny_llama, versions):
    from serving.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(tiny_llama, max_adapters=2)
    asyncio.run(engine.load_version(1, versions[1], "LORA", project="alpha"))
    asyncio.run(engine.load_version(2, versions[2], "LORA", project="beta"))
    served(engine, "beta", tokens=1)
    served(engine, "alpha", tokens=1)  # beta is now the least recently used
    asyncio.run(engine.load_version(3, versions[3], "LORA", project="gamma"))
    assert engine.loaded_adapters() == ["v1", "v3"]
    assert set(engine.served_versions()) == {"", "alpha", "gamma"}

    # beta's next request loads beta's version again in the background; until it is in, the shared policy
    # serves beta (that request may already see it: a reload staged in its batch window is applied first).
    assert served(engine, "beta")[2] <= {0, 2}
    deadline = time.monotonic() + 30
    while engine.served_versions().get("beta") != (2, None):
        assert time.monotonic() < deadline, engine.served_versions()
        time.sleep(0.05)
    assert served(engine, "beta")[2] == {2}
    # Room for it was made by unloading gamma, never requested since it was loaded.
    assert engine.loaded_adapters() == ["v1", "v2"]
    assert set(engine.served_versions()) == {"", "alpha", "beta"}


@pytest.mark.kafka
def test_front_door_routes_projects_and_the_weights_commands_act_per_project(kafka, tiny_llama, versions, tmp_path):
    """Real broker, real front door: `tabloop weights promote/rollback` of a project's versions change what
    that project is served, and nobody else's."""
    import shutil
    from pathlib import Path

    import httpx
    from click.testing import CliRunner

    from infra.bus import ensure_topics
    from infra.settings import to_environ
    from schemas.topics import COMPLETIONS
    from infra.auth import KeyStore
    from tabloop.cli import main
    from tests.conftest import make_settings
    from tests.serving_helpers import ThreadServer, find_events
    from tests.system_helpers import wait
    from policy.weight_store import WeightStore

    base = str(tmp_path / "base")
    shutil.copytree(tiny_llama, base)  # a base model of its own: the weights topic outlives this test
    settings = make_settings(tmp_path / "state", kafka_bootstrap=kafka.settings.kafka_bootstrap, model=base,
                             completions_port=0, feedback_port=0)
    ensure_topics(settings)
    store = WeightStore(settings.effective_weight_store, base)
    for version, project in ((1, ""), (2, "alpha"), (3, "alpha")):
        store.save(version, Path(versions[version].removeprefix("file://")),
                   dict(parent_version=0, kind="LORA", trainer_step=version, episodes_consumed=0, episodes_trained=0,
                        episodes_dropped={}, source_topic="t", source_offsets_start={}, source_offsets={},
                        project_id=project))
    keys = {p: KeyStore(settings.keys_file).add(p, "dev") for p in ("alpha", "beta")}
    env = dict(to_environ(settings))

    def cli(*args):
        return CliRunner().invoke(main, ["weights", *args], env=env, catch_exceptions=False)

    server = ThreadServer(settings)
    try:
        def version_for(project: str) -> int:
            r = httpx.post(f"{server.completions_url}/v1/completions", timeout=30,
                           headers={"Authorization": f"Bearer {keys[project]}"},
                           json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0.7})
            assert r.status_code == 200, r.text
            return int(r.headers["x-tabloop-policy-version"])

        def until(expected: dict[str, int]) -> None:
            wait(lambda: {p: version_for(p) for p in expected} == expected, 60, f"versions {expected}",
                 explain=lambda: str({p: version_for(p) for p in expected}))

        assert cli("promote", "1").output.strip().endswith("promoted for the shared policy")
        out = cli("promote", "2")
        assert out.exit_code == 0 and "promoted for project alpha" in out.output
        until({"alpha": 2, "beta": 1})
        assert cli("promote", "3").exit_code == 0
        until({"alpha": 3, "beta": 1})
        table = cli("list").output.splitlines()
        starred = {line.split()[1] for line in table if line.startswith("*")}
        assert starred == {"1", "3"}, table  # the shared policy's and alpha's own

        out = cli("rollback", "--project", "alpha", "1")
        assert out.exit_code == 1 and "version 1 is the shared policy's, not project alpha's" in out.output
        out = cli("rollback", "--project", "alpha")
        assert out.exit_code == 0 and "serving goes to version 2" in out.output
        until({"alpha": 2, "beta": 1})
        out = cli("rollback", "--project", "alpha")
        assert out.exit_code == 0 and "serving goes to the shared policy" in out.output
        until({"alpha": 1, "beta": 1})
        out = cli("rollback", "--project", "alpha")
        assert out.exit_code == 1 and "nothing to roll back" in out.output
        # The shared policy's rollback is still its own: alpha, with no version of its own, follows it.
        assert cli("rollback").exit_code == 0
        until({"alpha": 0, "beta": 0})
        completion_id = httpx.post(f"{server.completions_url}/v1/completions", timeout=30,
                                   headers={"Authorization": f"Bearer {keys['alpha']}"},
                                   json={"prompt": PROMPT, "max_tokens": 2}).headers["x-tabloop-completion-id"]
    finally:
        server.stop()
    event = find_events(settings, COMPLETIONS.name, lambda e: e.record["completion_id"] == completion_id)[0]
    assert event.record["project_id"] == "alpha" and event.record["policy_version"] == 0


@pytest.mark.kafka
def test_the_trainer_trains_an_opted_in_projects_own_adapter_and_resumes_it(setup):
    """Real broker: alpha (opted in, 4 episodes needed) gets a version of its own, beta only trains the shared
    policy; the shared manifest names alpha's version; a restart goes on from it; staleness counts the shared
    policy's versions; a project version from an unfinished save point is never announced, and is removed."""
    from safetensors.torch import load_file

    from schemas.topics import WEIGHTS
    from tests.serving_helpers import find_events
    from tests.test_trainer_online import assert_exactly_once, end_offsets, episode, produce
    from trainer.online import OnlineTrainer
    from policy.weight_store import WeightStore

    settings, topic, tok, base = setup
    settings = settings.model_copy(update={"project_policies": "alpha", "project_min_episodes": 4})
    store = WeightStore(settings.effective_weight_store, base)

    def train(**run) -> OnlineTrainer:
        trainer = OnlineTrainer(settings, topic=topic)
        try:
            trainer.run(**run)
        finally:
            trainer.close()
        return trainer

    produce(settings, topic, [episode(tok, i, p) for i, p in enumerate(["alpha", "beta", "alpha", "beta"])])
    assert not train(max_versions=1).projects  # alpha has 2 of its 4 episodes: the shared policy only
    produce(settings, topic, [episode(tok, 10 + i, "alpha", policy_version=1, accepted=i % 2 == 0) for i in range(4)])
    trainer = train(max_versions=1)
    assert {p: own.version for p, own in trainer.projects.items()} == {"alpha": 2}
    alpha, shared = store.manifest(2), store.manifest(3)
    assert (alpha.project_id, alpha.parent_version, alpha.episodes_trained, alpha.kind) == ("alpha", 1, 4, "LORA")
    assert shared.project_id == "" and shared.parent_version == 1 and shared.episodes_trained == 4
    assert shared.metrics["project_version/alpha"] == 2 and shared.metrics["project_episodes/alpha"] == 6
    assert not any("beta" in key for key in shared.metrics if key.startswith("project_"))
    v1 = load_file(f"{store.version_dir(1)}/adapter_model.safetensors")
    v2 = load_file(f"{store.version_dir(2)}/adapter_model.safetensors")
    assert v1.keys() == v2.keys() and any(not torch.equal(v1[k], v2[k]) for k in v1)  # it started from 1, trained

    # Restart: alpha goes on from its version 2. Staleness counts the shared policy's versions only (alpha's 2
    # does not): at version 3, beta's episodes of version 1 are one version old, alpha's of version 0 two (stale
    # at max_staleness 1). One update after all six are read (the batch waits 3 s), so all are judged at 3.
    settings = settings.model_copy(update={"trainer_batch_size": 100, "trainer_batch_wait_s": 3})
    produce(settings, topic, [episode(tok, 20 + i, "alpha", policy_version=2) for i in range(2)]
            + [episode(tok, 30 + i, "alpha", policy_version=0) for i in range(2)]
            + [episode(tok, 40 + i, "beta", policy_version=1) for i in range(2)])
    trainer = OnlineTrainer(settings, topic=topic)
    try:
        assert trainer.version == 3 and trainer.projects["alpha"].version == 2
        trainer.run(max_versions=1)
    finally:
        trainer.close()
    manifests = store.manifests()
    assert [(m.version, m.project_id) for m in manifests] == [(1, ""), (2, "alpha"), (3, ""), (4, "alpha"), (5, "")]
    own, shared = store.manifest(4), store.manifest(5)
    assert own.parent_version == 2 and own.episodes_trained == 2
    assert shared.episodes_trained == 4 and shared.episodes_dropped == {"stale": 2}
    assert shared.metrics["project_version/alpha"] == 4
    assert_exactly_once([m for m in manifests if not m.project_id], end_offsets(settings, topic))

    events = [e.record for e in find_events(settings, WEIGHTS.name, lambda e: e.record["base_model"] == base,
                                            want=len(manifests))]
    assert [(r["version"], r["project_id"], r["status"]) for r in events] == [
        (m.version, m.project_id, "PROMOTED") for m in manifests]

    # A project version written after the newest shared manifest (a crash between the two): never announced,
    # and a restart goes on from the version the shared manifest names.
    from pathlib import Path

    orphan = store.save(store.next_version(), Path(store.version_dir(4)), dict(
        parent_version=4, kind="LORA", trainer_step=99, episodes_consumed=0, episodes_trained=0,
        episodes_dropped={}, source_topic=topic, source_offsets_start={}, source_offsets={}, project_id="alpha"))
    trainer = train(idle_exit_s=2)
    assert trainer.projects["alpha"].version == 4
    later = [e.record for e in find_events(settings, WEIGHTS.name, lambda e: e.record["base_model"] == base,
                                           want=len(manifests))]
    assert orphan.version not in {r["version"] for r in later}
    # ... and it is removed at that start: the next version takes its number (the versions stay 1..N).
    assert orphan.version not in store.versions() and store.next_version() == orphan.version


@pytest.mark.kafka
def test_a_projects_canary_is_judged_on_that_projects_episodes_only(setup):
    """Real broker: in canary mode alpha's own version and the shared one each go out as a canary; alpha's is
    decided on alpha's episodes alone (beta's accepts of the same baseline version would have rolled it back)."""
    from schemas.topics import WEIGHTS
    from tests.serving_helpers import find_events
    from tests.test_trainer_online import episode, produce
    from trainer.online import OnlineTrainer

    settings, topic, tok, base = setup
    settings = settings.model_copy(update={"project_policies": "alpha", "project_min_episodes": 2,
                                           "canary_share": 0.5, "canary_min_episodes": 2})
    produce(settings, topic, [episode(tok, i, "alpha") for i in range(4)])
    trainer = OnlineTrainer(settings, topic=topic)
    try:
        trainer.run(max_versions=1)
        announced = [e.record for e in find_events(settings, WEIGHTS.name, lambda e: e.record["base_model"] == base,
                                                   want=2)]
        assert [(r["version"], r["project_id"], r["status"]) for r in announced] == [
            (1, "alpha", "CANDIDATE"), (2, "", "CANDIDATE")]
        assert {p: t.candidate for p, t in trainer.canaries.items()} == {"alpha": 1, "": 2}
        # alpha: its version 1 half accepted, the base model (its baseline) rejected. beta accepts the base model.
        produce(settings, topic, [episode(tok, 10, "alpha", policy_version=1, accepted=True),
                                  episode(tok, 11, "alpha", policy_version=1, accepted=False)]
                + [episode(tok, 20 + i, "alpha", policy_version=0, accepted=False) for i in range(2)]
                + [episode(tok, 30 + i, "beta", policy_version=0, accepted=True) for i in range(4)]
                + [episode(tok, 40 + i, "beta", policy_version=2, accepted=True) for i in range(2)])
        # No update while they come in: a new version would replace both canaries before their decisions.
        trainer.settings = trainer.settings.model_copy(update={"trainer_batch_size": 100})
        trainer.run(idle_exit_s=3)
    finally:
        trainer.close()
    decided = {r["version"]: r for r in (e.record for e in find_events(
        settings, WEIGHTS.name, lambda e: e.record["base_model"] == base and e.record["status"] != "CANDIDATE",
        want=2))}
    alpha = decided[1]
    assert (alpha["project_id"], alpha["status"]) == ("alpha", "PROMOTED")
    assert alpha["metrics"]["canary_baseline_episodes"] == 2.0  # alpha's two, not beta's four
    assert (alpha["metrics"]["canary_candidate_accept_rate"], alpha["metrics"]["canary_baseline_accept_rate"]) == (0.5, 0.0)
    assert decided[2]["project_id"] == ""  # the shared canary is decided on its own


@pytest.mark.kafka
def test_a_projects_rolled_back_version_is_not_trained_on(setup):
    """Real broker: `tabloop weights rollback --project alpha` rolls back alpha's only version. The trainer,
    restarted, does not go on from those weights: alpha's policy starts again from the shared policy's serving
    version, so alpha's next version descends from it (parent 2), not from the rolled-back 1. The shared policy
    goes on as it was."""
    from click.testing import CliRunner

    from infra.settings import to_environ
    from tabloop.cli import main
    from tests.test_trainer_online import episode, produce, train_once
    from trainer.online import OnlineTrainer
    from policy.weight_store import WeightStore

    settings, topic, tok, base = setup
    settings = settings.model_copy(update={"project_policies": "alpha", "project_min_episodes": 2})
    store = WeightStore(settings.effective_weight_store, base)
    produce(settings, topic, [episode(tok, i, "alpha") for i in range(4)])
    train_once(settings, topic, max_versions=1)
    assert [(m.version, m.project_id, m.parent_version) for m in store.manifests()] == [(1, "alpha", 0), (2, "", 0)]

    out = CliRunner().invoke(main, ["weights", "rollback", "--project", "alpha"], env=dict(to_environ(settings)),
                             catch_exceptions=False)
    assert out.exit_code == 0 and "serving goes to the shared policy" in out.output, out.output
    produce(settings, topic, [episode(tok, 10 + i, "alpha", policy_version=2) for i in range(4)])
    trainer = OnlineTrainer(settings, topic=topic)
    try:
        assert trainer.projects["alpha"].version == 1  # what the shared manifest named at the save
        trainer.run(max_versions=1)
        assert trainer.project_serving == {"alpha": 3} and trainer.serving_version == 4  # the new ones, promoted
    finally:
        trainer.close()
    assert [(m.version, m.project_id, m.parent_version) for m in store.manifests()][2:] == [(3, "alpha", 2), (4, "", 2)]
    assert store.manifest(4).metrics["project_version/alpha"] == 3
