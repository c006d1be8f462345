"""Weight pickup: follow ``tabloop.weights`` and hot-load the promoted version into the engine.

Every replica reads the whole (compacted) topic without a consumer group, so
each one sees every decision. The rule: serve the newest PROMOTED version of
our base model; if the version being served is ROLLED_BACK with nothing
promoted after it, go back to the base model (version 0). A version that
fails to load is logged and skipped; the replica keeps serving what it has.

Canary: a CANDIDATE whose metrics hold ``canary_share`` > 0 is served next to
the promoted version for that share of requests, until a PROMOTED (it takes
over, without a reload) or ROLLED_BACK (it is dropped) event for it arrives.
``next_plan`` is the whole rule, as a pure function.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from infra.bus import decode_message, make_codec
from infra.settings import Settings
from schemas.topics import WEIGHTS
from serving.engines.base import Engine

log = logging.getLogger("tabloop.weights")


def target_version(current: tuple[int, str, str], event: dict, base_model: str) -> tuple[int, str, str] | None:
    """Pure rule: given what is served (version, uri, kind) and a WeightVersion record, what to serve next."""
    if event["base_model"] != base_model:
        return None
    version, status = event["version"], event["status"]
    if status == "PROMOTED" and version != current[0]:
        return version, event["uri"], event["kind"]
    if status == "ROLLED_BACK" and version == current[0] and version != 0:
        return 0, "", "FULL"
    return None


Served = tuple[int, str, str]  # (version, uri, kind)
BASE: Served = (0, "", "FULL")


@dataclass(frozen=True)
class ServingPlan:
    promoted: Served = BASE
    candidate: Served | None = None
    share: float = 0.0


def next_plan(plan: ServingPlan, event: dict, base_model: str) -> ServingPlan:
    """Pure rule: what to serve after a WeightVersion record (the promoted version and an optional canary)."""
    if event["base_model"] != base_model:
        return plan
    version, status = event["version"], event["status"]
    candidate = plan.candidate
    if status == "CANDIDATE":
        share = float((event.get("metrics") or {}).get("canary_share", 0.0))
        if share > 0 and version != plan.promoted[0]:
            return replace(plan, candidate=(version, event["uri"], event["kind"]), share=share)
        return plan
    if candidate is not None and candidate[0] == version:  # the canary is decided either way
        plan = replace(plan, candidate=None, share=0.0)
    promoted = target_version(plan.promoted, event, base_model)
    return replace(plan, promoted=promoted) if promoted is not None else plan


class WeightWatcher:
    def __init__(self, settings: Settings, engine: Engine):
        self.settings = settings
        self.engine = engine
        self.codec = make_codec(settings)
        self.failures = 0
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._follow(), name="tabloop-weights")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            await asyncio.wait([self._task], timeout=5)

    async def _follow(self) -> None:
        consumer = Consumer({"bootstrap.servers": self.settings.kafka_bootstrap, "group.id": "tabloop-weights",
                             "enable.auto.commit": False, "log_level": 3})
        consumer.assign([TopicPartition(WEIGHTS.name, 0, OFFSET_BEGINNING)])
        current = ServingPlan(promoted=(self.engine.policy_version, "", "FULL"))
        try:
            while not self._stopping:
                messages = await asyncio.to_thread(consumer.consume, 500, 0.5)
                # Fold the whole batch first: catching up on history loads one version, not each.
                wanted = current
                for m in messages:
                    if m.error() is not None:
                        continue  # e.g. the topic is not created yet: keep polling
                    received = decode_message(self.codec, m)
                    if received.event is None:
                        log.error("undecodable weight event at offset %d: %s", m.offset(), received.error)
                        continue
                    wanted = next_plan(wanted, received.event.record, self.engine.model_name)
                if wanted != current:
                    current = await self._apply(current, wanted)
        finally:
            await asyncio.to_thread(consumer.close)

    async def _apply(self, current: ServingPlan, wanted: ServingPlan) -> ServingPlan:
        """Make the engine serve ``wanted``; returns what it serves now (a failed load keeps the old)."""
        if wanted.promoted != current.promoted:
            try:
                if current.candidate is not None and wanted.promoted[0] == current.candidate[0]:
                    await self.engine.promote_candidate()
                    log.info("serving policy version %d (the canary, promoted)", wanted.promoted[0])
                    current = replace(current, promoted=current.candidate, candidate=None, share=0.0)
                else:
                    version, uri, kind = wanted.promoted
                    await self.engine.load_version(version, await self._local(uri), kind)
                    log.info("serving policy version %d", version)
                    current = replace(current, promoted=wanted.promoted)
            except Exception:
                self.failures += 1
                log.exception("could not load policy version %d from %s", wanted.promoted[0], wanted.promoted[1])
        if wanted.candidate != current.candidate or wanted.share != current.share:
            try:
                if wanted.candidate is None:
                    if self.engine.candidate_version is not None:
                        await self.engine.drop_candidate()
                    log.info("canary ended: serving policy version %d only", current.promoted[0])
                else:
                    version, uri, kind = wanted.candidate
                    await self.engine.load_candidate(version, await self._local(uri), kind, wanted.share)
                    log.info("canary: policy version %d serves %.0f%% of requests", version, 100 * wanted.share)
                current = replace(current, candidate=wanted.candidate, share=wanted.share)
            except NotImplementedError as exc:
                log.warning("%s: version %s is not served as a canary", exc, wanted.candidate)
                current = replace(current, candidate=wanted.candidate, share=wanted.share)
            except Exception:
                self.failures += 1
                log.exception("could not load canary version %s", wanted.candidate)
        return current

    async def _local(self, uri: str) -> str:
        """A local path for ``uri``: weight stores at fsspec URIs are fetched into the cache first."""
        if not uri or "://" not in uri or uri.startswith("file://"):
            return uri
        from trainer.weight_store import local_path_of

        cache = self.settings.state_dir / "weights-cache"
        cache.mkdir(parents=True, exist_ok=True)
        return str(await asyncio.to_thread(local_path_of, uri, cache))
