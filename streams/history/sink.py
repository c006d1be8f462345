"""The history sink: every tabloop topic into ClickHouse, exactly once per event.

    tabloop.completions ─┐
    tabloop.feedback ────┤                     ┌─ completions   (ReplacingMergeTree, by day, TTL)
    tabloop.episodes ────┼─ HistorySink ──────▶├─ feedback      … one table per event type,
    tabloop.weights ─────┤  (batched inserts,  ├─ episodes        columns generated from its Avro schema
    tabloop.deadletter ──┘   commit after)     ├─ weights
                                               ├─ deadletter
                                               └─ rejects       (messages that did not decode)
                           views: acceptance_by_version, acceptance, shown_vs_accepted,
                                  latency, latency_by_day, reward_by_version, version_estimates

The same code and SQL run against the embedded engine (``chdb:///dir``) and a
ClickHouse server (``http://host:8123``), both through clickhouse-connect.

Exactly once, without transactions across Kafka and ClickHouse:

- Each row keeps where it came from (``_topic``, ``_partition``, ``_offset``).
  Offsets are committed to Kafka only after a batch is stored, so a crash
  between the insert and the commit re-delivers messages that are already
  stored. When a partition's messages start at an offset the sink did not
  expect (a fresh start, a rebalance), it asks the tables which offsets from
  there on are stored and skips those. An insert interrupted half-way (one
  day's part written, another's not) is covered too: the lookup is per offset.
- The tables are ReplacingMergeTree ordered by a key ending in ``event_id``, and
  the views read them with ``FINAL``: the same event published twice (a serving
  spool replaying what Kafka did in fact take) counts once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

from confluent_kafka import KafkaException

from infra.bus import EventConsumer, gave_up
from infra.settings import TABLE_FOR_EVENT, Settings, parse_retention
from infra.stall_guard import StallGuard, guarded, held_partitions
from schemas.codec import EventDecodeError
from schemas.events import EVENT_TYPES, EventType
from schemas.token_ids import PACKED, packed_field, unpack_ids
from schemas.topics import CATALOG
# The read-only query path (guard, readers, caps) lives there; NotReadOnly and HistoryBusy stay importable here.
from streams.history.guard import HistoryBusy, NotReadOnly, QueryLimits, ReaderPool  # noqa: F401

log = logging.getLogger("tabloop.history")

GROUP_ID = "tabloop-history"
EVENT_FOR_TABLE = {t: e for e, t in TABLE_FOR_EVENT.items()}
REJECTS = "rejects"
# The sorting key (and so the deduplication key) of each table: a column most queries filter on,
# then event_id. Every column before event_id is a function of the event, so duplicates of one
# event always share the whole key and ReplacingMergeTree folds them.
SORT_KEY = {"completions": ("project_id", "event_id"), "feedback": ("project_id", "event_id"),
            "episodes": ("project_id", "event_id"), "weights": ("base_model", "event_id"),
            "deadletter": ("source_topic", "event_id"), "gates": ("project_id", "event_id")}
SOURCE_COLUMNS = (("_topic", "LowCardinality(String)"), ("_partition", "Int32"), ("_offset", "Int64"))
# Fields of packed little-endian uint32 token ids (schemas.token_ids): stored as Array(UInt32), numbers a query
# reads as such. The engine unpacks them itself, at the cost of a copy: the Avro rows fill an EPHEMERAL
# String column of the bytes (the field's name + RAW_SUFFIX) and the array is computed from it by reinterpret.
PACKED_FIELDS = frozenset({PACKED})
RAW_SUFFIX = "_bytes"
# The consumer fetches the next batch while the engine stores this one. librdkafka's default prefetch (64 MB,
# 1 MB per partition and fetch) holds about 12k of the 5 KB completions and episodes: a 20k batch then waited
# for fetches after every insert (`tabloop bench history`: the poll took 3.6–3.8 s of 9.3–9.6; with this,
# 0.8–0.9 s, 1.4–1.7× the rows/s). This holds two batches of them; memory is bounded by it.
PREFETCH = {"queued.max.messages.kbytes": 256 * 1024, "fetch.max.bytes": 100 * 1024 * 1024,
            "max.partition.fetch.bytes": 10 * 1024 * 1024}
# File extensions → language, for the acceptance view's language axis.
LANGUAGES = {
    "py": "python", "pyi": "python", "ts": "typescript", "tsx": "typescript", "js": "javascript",
    "jsx": "javascript", "mjs": "javascript", "go": "go", "rs": "rust", "java": "java", "kt": "kotlin",
    "c": "c", "h": "c", "cc": "cpp", "cpp": "cpp", "hpp": "cpp", "cs": "csharp", "rb": "ruby", "php": "php",
    "swift": "swift", "scala": "scala", "sql": "sql", "sh": "shell", "md": "markdown", "html": "html",
    "css": "css", "json": "json", "yaml": "yaml", "yml": "yaml", "toml": "toml",
}


class HistoryError(RuntimeError):
    """ClickHouse can't be used as configured; the message says what and why."""


