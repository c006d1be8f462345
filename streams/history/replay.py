"""Replay: re-derive episodes from history with the current reward spec, into a named topic.

    ClickHouse (completions, feedback)  ─┐
      by time range, project, offsets    ├─▶ canonical records ─▶ derive_episodes ─▶ filter ─▶ TOPIC
    Kafka (tabloop.completions/feedback) ┘    (sorted by event      (JoinPipeline:   (policy
      by offsets or timestamps                 time, then id)        join + reward)   versions)

Both sources give the same records (the sink stores every field; timestamps at
millisecond precision, floats as Float32 like Avro's ``float``), the records are
put in one order (event time, completions before feedback at the same instant,
then event id) and run through the same pure join as the streams worker
(``streams.join.JoinPipeline``) with the reward specs of ``rewards.spec``.
Episode ids are derived from what they join, so the same input gives the same
episodes, ids included, from either source — and a trainer reading the topic
can retrain a base model from history.

The selection is held in memory (sorted) before joining: replays of a few
million events fit; bigger ones go by time range, one range after another.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable, Iterator

from infra.bus import EventProducer, KafkaUnavailable, decode_message, ensure_topics, first_offsets_at, make_codec
from infra.settings import Settings
from rewards.scoring import Scorers, rescored
from schemas.events import EVENT_TYPES, Event
from schemas.token_ids import PACKED, packed_field
from schemas.topics import CATALOG, COMPLETIONS, FEEDBACK, KEEP_FOREVER, Topic
from streams.history.sink import TABLE_FOR_EVENT, event_columns, sql_literal
from streams.history.sql import SqlClient
from streams.join import JoinConfig, JoinPipeline, millis
from rewards.spec import RewardSpecs

log = logging.getLogger("tabloop.replay")
TICK_EVERY = 1000
"""Records between expiry ticks: a fixed count, so the same input closes windows at the same points."""
INPUT = {"CompletionServed": COMPLETIONS.name, "FeedbackReceived": FEEDBACK.name}


@dataclass(frozen=True)
class Selection:
    """What to replay. Times are event times (served_at / received_at), ``until`` exclusive."""

    since: datetime | None = None
    until: datetime | None = None
    projects: tuple[str, ...] = ()
    policy_versions: tuple[int, ...] = ()
    """Keep episodes of these policy versions (the join still sees every event of the selection)."""
    start_offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    """(topic, partition) → first offset; partitions not named start at their beginning."""

    def wants(self, type_name: str, record: dict) -> bool:
        t = millis(record[EVENT_TYPES[type_name].time_field])
        if self.since is not None and t < millis(self.since):
            return False
        if self.until is not None and t >= millis(self.until):
            return False
        return not self.projects or record["project_id"] in self.projects


def parse_offset(text: str) -> tuple[tuple[str, int], int]:
    """``TOPIC:PARTITION:OFFSET`` → ((topic, partition), offset); errors say what is wrong."""
    parts = text.rsplit(":", 2)
    if len(parts) != 3:
        raise ValueError(f"expected TOPIC:PARTITION:OFFSET, got {text!r}")
    topic, partition, offset = parts
    if topic not in INPUT.values():
        raise ValueError(f"replay reads {', '.join(INPUT.values())}, not {topic!r}")
    try:
        p, o = int(partition), int(offset)
    except ValueError:
        raise ValueError(f"partition and offset must be whole numbers in {text!r}") from None
    if p < 0 or o < 0:
        raise ValueError(f"partition and offset must be >= 0 in {text!r}")
    return (topic, p), o


def utc(t: Any) -> datetime:
    """A timestamp as an aware UTC datetime: ClickHouse hands naive UTC, JSON hands ISO text."""
    if isinstance(t, str):
        t = datetime.fromisoformat(t)
    if t.tzinfo is None:
        return t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc)


def canonical(type_name: str, record: dict) -> dict:
    """A record with only its schema's fields, timestamps as aware UTC datetimes, packed ids as bytes (a
    history table holds them as Array(UInt32))."""
    et = EVENT_TYPES[type_name]
    out = {}
    for f in et.schema_json["fields"]:
        value = record.get(f["name"], et.defaults.get(f["name"]))
        if isinstance(f["type"], dict) and f["type"].get("logicalType") == "timestamp-millis":
            value = utc(value)
        elif f["name"] == PACKED:
            value = packed_field(value)
        out[f["name"]] = value
    return out


def order_key(item: tuple[str, dict]) -> tuple:
    type_name, record = item
    return (millis(record[EVENT_TYPES[type_name].time_field]), 0 if type_name == "CompletionServed" else 1,
            record["event_id"])


def derive_episodes(records: Iterable[tuple[str, dict]], specs: RewardSpecs | None = None,
                    config: JoinConfig | None = None) -> list[Event]:
    """Episodes of completions and feedback (pure): dedupe by event id, sort, join, close every window."""
    seen: set[str] = set()
    items = []
    for type_name, record in records:
        if record["event_id"] in seen:
            continue  # the same event published twice: one fact
        seen.add(record["event_id"])
        items.append((type_name, record))
    items.sort(key=order_key)
    pipeline = JoinPipeline(specs or RewardSpecs(), config or JoinConfig())
    out: list[Event] = []
    for i, (type_name, record) in enumerate(items, 1):
        out.extend(pipeline.completion(record) if type_name == "CompletionServed" else pipeline.feedback(record))
        if i % TICK_EVERY == 0:
            out.extend(pipeline.tick())
    # The end of history: move time past every window so what is still open closes.
    cfg = pipeline.config
    horizon = max(cfg.match_window_ms, cfg.max_lateness_ms, cfg.completion_ttl_ms) * 3
    end = max(pipeline.matcher.stream_time, pipeline.joiner.stream_time) + horizon
    pipeline.matcher.stream_time = pipeline.joiner.stream_time = end
    out.extend(pipeline.tick())
    out.extend(pipeline.tick())  # unmatched feedback from the matcher reaches the joiner's expiry on the second
    return out


def score_episodes(episodes: list[Event], specs: RewardSpecs, scorers) -> list[Event]:
    """Episodes with the judge and tests components their project's spec weighs, as the streams worker
    adds them (``rewards.scoring``); episodes no scorer applies to come back as they are."""
    import asyncio

    async def one(e: Event) -> Event:
        spec = specs.for_project(e.record["project_id"])
        wanted = scorers.wanted(spec, e.record)
        if not wanted:
            return e
        components, errors = await scorers.score(spec, e.record, wanted)
        return Event(e.type, rescored(e.record, spec, components, errors))

    async def all_of() -> list[Event]:
        try:
            return list(await asyncio.gather(*(one(e) for e in episodes)))
        finally:
            await scorers.aclose()

    return asyncio.run(all_of())


def keep_versions(episodes: Iterable[Event], versions: tuple[int, ...]) -> list[Event]:
    if not versions:
        return list(episodes)
    wanted = set(versions)
    return [e for e in episodes if e.record.get("policy_version") in wanted]


# -- sources ------------------------------------------------------------------------------------------


def records_from_clickhouse(sql_client, selection: Selection) -> Iterator[tuple[str, dict]]:
    """Completions and feedback of the selection, read with FINAL (one row per event)."""
    db = sql_client.database
    for type_name, topic in INPUT.items():
        et = EVENT_TYPES[type_name]
        table = TABLE_FOR_EVENT[type_name]
        conditions = []
        if selection.since is not None:
            conditions.append(f"{et.time_field} >= {sql_literal(selection.since)}")
        if selection.until is not None:
            conditions.append(f"{et.time_field} < {sql_literal(selection.until)}")
        if selection.projects:
            conditions.append(f"project_id IN ({', '.join(sql_literal(p) for p in selection.projects)})")
        for (t, partition), offset in sorted(selection.start_offsets.items()):
            if t == topic:
                conditions.append(f"NOT (_topic = {sql_literal(t)} AND _partition = {partition} "
                                  f"AND _offset < {offset})")
        names = [n for n, _ in event_columns(et)]
        sql = (f"SELECT {', '.join(f'`{n}`' for n in names)} FROM {db}.{table} FINAL"
               f"{' WHERE ' + ' AND '.join(conditions) if conditions else ''} ORDER BY {et.time_field}, event_id")
        result = sql_client.query(sql)
        for row in result.rows:
            yield type_name, canonical(type_name, dict(zip(result.columns, row)))


def records_from_kafka(settings: Settings, selection: Selection) -> Iterator[tuple[str, dict]]:
    """Completions and feedback of the selection from the topics: from the start offsets, or from the
    first offset at ``since`` (the broker's time index: message timestamps are event times), to the end
    each partition has now."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    codec = make_codec(settings)
    consumer = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": "tabloop-replay",
                         "enable.auto.commit": False, "enable.partition.eof": True})
    try:
        for type_name, topic in INPUT.items():
            try:
                meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
            except Exception as exc:
                raise KafkaUnavailable(f"Kafka at {settings.kafka_bootstrap} did not answer: {exc}") from None
            if meta is None or meta.error is not None:
                raise ValueError(f"topic {topic!r} does not exist on {settings.kafka_bootstrap}")
            assignment, ends = [], {}
            for p in sorted(meta.partitions):
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                start = max(low, selection.start_offsets.get((topic, p), low))
                if selection.since is not None and (topic, p) not in selection.start_offsets:
                    start = max(start, first_offsets_at(consumer, topic, [p], millis(selection.since))[p])
                if start < high:
                    assignment.append(TopicPartition(topic, p, start))
                    ends[p] = high
            if not assignment:
                continue
            consumer.assign(assignment)
            remaining = set(ends)
            while remaining:
                for m in consumer.consume(1000, 1.0):
                    if m.error() is not None and m.error().code() == KafkaError._PARTITION_EOF:
                        remaining.discard(m.partition())
                        continue
                    r = decode_message(codec, m)
                    if r.offset >= ends[r.partition]:
                        remaining.discard(r.partition)
                        continue
                    if r.offset + 1 >= ends[r.partition]:
                        remaining.discard(r.partition)
                    if r.event is None or r.event.type != type_name:
                        log.warning("skipping %s/%d@%d: not a %s (%s)", r.topic, r.partition, r.offset, type_name,
                                    r.error)
                        continue
                    if selection.wants(type_name, r.event.record):
                        yield type_name, canonical(type_name, r.event.record)
            consumer.unassign()
    finally:
        consumer.close()


