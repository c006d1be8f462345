"""Getting the front door's events onto Kafka without slowing requests and without losing any.

- ``submit(event)`` (completions): returns at once; a worker thread encodes
  and produces. Events Kafka refuses go to the spool.
- ``publish_durably(event)`` (feedback): returns only once Kafka acknowledged
  the event or the local spool fsync'd it, so a 202 is never a lie.
- While anything sits in the spool, new events queue behind it there (their
  order is kept); a replayer re-publishes spooled events when Kafka answers
  again, skipping any whose ``event_id`` already reached the topic (an event
  can land both ways when Kafka acknowledges late), so each is on its topic
  exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Iterable

from confluent_kafka import Consumer, KafkaError, TopicPartition

from infra.bus import (EVENT_ID_HEADER, EventProducer, PublishError, broker_answers, first_offsets_at,
                       watermark_offsets)
from infra.settings import Settings
from schemas.codec import Codec
from schemas.events import Event
from serving.spool import Spool, SpoolRecord

log = logging.getLogger("tabloop.publisher")
REPLAY_BATCH = 5000
SCAN_SLACK_MS = 60_000  # producers' clocks and event times vs. Kafka's timestamps
RECORD_FRAMING_BYTES = 64
"""What librdkafka adds to a message's key, value and headers when it checks message.max.bytes (at most
~40 bytes of varints and attributes in record format v2), rounded up."""


class EventTooLarge(ValueError):
    """An event bigger than Kafka takes as one message: refused before anything is acknowledged, since
    neither Kafka nor the spool's replay could ever deliver it."""

    def __init__(self, event: Event, size: int, limit: int):
        super().__init__(f"its {event.type} event would be {size} bytes, over the {limit}-byte limit of one "
                         f"message on {event.topic}")
        self.size, self.limit = size, limit


