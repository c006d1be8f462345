"""Serving's side of weight versions: the plan rule, canary routing in the engine, the rollback target."""

from __future__ import annotations

import asyncio

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
    from trainer.models import build_tiny_model

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
