"""The one Kafka layer every component uses: a producer, a consumer, topic admin.

Everything goes through the schemas' codec, so every message on every tabloop
topic is an Avro event in the configured wire format.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewPartitions, NewTopic

from infra.settings import Settings
from schemas.codec import Codec, EventDecodeError
from schemas.events import Event
from schemas.registry import ConfluentSchemaRegistry
from schemas.topics import CATALOG, Topic

log = logging.getLogger("tabloop.bus")
EVENT_ID_HEADER = "event_id"
PRODUCER_MESSAGE_MAX_BYTES = 1_000_000
"""librdkafka's message.max.bytes (its default, made explicit): under the topics' max.message.bytes
(schemas.topics.MAX_MESSAGE_BYTES) by room for one record batch's framing and lz4's worst case."""
REPEAT_WINDOW_S = 30.0


class _RepeatFilter(logging.Filter):
    """librdkafka reports every failed reconnect; say each distinct message once per window."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        import time

        # The message minus its "(after Nms in state X)" tail, which changes every time.
        text = record.getMessage().split(" (after ")[0]
        now = time.monotonic()
        if now - self._last.get(text, -REPEAT_WINDOW_S) < REPEAT_WINDOW_S:
            return False
        if len(self._last) > 1000:
            self._last.clear()
        self._last[text] = now
        return True


log.addFilter(_RepeatFilter())


class KafkaUnavailable(RuntimeError):
    """No broker answered at the configured bootstrap address."""


def make_codec(settings: Settings) -> Codec:
    registry = ConfluentSchemaRegistry(settings.schema_registry_url) if settings.schema_registry_url else None
    return Codec(registry)


def _client_config(settings: Settings) -> dict:
    return {"bootstrap.servers": settings.kafka_bootstrap, "logger": log}


def gave_up(exc: KafkaException) -> bool:
    """Whether librdkafka has given this client up for good (a fatal error, e.g. a static group member
    fenced by its own rejoin): it never works again, so waiting the error out is pointless; only a new
    client (a restart) helps."""
    error = exc.args[0] if exc.args else None
    return isinstance(error, KafkaError) and (error.fatal() or error.code() == KafkaError._FATAL)


def broker_answers(settings: Settings, timeout_s: float = 2.0) -> bool:
    """Does a broker at the configured bootstrap answer a metadata request?"""
    # log_level 0: a broker that is down is the answer here, not an error to log.
    admin = AdminClient({**_client_config(settings), "socket.connection.setup.timeout.ms": 1000, "log_level": 0})
    try:
        admin.list_topics(timeout=timeout_s)
        return True
    except KafkaException:
        return False


def wait_for_kafka(settings: Settings, timeout_s: float, *, topics: Iterable[str] = (),
                   poll_s: float = 1.0, say: Callable[[str], None] | None = None) -> float:
    """Until a broker at the bootstrap answers a metadata request listing every topic in ``topics``: how
    services started together (a compose stack) wait for the broker and the topic catalog themselves, with
    no engine's health checks or start conditions. Returns the seconds waited; ``KafkaUnavailable`` naming
    what was still missing after ``timeout_s``."""
    wanted = set(topics)
    started = time.monotonic()
    deadline = started + timeout_s
    admin = AdminClient({**_client_config(settings), "socket.connection.setup.timeout.ms": 1000, "log_level": 0})
    missing: set[str] | None = None  # None: no broker answered yet
    said = ""
    while True:
        try:
            present = set(admin.list_topics(timeout=min(2.0, max(0.1, deadline - time.monotonic()))).topics)
            missing = wanted - present
            if not missing:
                return time.monotonic() - started
            state = f"the broker answers; waiting for the topics {', '.join(sorted(missing))}"
        except KafkaException:
            missing = None
            state = f"waiting for a broker at {settings.kafka_bootstrap}"
        if say is not None and state != said:
            say(state)
            said = state
        if time.monotonic() >= deadline:
            what = (f"no Kafka broker answered at {settings.kafka_bootstrap}" if missing is None else
                    f"the broker at {settings.kafka_bootstrap} answers but the topics {', '.join(sorted(missing))} "
                    "do not exist (`tabloop topics create` makes them)")
            raise KafkaUnavailable(f"{what} after waiting {timeout_s:g} s (TABLOOP_KAFKA_WAIT_S)")
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