# -- schema: tables generated from the Avro schemas ---------------------------------------------------


def clickhouse_type(avro: Any) -> str:
    """The ClickHouse column type that holds an Avro type exactly (pure; unions only with null)."""
    if isinstance(avro, list):
        others = [t for t in avro if t != "null"]
        if len(others) != 1:
            raise ValueError(f"only unions of null and one type map to a column, got {avro}")
        inner = clickhouse_type(others[0])
        return f"Nullable({inner})" if "null" in avro and not inner.startswith(("Array", "Map")) else inner
    if isinstance(avro, dict):
        if avro.get("logicalType") == "timestamp-millis":
            return "DateTime64(3, 'UTC')"
        kind = avro["type"]
        if kind == "array":
            return f"Array({clickhouse_type(avro['items'])})"
        if kind == "map":
            return f"Map(String, {clickhouse_type(avro['values'])})"
        if kind == "enum":
            return "LowCardinality(String)"
        return clickhouse_type(kind)
    primitive = {"string": "String", "bytes": "String", "long": "Int64", "int": "Int32", "double": "Float64",
                 "float": "Float32", "boolean": "Bool"}
    try:
        return primitive[avro]
    except KeyError:
        raise ValueError(f"no ClickHouse column type for Avro type {avro!r}") from None


def event_columns(et: EventType) -> list[tuple[str, str]]:
    """(name, ClickHouse type) of every field of the event type's current schema, in schema order."""
    return [(f["name"], "Array(UInt32)" if f["name"] in PACKED_FIELDS else clickhouse_type(f["type"]))
            for f in et.schema_json["fields"]]


def column_definitions(et: EventType) -> list[tuple[str, str]]:
    """(name, definition) of the columns that hold the event's fields: ``event_columns``, each packed-ids
    column preceded by the EPHEMERAL column of its bytes and computed from them (PACKED_FIELDS)."""
    out = []
    for name, ch_type in event_columns(et):
        if name in PACKED_FIELDS:
            out += [(name + RAW_SUFFIX, "String EPHEMERAL"),
                    (name, f"{ch_type} DEFAULT reinterpret(`{name + RAW_SUFFIX}`, '{ch_type}')")]
        else:
            out.append((name, ch_type))
    return out


def table_ddl(database: str, table: str, retention_days: int) -> str:
    """CREATE TABLE for one event table: partitioned by day of event time, deduplicated by event_id."""
    et = EVENT_TYPES[EVENT_FOR_TABLE[table]]
    columns = (column_definitions(et) + list(SOURCE_COLUMNS)
               + [("_stored_at", "DateTime64(3, 'UTC') DEFAULT now64(3)")])
    body = ",\n  ".join(f"`{n}` {t}" for n, t in columns)
    ttl = f"\nTTL toDateTime({et.time_field}) + INTERVAL {retention_days} DAY" if retention_days > 0 else ""
    return (f"CREATE TABLE IF NOT EXISTS {database}.{table} (\n  {body},\n"
            f"  INDEX source_offset _offset TYPE minmax GRANULARITY 1\n)\n"
            f"ENGINE = ReplacingMergeTree\nPARTITION BY toDate({et.time_field})\n"
            f"ORDER BY ({', '.join(SORT_KEY[table])}){ttl}")


def rejects_ddl(database: str) -> str:
    # Messages that are not an event of the topic's type: kept (nothing acknowledged is lost), never counted.
    return (f"CREATE TABLE IF NOT EXISTS {database}.{REJECTS} (\n  `_topic` LowCardinality(String),\n"
            "  `_partition` Int32,\n  `_offset` Int64,\n  `key` Nullable(String),\n  `raw` String,\n"
            "  `error` String,\n  `_stored_at` DateTime64(3, 'UTC') DEFAULT now64(3)\n)\n"
            "ENGINE = ReplacingMergeTree\nPARTITION BY toYYYYMM(_stored_at)\nORDER BY (_topic, _partition, _offset)")


def language_expr(column: str) -> str:
    """SQL: the language of a file path by its extension ('other' when unknown, 'unknown' when no path)."""
    exts = ", ".join(f"'{e}'" for e in LANGUAGES)
    langs = ", ".join(f"'{lang}'" for lang in LANGUAGES.values())
    ext = f"lower(extract(ifNull({column}, ''), '\\\\.([A-Za-z0-9+]+)$'))"
    return f"if(ifNull({column}, '') = '', 'unknown', transform({ext}, [{exts}], [{langs}], 'other'))"


