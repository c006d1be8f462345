"""The topic catalog: every Kafka topic tabloop uses, in one place.

The event topics are the event log of the whole system: every other store
(Faust tables, ClickHouse, the trainer's state) is derived from them and can be
rebuilt by replaying them, so they keep data forever. ``tabloop.weights`` holds
one live record per weight version and is compacted; ``tabloop.gates`` the same per show-gate version.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

MAX_MESSAGE_BYTES = 1_048_576
"""The largest record batch a tabloop topic takes (Kafka's ``max.message.bytes``), set on every topic so a
broker's own default does not decide. Producers keep each message well under it (infra/bus.py), and the
front door refuses a request whose event would not fit (serving/publisher.py), so no event it
acknowledged can be refused here."""
_SIZE = {"max.message.bytes": str(MAX_MESSAGE_BYTES)}
KEEP_FOREVER = {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1", **_SIZE}
COMPACTED = {"cleanup.policy": "compact", "min.compaction.lag.ms": "60000", **_SIZE}


@dataclass(frozen=True)
class Topic:
    name: str
    event_type: str
    """Name of the Avro record every message on this topic carries."""
    configs: dict[str, str] = field(default_factory=dict)
    partitions: int | None = None
    """Fixed partition count, or None for the configured default."""


COMPLETIONS = Topic("tabloop.completions", "CompletionServed", KEEP_FOREVER)
FEEDBACK = Topic("tabloop.feedback", "FeedbackReceived", KEEP_FOREVER)
EPISODES = Topic("tabloop.episodes", "Episode", KEEP_FOREVER)
# One partition: weight versions must be read in the order they were published.
WEIGHTS = Topic("tabloop.weights", "WeightVersion", COMPACTED, partitions=1)
DEADLETTER = Topic("tabloop.deadletter", "DeadLetter", KEEP_FOREVER, partitions=1)
# One partition, as the weights: a replica folds gate versions in the order they were published.
GATES = Topic("tabloop.gates", "GateVersion", COMPACTED, partitions=1)

CATALOG: tuple[Topic, ...] = (COMPLETIONS, FEEDBACK, EPISODES, WEIGHTS, DEADLETTER, GATES)
TOPIC_BY_NAME = {t.name: t for t in CATALOG}


def home_partition(key: bytes, partitions: int) -> int:
    """The partition a keyed record lands on: librdkafka's ``consistent_random`` partitioner (CRC-32 of the
    key), which every tabloop producer names (``infra.bus``). The streams worker checks input against it and
    moves a record found elsewhere (another producer's partitioner, events keyed before issue 32)."""
    return zlib.crc32(key) % partitions


TICK_KEY = b"__tick__"
"""The key of the streams worker's clock ticks on its own (internal) topics: time, not data (lag probes skip
them)."""
TOPIC_FOR_EVENT = {t.event_type: t for t in CATALOG}


def topic_named(name: str) -> Topic:
    try:
        return TOPIC_BY_NAME[name]
    except KeyError:
        known = ", ".join(TOPIC_BY_NAME)
        raise ValueError(f"unknown topic {name!r}; the catalog has: {known}") from None