class EventPublisher:
    def __init__(self, settings: Settings, codec: Codec, *, spool: Spool | None = None,
                 producer_overrides: dict | None = None):
        self.settings = settings
        self.codec = codec
        self.spool = spool or Spool(settings.spool_dir)
        self.producer = EventProducer(settings, codec, client_id="tabloop-serving", overrides={
            # Fail over to the spool within seconds, not minutes, when Kafka is away.
            "delivery.timeout.ms": 10_000, "linger.ms": 2, "error_cb": self._on_client_error,
            **(producer_overrides or {})})
        self.published = 0
        self.spooled = 0
        self._kafka_ok = threading.Event()
        self._kafka_ok.set()
        self._queue: queue.SimpleQueue[Event | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._spool_order = threading.Lock()  # "is the spool empty?" and "send directly" as one step
        self._worker = threading.Thread(target=self._drain_submitted, name="tabloop-publish", daemon=True)
        self._replayer = threading.Thread(target=self._replay_loop, name="tabloop-replay", daemon=True)
        self._worker.start()
        self._replayer.start()

    # -- the two ways in --------------------------------------------------------

    def submit(self, event: Event) -> None:
        """Queue an event for Kafka; never blocks."""
        self._queue.put(event)

    def room(self, event: Event, value: bytes | None = None) -> int:
        """Bytes to spare before ``event`` (encoded: ``value``) is too large for one Kafka message; < 0: over."""
        value = self.codec.encode(event) if value is None else value
        size = len(value) + len(event.key.encode()) + len(EVENT_ID_HEADER) + len(event.event_id.encode())
        return self.producer.message_max_bytes - RECORD_FRAMING_BYTES - size

    def check_fits(self, event: Event, value: bytes | None = None) -> bytes:
        """The encoded event, or EventTooLarge when Kafka would refuse it."""
        value = self.codec.encode(event) if value is None else value
        room = self.room(event, value)
        if room < 0:
            limit = self.producer.message_max_bytes - RECORD_FRAMING_BYTES
            raise EventTooLarge(event, limit - room, limit)
        return value

    async def publish_durably(self, event: Event) -> str:
        """Return once the event is on Kafka (acks=all) or fsync'd in the spool; 'kafka' or 'spool'.

        Raises EventTooLarge, before storing anything, for an event no Kafka message could hold."""
        value = self.check_fits(event)
        loop = asyncio.get_running_loop()
        acked: asyncio.Future = loop.create_future()

        def on_delivery(error, _delivered):
            if error is not None:
                self._kafka_ok.clear()
            loop.call_soon_threadsafe(lambda: acked.done() or acked.set_result(error))

        if self._send_or_spool(event, value, on_delivery) == "spool":
            return "spool"
        try:
            error = await asyncio.wait_for(asyncio.shield(acked), self.settings.ack_timeout_s)
        except asyncio.TimeoutError:
            error = PublishError(f"no acknowledgement within {self.settings.ack_timeout_s}s")
        if error is None:
            self.published += 1
            return "kafka"
        log.warning("feedback %s goes to the spool: %s", event.event_id, error)
        self._kafka_ok.clear()
        await asyncio.to_thread(self._spool, event, value)
        return "spool"

    # -- internals ----------------------------------------------------------------

    def _send_or_spool(self, event: Event, value: bytes, on_delivery) -> str:
        with self._spool_order:
            if self._kafka_ok.is_set() and self.spool.depth() == 0:
                self.producer.send_encoded(event.topic, event.key.encode(), value, _timestamp_ms(event),
                                           what=f"{event.type} {event.event_id}", on_delivery=on_delivery,
                                           headers=[(EVENT_ID_HEADER, event.event_id.encode())])
                return "kafka"
            self._spool(event, value)
            return "spool"

    def _spool(self, event: Event, value: bytes) -> None:
        self.spool.append(event.topic, event.key.encode(), value, event.event_id, _timestamp_ms(event))
        self.spooled += 1

    def _drain_submitted(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                return
            try:
                value = self.check_fits(event)
            except EventTooLarge as exc:
                # The front door refuses requests whose event could not fit (FrontDoor.completions), so
                # this is a bug; spooling it would block the spool's replay forever.
                log.error("dropping %s %s: %s", event.type, event.event_id, exc)
                continue
            except Exception:
                log.exception("dropping an event that does not fit its schema: %s", event.type)
                continue

            def on_delivery(error, _delivered, event=event, value=value):
                if error is None:
                    self.published += 1
                    return
                self._kafka_ok.clear()
                log.warning("%s %s goes to the spool: %s", event.type, event.event_id, error)
                self._spool(event, value)

            try:
                self._send_or_spool(event, value, on_delivery)
            except Exception:
                log.exception("could not send or spool %s %s", event.type, event.event_id)

    def _on_client_error(self, err: KafkaError) -> None:
        if err.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT):
            self._kafka_ok.clear()

    def _replay_loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                if self.spool.depth() == 0:
                    if not self._kafka_ok.is_set() and broker_answers(self.settings, 2.0):
                        self._kafka_ok.set()
                    continue
                if broker_answers(self.settings, 2.0):
                    self.replay_spool()
            except Exception:
                log.exception("replaying the spool failed; will retry")

    def replay_spool(self) -> int:
        """Re-publish what the spool holds; returns how many records were acknowledged."""
        acked = 0
        while True:
            records = self.spool.pending(REPLAY_BATCH)
            if not records:
                with self._spool_order:  # nothing left: new events may go straight to Kafka again
                    if self.spool.depth() == 0:
                        self._kafka_ok.set()
                        return acked
                continue
            already = event_ids_on_kafka(self.settings, records)
            self.spool.ack([r.seq for r in records if r.event_id in already])
            acked += sum(1 for r in records if r.event_id in already)
            delivered: list[int] = []
            failed: list[BaseException] = []
            lock = threading.Lock()
            for r in records:
                if r.event_id in already:
                    continue

                def on_delivery(error, _d, seq=r.seq):
                    with lock:
                        (failed.append(error) if error is not None else delivered.append(seq))

                self.producer.send_encoded(r.topic, r.key, r.value, r.timestamp_ms, what=f"spooled {r.event_id}",
                                           on_delivery=on_delivery,
                                           headers=[(EVENT_ID_HEADER, r.event_id.encode())])
            try:
                self.producer.flush(30)
            except PublishError as exc:
                failed.append(exc)
            self.spool.ack(delivered)
            acked += len(delivered)
            self.published += len(delivered)
            if failed:
                log.warning("replay stopped after %d events: %s", acked, failed[0])
                return acked

    def depth(self) -> int:
        return self.spool.depth()

    def kafka_ok(self) -> bool:
        return self._kafka_ok.is_set()

    def close(self, timeout_s: float = 10.0) -> None:
        self._queue.put(None)
        self._worker.join(timeout_s)
        self._stop.set()
        self._replayer.join(timeout_s)
        try:
            self.producer.close(timeout_s)
        except PublishError as exc:  # their callbacks spooled them
            log.warning("closing: %s", exc)
        self.spool.close()


def _timestamp_ms(event: Event) -> int:
    when = event.record.get(event.event_type.time_field)
    return int(when.timestamp() * 1000) if hasattr(when, "timestamp") else int(time.time() * 1000)


def event_ids_on_kafka(settings: Settings, records: Iterable[SpoolRecord]) -> set[str]:
    """The event ids (from message headers) on the records' topics since the oldest record's time."""
    records = list(records)
    if not records:
        return set()
    since = min(r.timestamp_ms for r in records) - SCAN_SLACK_MS
    found: set[str] = set()
    consumer = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": "tabloop-spool-scan",
                         "enable.auto.commit": False, "enable.partition.eof": True})
    try:
        for topic in {r.topic for r in records}:
            meta = consumer.list_topics(topic, timeout=10).topics[topic]
            starts = first_offsets_at(consumer, topic, meta.partitions, since)
            assignment, remaining = [], set()
            for partition, start in starts.items():
                _, high = watermark_offsets(consumer, TopicPartition(topic, partition))
                if start < high:
                    assignment.append(TopicPartition(topic, partition, start))
                    remaining.add(partition)
            if not assignment:
                continue
            consumer.assign(assignment)
            while remaining:
                for m in consumer.consume(1000, 5.0):
                    if m.error() is not None:
                        if m.error().code() == KafkaError._PARTITION_EOF:
                            remaining.discard(m.partition())
                        continue
                    for name, value in m.headers() or ():
                        if name == EVENT_ID_HEADER:
                            found.add(value.decode())
            consumer.unassign()
    finally:
        consumer.close()
    return found