# Acceptance rate = (accepted + partial) / decided; IGNORED episodes were not decided on.
_OUTCOME_COUNTS = """count() AS episodes,
  countIf(outcome = 'ACCEPTED') AS accepted,
  countIf(outcome = 'PARTIAL') AS partial,
  countIf(outcome = 'REJECTED') AS rejected,
  countIf(outcome = 'IGNORED' AND gate_shown) AS ignored,
  round((accepted + partial) / nullIf(accepted + partial + rejected, 0), 6) AS acceptance_rate,
  countIf(NOT gate_shown) AS gate_hidden"""


def view_ddls(db: str) -> dict[str, str]:
    """The analytics views; each reads its tables with FINAL so a duplicated event counts once."""
    return {
        "acceptance_by_version": f"""
SELECT policy_version, toDate(joined_at) AS day,
  {_OUTCOME_COUNTS}
FROM {db}.episodes FINAL
GROUP BY policy_version, day
ORDER BY day, policy_version""",
        "acceptance": f"""
SELECT e.policy_version AS policy_version, toDate(e.joined_at) AS day,
  if(c.completion_id = '', 'unknown', c.language) AS language, e.project_id AS project_id, e.user_id AS user_id,
  count() AS episodes,
  countIf(e.outcome = 'ACCEPTED') AS accepted,
  countIf(e.outcome = 'PARTIAL') AS partial,
  countIf(e.outcome = 'REJECTED') AS rejected,
  countIf(e.outcome = 'IGNORED' AND e.gate_shown) AS ignored,
  round((accepted + partial) / nullIf(accepted + partial + rejected, 0), 6) AS acceptance_rate,
  countIf(NOT e.gate_shown) AS gate_hidden
FROM {db}.episodes AS e FINAL
LEFT JOIN (SELECT completion_id, {language_expr('filepath')} AS language FROM {db}.completions FINAL) AS c
  ON e.completion_id = c.completion_id
GROUP BY policy_version, day, language, project_id, user_id
ORDER BY day, policy_version, language, project_id, user_id""",
        "shown_vs_accepted": f"""
SELECT toDate(c.served_at) AS day, c.project_id AS project_id, c.policy_version AS policy_version,
  count() AS served,
  countIf(NOT c.aborted AND c.gate_shown) AS shown,
  countIf(e.outcome IN ('ACCEPTED', 'PARTIAL')) AS accepted,
  countIf(e.outcome = 'REJECTED') AS rejected,
  countIf(NOT c.gate_shown) AS gate_hidden
FROM {db}.completions AS c FINAL
LEFT JOIN (SELECT completion_id, outcome FROM {db}.episodes FINAL WHERE matched) AS e
  ON c.completion_id = e.completion_id
GROUP BY day, project_id, policy_version
ORDER BY day, project_id, policy_version""",
        "latency": f"""
SELECT toDate(served_at) AS day, policy_version, count() AS completions,
  quantileExact(0.5)(latency_ms) AS latency_p50, quantileExact(0.9)(latency_ms) AS latency_p90,
  quantileExact(0.99)(latency_ms) AS latency_p99,
  quantileExact(0.5)(ttft_ms) AS ttft_p50, quantileExact(0.9)(ttft_ms) AS ttft_p90,
  quantileExact(0.99)(ttft_ms) AS ttft_p99
FROM {db}.completions FINAL
GROUP BY day, policy_version
ORDER BY day, policy_version""",
        "latency_by_day": f"""
SELECT toDate(served_at) AS day, count() AS completions,
  quantileExact(0.5)(latency_ms) AS latency_p50, quantileExact(0.9)(latency_ms) AS latency_p90,
  quantileExact(0.99)(latency_ms) AS latency_p99,
  quantileExact(0.5)(ttft_ms) AS ttft_p50, quantileExact(0.9)(ttft_ms) AS ttft_p90,
  quantileExact(0.99)(ttft_ms) AS ttft_p99
FROM {db}.completions FINAL
GROUP BY day
ORDER BY day""",
        "reward_by_version": f"""
SELECT policy_version, toDate(joined_at) AS day, count() AS episodes,
  round(avg(reward), 6) AS reward_mean, round(sum(reward), 6) AS reward_sum,
  countIf(matched) AS matched
FROM {db}.episodes FINAL
GROUP BY policy_version, day
ORDER BY day, policy_version""",
        # The promotion gate's estimate of each version (trainer/promotion.py) and, where a canary then served
        # it, what the canary measured: the newest event of the version that carries each figure.
        "version_estimates": f"""
SELECT base_model, version,
  argMax(status, created_at) AS status,
  {_last_metric('ope_gate_passed')} AS gate_passed,
  {_last_metric('ope_serving_version')} AS serving_version,
  {_last_metric('ope_held_out')} AS held_out_episodes,
  {_last_metric('ope_ess')} AS effective_sample_size,
  {_last_metric('ope_reward_mean_dr')} AS reward_estimate,
  {_last_metric('ope_reward_mean_dr_low')} AS reward_low,
  {_last_metric('ope_reward_mean_dr_high')} AS reward_high,
  {_last_metric('ope_serving_reward_mean')} AS serving_reward,
  {_last_metric('ope_accept_rate_shown')} AS accept_rate_estimate,
  {_last_metric('ope_accept_rate_shown_low')} AS accept_rate_low,
  {_last_metric('ope_accept_rate_shown_high')} AS accept_rate_high,
  {_last_metric('ope_serving_accept_rate_shown')} AS serving_accept_rate,
  {_last_metric('ope_shown_share')} AS shown_share_estimate,
  {_last_metric('canary_candidate_accept_rate')} AS canary_accept_rate,
  {_last_metric('canary_candidate_episodes')} AS canary_episodes
FROM {db}.weights FINAL
GROUP BY base_model, version
HAVING countIf(mapContains(metrics, 'ope_gate_passed')) > 0
ORDER BY base_model, version""",
    }