# -- producing ----------------------------------------------------------------


class PublishError(RuntimeError):
    """Kafka did not take an event; the message names the event and the reason."""


@dataclass(frozen=True, slots=True)
class Delivered:
    topic: str
    partition: int
    offset: int


DeliveryCallback = Callable[["PublishError | None", "Delivered | None"], None]


class EventProducer:
    """Publishes events with acks=all and idempotence: no duplicates, no reordering per key.

    ``publish`` returns at once. Delivery failures are never silent: they go to
    the event's ``on_delivery`` callback when given, and otherwise are logged,
    counted and raised by the next ``flush``/``close``. ``publish_acked``
    returns a future for callers that must know (e.g. before answering 202).
    A background thread serves delivery reports, so callers never poll.
    """

    def __init__(self, settings: Settings, codec: Codec | None = None, *, client_id: str = "tabloop",
                 overrides: dict | None = None):
        self._owns_codec = codec is None
        self.codec = codec or make_codec(settings)
        self.codec.prepare()  # schema ids looked up once, at start: no publish waits on the registry
        conf = {
            **_client_config(settings),
            "client.id": client_id,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 5,
            # Named, not left to the default: the streams worker computes the same partition from a key
            # (``schemas.topics.home_partition``) to tell a record that landed where its key belongs.
            "partitioner": "consistent_random",
            "compression.type": "lz4",
            # librdkafka refuses a bigger message at produce(); a batch can pass this by one message's
            # framing, and lz4 can grow incompressible data a little: the topics' limit leaves room for both.
            "message.max.bytes": PRODUCER_MESSAGE_MAX_BYTES,
            "batch.size": 1_000_000,
            "queue.buffering.max.messages": 500_000,
            "queue.buffering.max.kbytes": 1_048_576,
            "delivery.timeout.ms": 120_000,
            # Reports for events sent without their own callback: only failures matter.
            "on_delivery": self._record_failure,
            **(overrides or {}),
        }
        self._producer = Producer(conf)
        self.message_max_bytes = int(conf["message.max.bytes"])
        """The most one message (value, key and headers, with their framing) may take."""
        self._failures: list[str] = []
        self._failure_count = 0
        self._failure_lock = threading.Lock()  # reports arrive on the poller and on flush()
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._serve_reports, name=f"{client_id}-delivery", daemon=True)
        self._poller.start()

    def publish(self, event: Event, *, topic: str | None = None, on_delivery: DeliveryCallback | None = None) -> None:
        """Encode and send one event, keyed by its join key, timestamped with its event time.

        ``topic`` overrides the catalog's topic for the event type (replays into a named topic).
        """
        value = self.codec.encode(event)
        when = event.record.get(event.event_type.time_field)
        timestamp_ms = int(when.timestamp() * 1000) if hasattr(when, "timestamp") else 0
        # The event id rides along as a header too, so a reader can deduplicate
        # without decoding (the serving spool's replay does).
        self.send_encoded(topic or event.topic, event.key.encode(), value, timestamp_ms,
                          what=f"{event.type} {event.event_id}", on_delivery=on_delivery,
                          headers=[(EVENT_ID_HEADER, event.event_id.encode())])

    def publish_acked(self, event: Event, *, topic: str | None = None) -> Future:
        """Publish, returning a future of where the event landed (or PublishError)."""
        future: Future = Future()

        def resolve(error, delivered):
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(delivered)

        self.publish(event, topic=topic, on_delivery=resolve)
        return future

    def send_encoded(self, topic: str, key: bytes | None, value: bytes, timestamp_ms: int = 0, *,
                     what: str = "message", on_delivery: DeliveryCallback | None = None,
                     headers: list[tuple[str, bytes]] | None = None) -> None:
        """Send bytes the codec already made (relaying events without decoding them)."""
        options: dict = {"key": key, "timestamp": timestamp_ms, "headers": headers}
        if on_delivery is not None:
            def report(err, msg):
                if err is not None:
                    on_delivery(PublishError(f"{what} to {topic}: {err.str()}"), None)
                else:
                    on_delivery(None, Delivered(msg.topic(), msg.partition(), msg.offset()))

            options["on_delivery"] = report
        while True:
            try:
                self._producer.produce(topic, value, **options)
                return
            except BufferError:  # local queue full: wait for deliveries (back-pressure)
                self._producer.poll(0.05)
            except KafkaException as exc:
                raise PublishError(f"{what} to {topic}: {exc}") from exc

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every published event is acknowledged or failed; raise if any failed unseen."""
        remaining = self._producer.flush(timeout_s)
        if remaining:
            raise PublishError(f"{remaining} events still undelivered after {timeout_s:.0f}s (is Kafka up?)")
        with self._failure_lock:
            count, failures = self._failure_count, self._failures
            self._failures, self._failure_count = [], 0
        if count:
            raise PublishError(f"{count} events were not delivered; first: {failures[0]}")

    def _record_failure(self, err, msg) -> None:
        if err is None:
            return
        with self._failure_lock:
            self._failure_count += 1
            if len(self._failures) < 10:
                self._failures.append(f"to {msg.topic()}: {err.str()}")
        log.error("event not delivered to %s: %s", msg.topic(), err.str())

    def pending(self) -> int:
        return len(self._producer)

    def close(self, timeout_s: float = 30.0) -> None:
        try:
            self.flush(timeout_s)
        finally:
            self._closed.set()
            self._poller.join(timeout=5)
            if self._owns_codec:
                self.codec.close()

    def __enter__(self) -> "EventProducer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve_reports(self) -> None:
        while not self._closed.is_set():
            self._producer.poll(0.1)


# -- consuming ----------------------------------------------------------------


@dataclass(slots=True)
class Received:
    """One message: the decoded event, or the error that kept it from decoding."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    event: Event | None
    error: EventDecodeError | None

    def position(self) -> TopicPartition:
        """The offset to commit once this message is done with (the next one)."""
        return TopicPartition(self.topic, self.partition, self.offset + 1)


