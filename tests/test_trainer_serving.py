"""Serving's side of weight versions: the plan rule, canary routing in the engine, the rollback target."""

from __future__ import annotations

import asyncio

import pytest

from serving.engines.base import GenerationRequest
from serving.weights import BASE, ServingPlan, next_plan
from trainer.cli import rollback_target


def rec(version: int, status: str, share: float = 0.0, base: str = "m") -> dict:
    return {"base_model": base, "version": version, "status": status, "uri": f"/w/{version}", "kind": "LORA",
            "metrics": {"canary_share": share} if share else {}}


def test_next_plan_canary_lifecycle():
    plan = next_plan(ServingPlan(), rec(1, "PROMOTED"), "m")
    assert plan == ServingPlan(promoted=(1, "/w/1", "LORA"))
    assert next_plan(plan, rec(2, "CANDIDATE"), "m") == plan  # no share: not served
    assert next_plan(plan, rec(2, "CANDIDATE", 0.3, base="other"), "m") == plan
    canary = next_plan(plan, rec(2, "CANDIDATE", 0.3), "m")
    assert canary.candidate == (2, "/w/2", "LORA") and canary.share == 0.3 and canary.promoted == plan.promoted
    promoted = next_plan(canary, rec(2, "PROMOTED"), "m")
    assert promoted == ServingPlan(promoted=(2, "/w/2", "LORA"))
    rolled = next_plan(canary, rec(2, "ROLLED_BACK"), "m")
    assert rolled == plan  # the canary dropped, version 1 untouched
    # Rolling back the promoted version goes to the base; an explicit PROMOTED 0 does the same.
    assert next_plan(plan, rec(1, "ROLLED_BACK"), "m").promoted == BASE
    assert next_plan(plan, {**rec(0, "PROMOTED"), "uri": "", "kind": "FULL"}, "m").promoted == BASE


def test_rollback_target():
    records = [rec(1, "PROMOTED"), rec(2, "PROMOTED"), rec(3, "PROMOTED")]
    assert rollback_target(records, "m", 3) == 2
    records.append(rec(2, "ROLLED_BACK"))
    assert rollback_target(records, "m", 3) == 1
    assert rollback_target([rec(1, "PROMOTED")], "m", 1) == 0
    assert rollback_target(records, "other", 3) == 0


def test_engine_routes_a_share_to_the_candidate_and_promotes_it(tiny_model, tmp_path):
    from serving.engines.transformers_engine import TransformersEngine
    from policy.models import build_tiny_model

    other = str(build_tiny_model(tmp_path / "v7", seed=7))
    engine = TransformersEngine(tiny_model, max_batch=4)
    ids = engine.tokenizer.encode("def f(x):\n", add_special_tokens=False)

    async def versions(n: int) -> list[int]:
        async def one(i):
            async for step in engine.stream(GenerationRequest(ids, 2, 1.0, 1.0, seed=i)):
                return step.policy_version
        return list(await asyncio.gather(*(one(i) for i in range(n))))

    async def scenario():
        assert set(await versions(8)) == {0}
        await engine.load_candidate(7, other, "FULL", 0.5)
        assert engine.candidate_version == 7
        mixed = await versions(40)
        await engine.promote_candidate()
        after = await versions(8)
        await engine.load_candidate(7, other, "FULL", 0.5)
        await engine.drop_candidate()
        dropped = await versions(8)
        await engine.close()
        return mixed, after, dropped

    mixed, after, dropped = asyncio.run(scenario())
    assert 5 <= mixed.count(7) <= 35 and set(mixed) == {0, 7}, mixed
    assert set(after) == {7} and engine.policy_version == 7
    assert set(dropped) == {7} and engine.candidate_version is None


@pytest.mark.kafka
def test_weights_commands(kafka, tiny_model, tmp_path):
    """`tabloop weights list|promote|rollback` against the real broker and a weight store with two versions."""
    import json
    import shutil

    from click.testing import CliRunner

    from infra.bus import ensure_topics
    from tabloop.cli import main
    from infra.settings import to_environ
    from tests.conftest import make_settings
    from policy.weight_store import WeightStore, promoted_version, read_weight_records

    base = str(tmp_path / "base")
    shutil.copytree(tiny_model, base)
    settings = make_settings(tmp_path / "state", kafka_bootstrap=kafka.settings.kafka_bootstrap, model=base)
    ensure_topics(settings)
    env = {k: v for k, v in to_environ(settings).items()}
    store = WeightStore(settings.effective_weight_store, base)
    files = tmp_path / "files"
    files.mkdir()
    (files / "adapter_model.safetensors").write_bytes(b"w")
    for v in (1, 2):
        store.save(v, files, dict(parent_version=v - 1, kind="LORA", trainer_step=v, episodes_consumed=4,
                                  episodes_trained=4, episodes_dropped={}, source_topic="t", source_offsets_start={},
                                  source_offsets={"0": 4 * v}, episodes_consumed_total=4 * v, metrics={}))
    runner = CliRunner()

    def run(*args):
        return runner.invoke(main, list(args), env=env, catch_exceptions=False)

    out = run("weights", "rollback")
    assert out.exit_code == 1 and "nothing to roll back" in out.output
    assert run("weights", "promote", "9").exit_code == 1
    assert run("weights", "promote", "1").exit_code == 0
    assert run("weights", "promote", "2").exit_code == 0
    assert promoted_version(read_weight_records(settings), base) == 2
    rows = [json.loads(line) for line in run("weights", "list", "--json").output.splitlines()]
    assert [(r["version"], r["status"], r["serving"]) for r in rows] == [(0, "BASE", False), (1, "PROMOTED", False),
                                                                        (2, "PROMOTED", True)]
    out = run("weights", "rollback")
    assert out.exit_code == 0 and "version 2 of the shared policy rolled back; serving goes to version 1" in out.output
    assert promoted_version(read_weight_records(settings), base) == 1
    out = run("weights", "rollback", "0")
    assert out.exit_code == 0 and "serving goes to version 0" in out.output
    assert promoted_version(read_weight_records(settings), base) == 0
    table = run("weights", "list").output
    assert "ROLLED_BACK" in table and table.splitlines()[1].startswith("*")