def _last_metric(name: str) -> str:
    """The newest value of a WeightVersion metric among a version's events (NULL if none carries it)."""
    return f"argMaxIf(toNullable(metrics['{name}']), created_at, mapContains(metrics, '{name}'))"


# -- the store: one ClickHouse client, shared by the sink and the SQL server -----------------------------


def open_client(url: str):
    """A clickhouse-connect client for ``chdb:///dir`` (embedded) or ``http(s)://…`` (a server)."""
    import clickhouse_connect

    if url.startswith("chdb://"):
        Path(url.removeprefix("chdb://")).mkdir(parents=True, exist_ok=True)
    try:
        return clickhouse_connect.get_client(dsn=url)
    except Exception as exc:  # driver errors: connection refused, a second process on a chdb dir…
        if url.startswith("chdb://") and "EmbeddedServer" in str(exc):
            # chdb prints the reason (often "Cannot lock file …/status") to stderr, not into the exception.
            raise HistoryError(f"cannot open {url}: {exc}. The embedded engine allows one process per "
                               "directory: is `tabloop history` already running? Ask it with `tabloop sql`") from None
        raise HistoryError(f"cannot open ClickHouse at {url}: {exc}") from None


@dataclass
class QueryResult:
    columns: list[str]
    types: list[str]
    rows: list[list[Any]]

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row)) for row in self.rows]