class EventConsumer:
    """A consumer-group member that decodes through the codec and commits only when told.

    Offsets are committed explicitly (``commit``) after the caller has made the
    effect of the messages durable: at-least-once, nothing skipped on a crash.
    """

    def __init__(self, settings: Settings, group_id: str, topics: Iterable[str], codec: Codec | None = None,
                 *, from_beginning: bool = True, client_id: str = "tabloop", overrides: dict | None = None):
        self._owns_codec = codec is None
        self.codec = codec or make_codec(settings)
        self.codec.prepare()  # schema ids looked up once, at start: no publish waits on the registry
        conf = {
            **_client_config(settings),
            "group.id": group_id,
            "client.id": client_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest" if from_beginning else "latest",
            "enable.partition.eof": False,
            "partition.assignment.strategy": "cooperative-sticky",
            **(overrides or {}),
        }
        self._consumer = Consumer(conf)
        self._consumer.subscribe(list(topics))

    def poll(self, max_messages: int = 500, timeout_s: float = 1.0,
             errors: list[KafkaError] | None = None, *, decode: bool = True) -> list[Received]:
        """Messages, decoded. A broker error raises, unless ``errors`` is given: then it is appended there
        and the messages around it are still returned (raising would lose them: the position moved on).
        ``decode=False``: undecoded (event and error None), for a reader that decodes in bulk itself."""
        messages = self._consumer.consume(max_messages, timeout_s)
        out = []
        for m in messages:
            if errors is not None and m.error() is not None and m.error().code() != KafkaError._PARTITION_EOF:
                errors.append(m.error())
                continue
            if (received := decode_message(self.codec, m, decode)) is not None:
                out.append(received)
        return out

    def commit(self, received: Iterable[Received] | None = None) -> None:
        """Synchronously commit the positions after ``received`` (or after all polled messages)."""
        if received is None:
            self._consumer.commit(asynchronous=False)
            return
        latest: dict[tuple[str, int], TopicPartition] = {}
        for r in received:
            tp = r.position()
            key = (tp.topic, tp.partition)
            if key not in latest or latest[key].offset < tp.offset:
                latest[key] = tp
        if latest:
            self._consumer.commit(offsets=list(latest.values()), asynchronous=False)

    def assignment(self) -> list[TopicPartition]:
        return self._consumer.assignment()

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> "EventConsumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def decode_message(codec: Codec, m, decode: bool = True) -> Received | None:
    """A Received for a Kafka message; None for partition-EOF notices; raises on broker errors.
    ``decode=False`` leaves event and error None (the caller decodes)."""
    err = m.error()
    if err is not None:
        if err.code() == KafkaError._PARTITION_EOF:
            return None
        raise KafkaException(err)
    value = m.value() or b""
    if not decode:
        return Received(m.topic(), m.partition(), m.offset(), m.key(), value, None, None)
    try:
        event, error = codec.decode(value), None
    except EventDecodeError as exc:
        event, error = None, exc
    return Received(m.topic(), m.partition(), m.offset(), m.key(), value, event, error)


