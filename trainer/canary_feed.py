"""The canaries' own reader of the episodes topic: it counts from the head, not from where the trainer trains.

The trainer's consumer reads episodes as fast as it trains on them. When the
traffic outruns the updates (or the trainer works through a backlog), the
episodes of a running canary reach it minutes after they were joined, and the
decision waits that long while a share of users keeps getting an undecided
version. So each running canary is also fed by this reader: a consumer of its
own (no group commits; it never moves the trainer's offsets) that seeks every
partition to the time the oldest running canary started and reads on from
there. A restart seeks again and recounts: a canary's tally is not saved
anywhere, and the topic holds every episode it counted.

Both readers feed the same tallies; a tally counts each completion once
(``CanaryTally.add``), so it does not matter which of them gets there first.
"""

from __future__ import annotations

import logging

from confluent_kafka import OFFSET_END, Consumer, TopicPartition

from infra.settings import Settings

log = logging.getLogger("tabloop.trainer")

SEEK_SLACK_MS = 60_000
"""Seek this long before the canary's start: an episode's timestamp is its joined_at, set on the streams
worker's clock; the tally's own time filter does the exact cut."""


class CanaryFeed:
    """Reads the episodes topic from ``since_ms`` on, for as long as some canary runs."""

    def __init__(self, settings: Settings, topic: str, group_id: str):
        self.topic = topic
        self.since_ms: int | None = None
        self.consumer = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": f"{group_id}-canary",
                                  "enable.auto.commit": False, "enable.partition.eof": False, "log_level": 3})

    def follow(self, since_ms: int | None) -> None:
        """Read from ``since_ms`` (the oldest running canary's start), or stop reading (None).

        Seeking back re-reads what was read already; the tallies ignore what they counted. Moving the start
        later (the oldest canary was decided) keeps the position: nothing is read twice for that.
        """
        if since_ms == self.since_ms or (since_ms is not None and self.since_ms is not None
                                         and since_ms > self.since_ms):
            self.since_ms = since_ms if since_ms is not None else self.since_ms
            return
        self.since_ms = since_ms
        if since_ms is None:
            self.consumer.unassign()
            return
        metadata = self.consumer.list_topics(self.topic, timeout=10)
        partitions = sorted(metadata.topics[self.topic].partitions)
        wanted = [TopicPartition(self.topic, p, max(0, since_ms - SEEK_SLACK_MS)) for p in partitions]
        found = self.consumer.offsets_for_times(wanted, timeout=10)
        # -1: no episode that late yet in that partition, so read what comes next.
        starts = [TopicPartition(self.topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_END)
                  for tp in found]
        self.consumer.assign(starts)
        log.info("canary feed: reading %s from %s", self.topic, {tp.partition: tp.offset for tp in starts})

    def poll(self, max_messages: int = 500) -> list:
        """What has arrived (no wait), while following; the messages with errors left out."""
        if self.since_ms is None:
            return []
        return [m for m in self.consumer.consume(max_messages, 0) if m.error() is None]

    def close(self) -> None:
        self.consumer.close()