class HistoryStore:
    """The tables and views in one database, and every read and write to them.

    One lock serialises the sink's own calls on its handle. Read queries (``query``)
    run on other handles to the same engine (``readers``), capped and read-only,
    so a heavy one never holds the sink's inserts.
    """

    def __init__(self, client, database: str = "tabloop", retention: Mapping[str, int] | None = None, *,
                 limits: QueryLimits | None = None, connect: Callable[[], Any] | None = None):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", database):
            raise HistoryError(f"database name {database!r}: use letters, digits and _")
        self.client = client
        self.database = database
        self.retention = dict(retention or {})
        self._lock = threading.Lock()
        # Read queries run on handles of their own (``connect`` makes one; for chdb a second handle on the
        # same engine), capped and read-only, so they never wait on or hold the sink's lock.
        self.limits = limits or QueryLimits()
        self.readers = ReaderPool(connect or _reader_connect(client), database, self.limits)
        self._columns = {table: [n for n, _ in event_columns(EVENT_TYPES[e])] for table, e in EVENT_FOR_TABLE.items()}
        self._avro_headers: dict[str, tuple[bytes, list[str]]] = {}
        if _embedded(client):
            _clear_insert_files_of_gone_processes(client)

    @classmethod
    def from_settings(cls, settings: Settings, client=None) -> "HistoryStore":
        url = settings.effective_clickhouse_url
        return cls(client or open_client(url), settings.history_database,
                   parse_retention(settings.history_retention_days), connect=lambda: open_client(url))

    def ensure_schema(self) -> list[str]:
        """Create the database, tables and views; add columns new schema versions brought; set each TTL."""
        db, actions = self.database, []
        with self._lock:
            self.client.command(f"CREATE DATABASE IF NOT EXISTS {db}")
            for table in EVENT_FOR_TABLE:
                self.client.command(table_ddl(db, table, self.retention.get(table, 0)))
                have = {r[0] for r in self.client.query(
                    f"SELECT name FROM system.columns WHERE database = '{db}' AND table = '{table}'").result_rows}
                for name, ch_type in column_definitions(EVENT_TYPES[EVENT_FOR_TABLE[table]]):
                    if name not in have:  # a field added to the schema (with a default) since the table was made
                        self.client.command(f"ALTER TABLE {db}.{table} ADD COLUMN IF NOT EXISTS `{name}` {ch_type}")
                        actions.append(f"{table}: added column {name}")
                actions.extend(self._fix_ttl(table))
            self.client.command(rejects_ddl(db))
            for name, select in view_ddls(db).items():
                self.client.command(f"CREATE OR REPLACE VIEW {db}.{name} AS {select}")
        return actions

    def _fix_ttl(self, table: str) -> list[str]:
        et = EVENT_TYPES[EVENT_FOR_TABLE[table]]
        days = self.retention.get(table, 0)
        create = self.client.query(f"SHOW CREATE TABLE {self.database}.{table}").result_rows[0][0]
        current = re.search(r"\bTTL .*?(?:INTERVAL (\d+) DAY|toIntervalDay\((\d+)\))", create)
        have = int(current.group(1) or current.group(2)) if current else 0
        if have == days:
            return []
        if days > 0:
            self.client.command(f"ALTER TABLE {self.database}.{table} MODIFY TTL "
                                f"toDateTime({et.time_field}) + INTERVAL {days} DAY")
        else:
            self.client.command(f"ALTER TABLE {self.database}.{table} REMOVE TTL")
        return [f"{table}: retention {have or 'forever'} -> {days or 'forever'} days"]

    def columns(self, table: str) -> list[str]:
        return self._columns[table]

    def row(self, table: str, record: Mapping[str, Any], topic: str, partition: int, offset: int) -> list[Any]:
        """A row for ``insert``: the event's fields in column order (packed ids as numbers), then its source."""
        return [unpack_ids(packed_field(record.get(c))).tolist() if c in PACKED_FIELDS else record.get(c)
                for c in self._columns[table]] + [topic, partition, offset]

    def insert(self, table: str, rows: list[list[Any]], source_columns: bool = True) -> None:
        """Insert rows (event fields in schema order, packed ids as lists of ints, then _topic, _partition,
        _offset)."""
        if not rows:
            return
        names = self._columns[table] + ([n for n, _ in SOURCE_COLUMNS] if source_columns else [])
        with self._lock:
            self.client.insert(f"{self.database}.{table}", rows, column_names=names)

    def insert_avro(self, table: str, messages: list[tuple[Any, int]]) -> None:
        """Insert events as their Avro bodies, read by the engine (C++) instead of decoded here.

        ``messages``: (Received, where its body starts), each written with the table's current schema
        (``Codec.current_body_offset``). Each becomes one row of an Avro container whose schema is the
        source columns followed by the event's fields: its bytes are the source columns' encoding and the
        body unchanged, so nothing is decoded or re-encoded in Python. One container block per message:
        a body that ends early fails the insert (the engine never reads into the next message's bytes).
        """
        if not messages:
            return
        header, names = self._avro_header(table)
        parts = [header]
        where_from: dict[tuple[str, int], bytes] = {}  # (topic, partition) → their encoding, the source's start
        sync = b""
        for r, at in messages:
            start = where_from.get((r.topic, r.partition))
            if start is None:
                topic = r.topic.encode()
                start = where_from[(r.topic, r.partition)] = _avro_long(len(topic)) + topic + _avro_long(r.partition)
            source = start + _avro_long(r.offset)
            body = memoryview(r.value)[at:]
            # The previous block's sync marker, this block's count (1) and size, the source columns; the body.
            parts += (sync + _ONE + _avro_long(len(source) + len(body)) + source, body)
            sync = _SYNC
        parts.append(sync)
        with self._lock:
            if _embedded(self.client):
                _insert_from_file(self.client, f"{self.database}.{table}", names, parts)
            else:
                self.client.raw_insert(f"{self.database}.{table}", names, insert_block=b"".join(parts), fmt="Avro")

    def _avro_header(self, table: str) -> tuple[bytes, list[str]]:
        cached = self._avro_headers.get(table)
        if cached is None:
            import io

            import fastavro

            et = EVENT_TYPES[EVENT_FOR_TABLE[table]]
            # Packed ids go to their EPHEMERAL bytes column (PACKED_FIELDS): renamed here, the body unchanged.
            fields = [{**f, "name": f["name"] + RAW_SUFFIX} if f["name"] in PACKED_FIELDS else f
                      for f in et.schema_json["fields"]]
            schema = {**et.schema_json, "name": f"{et.name}HistoryRow", "fields": [
                {"name": "_topic", "type": "string"}, {"name": "_partition", "type": "int"},
                {"name": "_offset", "type": "long"}, *fields]}
            out = io.BytesIO()
            fastavro.writer(out, fastavro.parse_schema(schema), [], sync_marker=_SYNC)  # the header only
            cached = self._avro_headers[table] = (out.getvalue(), [f["name"] for f in schema["fields"]])
        return cached

    def insert_rejects(self, rows: list[list[Any]]) -> None:
        if rows:
            with self._lock:
                self.client.insert(f"{self.database}.{REJECTS}", rows,
                                   column_names=["_topic", "_partition", "_offset", "key", "raw", "error"])

    def stored_offsets(self, table: str, topic: str, partition: int, from_offset: int) -> set[int]:
        """Offsets of ``topic``/``partition`` from ``from_offset`` on already in ``table`` or in rejects."""
        where = f"_topic = {sql_literal(topic)} AND _partition = {int(partition)} AND _offset >= {int(from_offset)}"
        sql = (f"SELECT _offset FROM {self.database}.{table} WHERE {where} "
               f"UNION ALL SELECT _offset FROM {self.database}.{REJECTS} WHERE {where}")
        with self._lock:
            return {int(r[0]) for r in self.client.query(sql).result_rows}

    def query(self, sql: str, *, read_only: bool = True) -> QueryResult:
        """Run one query. Read-only ones (the default) go through the guard in streams.history.guard and run
        on a capped, read-only reader (NotReadOnly when refused, HistoryBusy when every reader is busy);
        ``read_only=False`` is for the store's own statements, on the sink's handle."""
        if read_only:
            return QueryResult(*self.readers.query(sql))
        with self._lock:
            result = self.client.query(sql)
        return QueryResult(list(result.column_names), [t.name for t in result.column_types],
                           [list(r) for r in result.result_rows])

    def command(self, sql: str) -> None:
        with self._lock:
            self.client.command(sql)

    def count(self, table: str, final: bool = False) -> int:
        with self._lock:
            return int(self.client.query(
                f"SELECT count() FROM {self.database}.{table}{' FINAL' if final else ''}").result_rows[0][0])