def whole_topic_reader(settings: Settings, group_id: str, topic: str) -> Consumer:
    """A consumer of ``topic``'s one partition from its first offset that commits nothing: for a watcher that
    folds the whole topic into its state again at every start (weight versions, show-gates)."""
    consumer = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": group_id,
                         "enable.auto.commit": False, "log_level": 3})
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    return consumer


def decoded_records(codec: Codec, messages, what: str) -> Iterator[dict]:
    """The records of a batch a watcher polled: a message's error (the topic not created yet) passed over, as
    the watcher keeps polling; an undecodable event logged, naming ``what`` it was, and passed over."""
    for m in messages:
        if m.error() is not None:
            continue
        received = decode_message(codec, m)
        if received.event is None:
            log.error("undecodable %s event at offset %d: %s", what, m.offset(), received.error)
            continue
        yield received.event.record


_LEADERSHIP_MOVING = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                      KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError.REQUEST_TIMED_OUT}


def first_offsets_at(consumer: Consumer, topic: str, partitions, since_ms: int,
                     timeout_s: float = 10.0) -> dict[int, int]:
    """Each partition's first offset whose timestamp is at or after ``since_ms``; where none is that late,
    the partition's end (read *before* the time lookup: an OFFSET_END resolved later could skip a message
    produced meanwhile). The one "offsets for a time" of the project: the trainer's head feed, the spool's
    replay check and history replay all seek with it."""
    partitions = sorted(partitions)
    ends = {p: watermark_offsets(consumer, TopicPartition(topic, p), timeout_s)[1] for p in partitions}
    found = consumer.offsets_for_times([TopicPartition(topic, p, max(0, since_ms)) for p in partitions],
                                       timeout=timeout_s)
    return {tp.partition: tp.offset if tp.offset >= 0 else ends[tp.partition] for tp in found}


def watermark_offsets(consumer: Consumer, tp: TopicPartition, timeout_s: float = 30.0) -> tuple[int, int]:
    """(low, high) of a partition, waiting out what a broker says right after it restarts (no leader yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return consumer.get_watermark_offsets(tp, timeout=10)
        except KafkaException as exc:
            err = exc.args[0]
            if not (err.retriable() or err.code() in _LEADERSHIP_MOVING) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def read_topic(settings: Settings, topic: str, codec: Codec | None = None, *, from_beginning: bool = True,
               last: int | None = None, follow: bool = False, limit: int | None = None,
               idle_timeout_s: float = 1.0) -> Iterable[Received]:
    """Read a topic without a consumer group (nothing committed).

    Starts at the beginning, at the end, or ``last`` messages before the end of
    each partition; without ``follow`` it stops at the end the topic had when
    reading began.
    """
    codec = codec or make_codec(settings)
    consumer = Consumer({**_client_config(settings), "group.id": "tabloop-reader", "enable.auto.commit": False,
                         "enable.partition.eof": True})
    try:
        try:
            meta = consumer.list_topics(topic, timeout=10)
        except KafkaException as exc:
            raise KafkaUnavailable(f"Kafka at {settings.kafka_bootstrap} did not answer: {exc.args[0].str()}") from None
        tmeta = meta.topics.get(topic)
        if tmeta is None or tmeta.error is not None:
            raise ValueError(f"topic {topic!r} does not exist on {settings.kafka_bootstrap}")
        assignment, ends, remaining = [], {}, set()
        for p in sorted(tmeta.partitions):
            low, high = watermark_offsets(consumer, TopicPartition(topic, p))
            if last is not None:
                start = max(low, high - last)
            else:
                start = low if from_beginning else high
            assignment.append(TopicPartition(topic, p, start))
            ends[p] = high
            if start < high:
                remaining.add(p)
        consumer.assign(assignment)
        emitted = 0
        while follow or remaining:
            for m in consumer.consume(500, idle_timeout_s):
                if m.error() is not None and m.error().code() == KafkaError._PARTITION_EOF:
                    if not follow:
                        remaining.discard(m.partition())
                    continue
                received = decode_message(codec, m)
                if not follow:
                    if received.offset >= ends[received.partition]:
                        remaining.discard(received.partition)
                        continue
                    if received.offset + 1 >= ends[received.partition]:
                        remaining.discard(received.partition)
                yield received
                emitted += 1
                if limit is not None and emitted >= limit:
                    return
    finally:
        consumer.close()


# -- topics -------------------------------------------------------------------


class TopicSetupError(RuntimeError):
    """A topic differs from the catalog in a way that can't be fixed in place."""


