"""The trainer's second reader of the episodes topic: at the head, for the canaries and the promotion gate.

The trainer's consumer reads episodes as fast as it trains on them. When the
traffic outruns the updates (or the trainer works through a backlog), episodes
reach it minutes after they were joined. Two things must not wait that long:

- a running canary's decision (a share of users keeps getting an undecided
  version meanwhile);
- the gate's pool of held-out episodes of the serving version: right after a
  canary promotes a version, the next version is judged on that version's
  episodes, which the training consumer has not reached yet.

So this reader (a consumer of its own, with no group commits: it never moves
the trainer's offsets) seeks every partition to the start of the oldest running
canary and reads on from there, or, with no canary running, stays at the head.
A restart seeks again and recounts: a canary's tally is saved nowhere, and the
topic holds every episode it counted.

Both readers feed the same tallies and the same pool; each counts an episode
once (by completion id), whichever reader brings it first.
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import Consumer, KafkaException, TopicPartition

from infra.bus import first_offsets_at
from infra.settings import Settings

log = logging.getLogger("tabloop.trainer")

SEEK_SLACK_MS = 60_000
"""Seek this long before a canary's start: an episode's timestamp is its joined_at, set on the streams
worker's clock; the tally's own time filter does the exact cut."""
RETRY_S = 10.0
"""After a failed seek (the broker down), try again this much later: the trainer's loop goes on meanwhile."""


class HeadFeed:
    """Reads the episodes topic from a given time on, or from the head."""

    def __init__(self, settings: Settings, topic: str, group_id: str):
        self.topic = topic
        self.covered_from_ms: int | None = None
        """Every episode joined from this time on has been or will be read (None: not reading)."""
        self.consumer = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": f"{group_id}-head",
                                  "enable.auto.commit": False, "log_level": 3})
        self._retry_at = 0.0

    def follow(self, since_ms: int | None, *, at_head: bool) -> None:
        """Make sure every episode joined from ``since_ms`` on is read (the oldest running canary's start);
        with None, read from the head on if ``at_head`` (the gate's pool), else stop reading.

        Seeking back re-reads what was read already (the readers' users ignore what they have). A start later
        than what is covered keeps the position: nothing is skipped or read twice for that.
        """
        if since_ms is None and not at_head:
            if self.covered_from_ms is not None:
                self.consumer.unassign()
                self.covered_from_ms = None
            return
        if self.covered_from_ms is not None and (since_ms is None or since_ms >= self.covered_from_ms):
            return
        if time.monotonic() < self._retry_at:
            return
        if since_ms is None:  # the head: what was joined from now on (by time, so nothing in flight is missed)
            since_ms = int(time.time() * 1000)
        try:
            starts = self._starts(since_ms)
        except KafkaException as exc:  # the position stays as it was; the canaries wait, nothing is lost
            log.warning("head feed: cannot seek %s (%s); trying again in %.0f s", self.topic, exc, RETRY_S)
            self._retry_at = time.monotonic() + RETRY_S
            return
        self.covered_from_ms = since_ms
        self.consumer.assign(starts)
        log.info("head feed: reading %s from %s", self.topic, {tp.partition: tp.offset for tp in starts})

    def _starts(self, since_ms: int) -> list[TopicPartition]:
        """Each partition's first offset at or after ``since_ms`` less the slack."""
        metadata = self.consumer.list_topics(self.topic, timeout=5).topics[self.topic]
        if metadata.error is not None:
            raise KafkaException(metadata.error)
        starts = first_offsets_at(self.consumer, self.topic, metadata.partitions, since_ms - SEEK_SLACK_MS, 5)
        return [TopicPartition(self.topic, p, offset) for p, offset in sorted(starts.items())]

    def poll(self, max_messages: int = 500) -> list:
        """What has arrived (no wait), while reading; the messages with errors left out."""
        if self.covered_from_ms is None:
            return []
        return [m for m in self.consumer.consume(max_messages, 0) if m.error() is None]

    def close(self) -> None:
        self.consumer.close()