_SYNC = b"tabloop-history!"  # the container's 16-byte sync marker (any fixed value serves)
_ONE = b"\x02"  # a block's object count, 1, as an Avro long


def _avro_long(n: int) -> bytes:
    """An Avro int/long: zig-zag, then little-endian base-128."""
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _embedded(client) -> bool:
    """Is ``client`` a handle on the embedded engine (chdb)?"""
    return getattr(client, "path", None) is not None and str(getattr(client, "uri", "")).startswith("chdb://")


def _insert_from_file(client, table: str, names: list[str], parts: list) -> None:
    """An Avro insert into the embedded engine, from ``parts`` written to a file with writev.

    The engine reads inserts from a file in any case (clickhouse-connect writes ``raw_insert``'s block to
    one): written there straight from the messages' buffers, the batch is never joined into one more copy
    of itself first. 20k completions (108 MB): 72 ms to write this way against 140 ms joined and written,
    the insert as a whole 15–20 % less (`tabloop bench history`: 1.13–1.17× the rows/s)."""
    fd, path = tempfile.mkstemp(prefix=f"{os.getpid()}-", suffix=".avro", dir=_insert_files(client))
    try:
        with open(fd, "wb", buffering=0) as file:  # closed before the engine reads it
            _write_all(file.fileno(), parts)
        columns = ", ".join(f"`{n}`" for n in names)
        client.command(f"INSERT INTO {table} ({columns}) FROM INFILE {sql_literal(path)} FORMAT Avro")
    finally:
        os.unlink(path)


def _insert_files(client) -> Path:
    """The folder of the embedded engine's insert files, in its data directory."""
    folder = Path(client.path) / "tabloop-inserts"
    folder.mkdir(exist_ok=True)
    return folder


def _clear_insert_files_of_gone_processes(client) -> None:
    """Remove insert files a killed sink left behind. The embedded engine opens its directory in one process
    at a time, so a file not named by this process's id is of one that is gone."""
    for leftover in _insert_files(client).glob("*.avro"):
        if not leftover.name.startswith(f"{os.getpid()}-"):
            leftover.unlink(missing_ok=True)


def _write_all(fd: int, parts: list) -> None:
    """Write ``parts`` in order, up to 1024 buffers a writev (Linux's limit); a short write (rare for a file)
    is finished one write at a time."""
    for start in range(0, len(parts), 1024):
        chunk = parts[start:start + 1024]
        written = os.writev(fd, chunk)
        if written < sum(map(len, chunk)):
            rest = memoryview(b"".join(chunk))[written:]
            while rest:
                rest = rest[os.write(fd, rest):]


def _reader_connect(client) -> Callable[[], Any]:
    """How to open another handle like ``client``: for chdb, another handle on the same engine."""
    path = getattr(client, "path", None)
    if not _embedded(client):
        def refuse():
            raise HistoryError("read queries need their own connection: build the store with connect=…")
        return refuse
    import clickhouse_connect

    return lambda: clickhouse_connect.get_client(dsn=f"chdb://{path}")


def sql_literal(value: Any) -> str:
    """A value as a ClickHouse SQL literal (strings escaped, datetimes as UTC DateTime64)."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        ms = value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        return f"toDateTime64('{ms}', 3, 'UTC')"
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


# -- the sink --------------------------------------------------------------------------------------------


def catalog_topics() -> dict[str, str]:
    """topic → table for every topic of the catalog."""
    return {t.name: TABLE_FOR_EVENT[t.event_type] for t in CATALOG}


@dataclass
class SinkStats:
    """What the sink has done since it started: its status page (``tabloop history serve``) and its last log line."""

    batches: int = 0
    stored: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Rows stored, per table."""
    skipped_already_stored: int = 0
    """Messages found stored already (read again after a restart that came before their commit)."""
    rejects: int = 0
    """Messages that are not events of their topic's type, kept in the rejects table."""
    commit_failures: int = 0
    uncommitted_rows: int = 0
    """Stored since the last offset commit that went through: what a restart would read again and skip."""
    # Where the time goes: waiting for and reading messages, and storing them (the engine's inserts).
    polling_s: float = 0.0
    storing_s: float = 0.0

    def as_dict(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: round(value, 3) if isinstance(value, float) else dict(value) if isinstance(value, dict)
                else value for name, value in values.items()}