def admin_client(settings: Settings) -> AdminClient:
    return AdminClient(_client_config(settings))


def wanted_partitions(topic: Topic, settings: Settings) -> int:
    return topic.partitions or settings.topic_partitions


def ensure_topics(settings: Settings, catalog: Iterable[Topic] = CATALOG, timeout_s: float = 30.0) -> list[str]:
    """Make the broker's topics match the catalog; return what was done, one line per action.

    Creates missing topics, adds partitions and fixes configs that differ.
    Raises TopicSetupError for what can't be changed in place (fewer
    partitions, another replication factor), after doing everything else.
    """
    admin = admin_client(settings)
    existing = admin.list_topics(timeout=timeout_s).topics
    actions, problems = [], []
    to_create = []
    for topic in catalog:
        partitions = wanted_partitions(topic, settings)
        meta = existing.get(topic.name)
        if meta is None:
            to_create.append(NewTopic(topic.name, partitions, settings.topic_replication, config=dict(topic.configs)))
            continue
        have = len(meta.partitions)
        if have < partitions:
            admin.create_partitions([NewPartitions(topic.name, partitions)])[topic.name].result(timeout_s)
            actions.append(f"{topic.name}: partitions {have} -> {partitions}")
        elif have > partitions:
            problems.append(f"{topic.name} has {have} partitions, the catalog wants {partitions}: Kafka cannot "
                            "remove partitions; recreate the topic (losing its data) or set TABLOOP_TOPIC_PARTITIONS")
        replicas = {len(p.replicas) for p in meta.partitions.values()}
        if replicas != {settings.topic_replication}:
            problems.append(f"{topic.name} has replication factor {sorted(replicas)}, the catalog wants "
                            f"{settings.topic_replication}: change it with a partition reassignment "
                            "(kafka-reassign-partitions), tabloop does not move replicas")
        actions.extend(_fix_configs(admin, topic, timeout_s))
    if to_create:
        for name, fut in admin.create_topics(to_create).items():
            try:
                fut.result(timeout_s)
                actions.append(f"{name}: created")
            except KafkaException as exc:
                if exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:  # raced with another creator
                    actions.append(f"{name}: already exists")
                else:
                    problems.append(f"{name}: could not be created: {exc.args[0].str()}")
    if problems:
        raise TopicSetupError("\n".join(problems))
    return actions


def _fix_configs(admin: AdminClient, topic: Topic, timeout_s: float) -> list[str]:
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic.name)
    current = admin.describe_configs([resource])[resource].result(timeout_s)
    changes = {k: v for k, v in topic.configs.items() if k not in current or current[k].value != v}
    if not changes:
        return []
    entries = [ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in changes.items()]
    admin.incremental_alter_configs([ConfigResource(ConfigResource.Type.TOPIC, topic.name,
                                                    incremental_configs=entries)])[resource].result(timeout_s)
    return [f"{topic.name}: {k} {current[k].value if k in current else '(unset)'} -> {v}" for k, v in changes.items()]