# -- the replay ----------------------------------------------------------------------------------------


def check_target(topic: str) -> None:
    if topic in {t.name for t in CATALOG}:
        raise ValueError(f"{topic} is a topic of the live system; replay into a topic of its own "
                         "(e.g. tabloop.replay.<name>)")
    if not topic or len(topic) > 249 or not all(c.isalnum() or c in "._-" for c in topic):
        raise ValueError(f"{topic!r} is not a valid Kafka topic name (letters, digits, . _ -)")


def publish_episodes(settings: Settings, topic: str, episodes: list[Event]) -> None:
    check_target(topic)
    ensure_topics(settings, [Topic(topic, "Episode", KEEP_FOREVER)])
    with EventProducer(settings, client_id="tabloop-replay") as producer:
        for e in episodes:
            producer.publish(e, topic=topic)


def replay(settings: Settings, source: str, selection: Selection, topic: str | None,
           specs: RewardSpecs | None = None, sql_client=None, scorers=None) -> dict:
    """Derive the selection's episodes and publish them to ``topic`` (None: derive only). Returns a summary.

    Scorers (the judge, unit tests) come from the settings unless given; they score the episodes whose
    spec weighs them. Unit tests give the same scores from either source; a judge is an outside model.
    """
    if topic is not None:
        check_target(topic)
    if specs is None:
        specs = RewardSpecs.from_settings(settings)
    if source == "clickhouse":
        records = list(records_from_clickhouse(sql_client or SqlClient(settings), selection))
    elif source == "kafka":
        records = list(records_from_kafka(settings, selection))
    else:
        raise ValueError(f"source must be clickhouse or kafka, not {source!r}")
    pipeline_config = JoinConfig.from_settings(settings)
    episodes = keep_versions(derive_episodes(records, specs, pipeline_config), selection.policy_versions)
    if scorers is None:
        scorers = Scorers.from_settings(settings)
    episodes = score_episodes(episodes, specs, scorers)
    if topic is not None:
        publish_episodes(settings, topic, episodes)
    counts: dict[str, int] = {}
    for type_name, _ in {r["event_id"]: (t, r) for t, r in records}.values():  # distinct events
        counts[type_name] = counts.get(type_name, 0) + 1
    return {"source": source, "topic": topic, "completions": counts.get("CompletionServed", 0),
            "feedback": counts.get("FeedbackReceived", 0), "episodes": len(episodes),
            "matched": sum(1 for e in episodes if e.record["matched"]),
            "scored": sum(1 for e in episodes if e.record["scorer"] != "acceptance"),
            "reward_sum": round(sum(e.record["reward"] for e in episodes), 6)}