class HistorySink:
    """Consumes topics into the store: batched inserts, offsets committed after each stored batch."""

    def __init__(self, settings: Settings, store: HistoryStore, topics: Mapping[str, str] | None = None,
                 *, group_id: str = GROUP_ID, consumer=None, guard: StallGuard | None = None):
        self.settings = settings
        self.store = store
        # Ends the process when a Kafka or ClickHouse call never returns (`tabloop history` passes one).
        self.guard = guard
        self.topics = dict(topics or catalog_topics())
        unknown = set(self.topics.values()) - set(EVENT_FOR_TABLE)
        if unknown:
            raise HistoryError(f"no history table {', '.join(sorted(unknown))}; tables: {', '.join(EVENT_FOR_TABLE)}")
        self.batch_size = settings.history_batch_size
        self.batch_interval_s = settings.history_batch_interval_s
        # Static membership: a sink restarted after a crash takes its partitions back at once instead of
        # waiting out the dead member's session. The id names the store, so two sinks writing one store
        # fence each other rather than share its partitions.
        instance = hashlib.sha256(f"{settings.effective_clickhouse_url}|{store.database}|{group_id}".encode())
        self.consumer = consumer or EventConsumer(
            settings, group_id, list(self.topics), client_id="tabloop-history",
            # Topics made after the sink started are seen within seconds, not librdkafka's 5 minutes.
            overrides={"group.instance.id": f"tabloop-history-{instance.hexdigest()[:16]}",
                       "topic.metadata.refresh.interval.ms": 10_000, **PREFETCH})
        # Messages are polled undecoded: those written with their table's current schema go to the engine
        # as Avro (HistoryStore.insert_avro); only the others (older versions, rejects) are decoded here.
        self.codec = self.consumer.codec
        self.stats = SinkStats()
        # (topic, partition) → the offset the next message should have, and offsets known stored from there.
        self._expected: dict[tuple[str, int], int] = {}
        self._already: dict[tuple[str, int], set[int]] = {}

    def poll_batch(self, stop: threading.Event | None = None) -> list:
        """Up to ``batch_size`` messages, waiting at most ``batch_interval_s`` once the first arrived."""
        batch: list = []
        first_at = None
        while len(batch) < self.batch_size and not (stop and stop.is_set()):
            timeout = 0.5 if first_at is None else max(0.0, first_at + self.batch_interval_s - time.monotonic())
            errors: list = []
            with guarded(self.guard, "polling Kafka"):
                got = self.consumer.poll(min(self.batch_size - len(batch), 10_000), timeout_s=timeout,
                                         errors=errors, decode=False)
            if errors:  # a broker or topic problem: store what came, then let run() wait it out
                batch.extend(got)
                if batch:
                    log.error("Kafka: %s", errors[0].str())
                    return batch
                raise KafkaException(errors[0])
            if got and first_at is None:
                first_at = time.monotonic()
            batch.extend(got)
            if first_at is None and not got:
                return batch  # nothing arriving: let the caller check for stop
            if first_at is not None and time.monotonic() >= first_at + self.batch_interval_s:
                break
        return batch

    def store_batch(self, batch: list) -> dict[str, int]:
        """Insert what is not stored yet; return rows stored per table. Does not commit."""
        rows: dict[str, list[list[Any]]] = defaultdict(list)
        bulk: dict[str, list[tuple[Any, int]]] = defaultdict(list)
        rejects: list[list[Any]] = []
        counts: dict[str, int] = defaultdict(int)
        for r in batch:
            tp = (r.topic, r.partition)
            table = self.topics[r.topic]
            if self._expected.get(tp) != r.offset:
                # A jump (start, rebalance, redelivery): what from here on did an earlier run store?
                self._already[tp] = self.store.stored_offsets(table, r.topic, r.partition, r.offset)
            self._expected[tp] = r.offset + 1
            if r.offset in self._already.get(tp, ()):
                self.stats.skipped_already_stored += 1
                continue
            if r.event is None and r.error is None:  # polled undecoded
                at = self.codec.current_body_offset(r.value, EVENT_FOR_TABLE[table])
                if at is not None:
                    bulk[table].append((r, at))
                    continue
            self._row(r, table, rows, rejects)
        for table, messages in bulk.items():
            try:
                self.store.insert_avro(table, messages)
            except Exception as exc:
                # The engine refused a body (one the header vouched for is not a valid event): the batch
                # goes through the codec, which rejects exactly the bad messages. What the failed insert
                # may have written is found by offset and skipped, as after a crash.
                log.warning("bulk insert of %d rows into %s failed (%s); decoding them one by one",
                            len(messages), table, str(exc).splitlines()[0][:300])
                stored: dict[tuple[str, int], set[int]] = {}
                for r, _ in messages:
                    if (r.topic, r.partition) not in stored:
                        stored[(r.topic, r.partition)] = self.store.stored_offsets(
                            table, r.topic, r.partition, min(m.offset for m, _ in messages
                                                             if (m.topic, m.partition) == (r.topic, r.partition)))
                    if r.offset in stored[(r.topic, r.partition)]:
                        self.stats.skipped_already_stored += 1
                    else:
                        self._row(r, table, rows, rejects)
                continue
            self.stats.stored[table] += len(messages)
            counts[table] += len(messages)
        for table, table_rows in rows.items():
            try:
                self.store.insert(table, table_rows)
            except Exception as exc:  # the engine's message, with what was being stored
                first = table_rows[0]
                raise HistoryError(f"storing {len(table_rows)} rows into {self.store.database}.{table} failed "
                                   f"(first: {first[-3]}/{first[-2]}@{first[-1]}): {exc}") from exc
            self.stats.stored[table] += len(table_rows)
            counts[table] += len(table_rows)
        if rejects:
            log.error("%d messages are not events of their topic's type; kept in %s.%s (first: %s)",
                      len(rejects), self.store.database, REJECTS, rejects[0][5])
            self.store.insert_rejects(rejects)
            self.stats.rejects += len(rejects)
        return dict(counts)

    def _row(self, r, table: str, rows: dict[str, list[list[Any]]], rejects: list[list[Any]]) -> None:
        """Decode one message here (if polled undecoded): a row of its table, or a reject."""
        event, error = r.event, r.error
        if event is None and error is None:
            try:
                event = self.codec.decode(r.value)
            except EventDecodeError as exc:
                error = exc
        expected_type = EVENT_FOR_TABLE[table]
        if event is None or event.type != expected_type:
            error = (f"{type(error).__name__}: {error}" if error is not None
                     else f"a {event.type} event on a topic of {expected_type}")
            rejects.append([r.topic, r.partition, r.offset,
                            r.key.decode(errors="replace") if r.key is not None else None, r.value, error])
            return
        rows[table].append(self.store.row(table, event.record, r.topic, r.partition, r.offset))

    def step(self, stop: threading.Event | None = None) -> int:
        """One batch: poll, store, then commit. Returns the number of messages handled."""
        polling_from = time.monotonic()
        batch = self.poll_batch(stop)
        storing_from = time.monotonic()
        self.stats.polling_s += storing_from - polling_from
        if not batch:
            return 0
        rejects_before = self.stats.rejects
        with guarded(self.guard, f"storing {len(batch)} messages in ClickHouse"):
            stored = self.store_batch(batch)
        self.stats.storing_s += time.monotonic() - storing_from
        # Rows stored whose offsets Kafka does not have yet: what a crash right now would redeliver.
        self.stats.uncommitted_rows += sum(stored.values()) + self.stats.rejects - rejects_before
        try:
            with guarded(self.guard, f"committing the offsets of {len(batch)} stored messages to Kafka"):
                self.consumer.commit(batch)
            self.stats.uncommitted_rows = 0
        except KafkaException as exc:
            # Stored but not committed: the next batch's commit covers these offsets, and if none comes
            # before a restart, the restarted sink finds them stored and skips them.
            self.stats.commit_failures += 1
            if gave_up(exc):
                raise
            log.warning("offsets of a stored batch not committed (%s); a later commit covers them", exc)
        self.stats.batches += 1
        return len(batch)

    def run(self, stop: threading.Event, on_batch: Callable[[int], None] | None = None) -> None:
        """Batches until ``stop``; Kafka errors (a broker away, a topic not made yet) are waited out."""
        last_error = ""
        while not stop.is_set():
            held_partitions(self.guard, self.consumer)  # a rejoin that never ends: the guard ends the process
            try:
                n = self.step(stop)
            except KafkaException as exc:
                if gave_up(exc):
                    # A consumer librdkafka has given up on (e.g. fenced by its own rejoin after a broker
                    # outage) never consumes again: end, so that a restart begins with a new one. Nothing
                    # is lost: what was stored and not committed is found stored and skipped.
                    raise HistoryError(f"the Kafka consumer failed for good ({exc.args[0].str()}); restart "
                                       "the sink (the supervisor does)") from exc
                if str(exc) != last_error:  # each distinct problem once, not once a second
                    log.error("Kafka: %s; retrying", exc)
                    last_error = str(exc)
                stop.wait(1.0)
                continue
            last_error = ""
            if n and on_batch:
                on_batch(n)

    def close(self) -> None:
        self.consumer.close()
