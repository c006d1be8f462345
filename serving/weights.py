"""Weight pickup: follow ``tabloop.weights`` and hot-load the promoted version into the engine.

Every replica reads the whole (compacted) topic without a consumer group, so
each one sees every decision. The rule: serve the newest PROMOTED version of
our base model; if the version being served is ROLLED_BACK with nothing
promoted after it, go back to the base model (version 0). A version that
fails to load is logged and skipped; the replica keeps serving what it has.
"""

from __future__ import annotations

import asyncio
import logging

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
        current = (self.engine.policy_version, "", "FULL")
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
                    wanted = target_version(wanted, received.event.record, self.engine.model_name) or wanted
                if wanted == current:
                    continue
                try:
                    await self.engine.load_version(*wanted)
                    current = wanted
                    log.info("serving policy version %d", wanted[0])
                except Exception:
                    self.failures += 1
                    log.exception("could not load policy version %d from %s", wanted[0], wanted[1])
        finally:
            await asyncio.to_thread(consumer.close)
