"""The history tables and views (embedded ClickHouse) against numbers worked out in Python."""

from __future__ import annotations

import pytest

from infra.settings import parse_retention
from streams.history.sink import NotReadOnly, clickhouse_type, sql_literal, table_ddl
from tests.history_fixture import analytics_fixture, expected_analytics, insert_events, new_store


@pytest.fixture(scope="module")
def loaded():
    fx = analytics_fixture()
    store = new_store()
    insert_events(store, fx.events)
    # The same events again, as a redelivery would store them: the views must count each once.
    insert_events(store, fx.completions[:50] + fx.episodes[:50])
    return store, fx, expected_analytics(fx)


def _day(v) -> str:
    return v.isoformat() if hasattr(v, "isoformat") else str(v)


def test_avro_types_map_to_exact_columns():
    assert clickhouse_type("long") == "Int64"
    assert clickhouse_type(["null", "string"]) == "Nullable(String)"
    assert clickhouse_type({"type": "array", "items": "float"}) == "Array(Float32)"
    assert clickhouse_type({"type": "map", "values": "double"}) == "Map(String, Float64)"
    assert clickhouse_type({"type": "long", "logicalType": "timestamp-millis"}) == "DateTime64(3, 'UTC')"
    with pytest.raises(ValueError, match="unions of null and one type"):
        clickhouse_type(["null", "string", "long"])
    ddl = table_ddl("db", "episodes", 30)
    assert "ReplacingMergeTree" in ddl and "PARTITION BY toDate(joined_at)" in ddl
    assert "ORDER BY (project_id, event_id)" in ddl and "INTERVAL 30 DAY" in ddl
    assert "TTL" not in table_ddl("db", "weights", 0)


def test_retention_spec_errors_name_the_part():
    assert parse_retention("completions=7, episodes=0") == {"completions": 7, "episodes": 0}
    with pytest.raises(ValueError, match="'bogus=3'"):
        parse_retention("bogus=3")
    with pytest.raises(ValueError, match="whole number"):
        parse_retention("feedback=x")


def test_only_reading_statements_pass():
    # The guard is the engine's own parse (tests/test_sql_guard.py has the attacks); these are the basics.
    store = new_store()
    assert store.query("  -- why\n SELECT 1; ").rows == [[1]]
    assert store.query("WITH 1 AS x SELECT x").rows == [[1]]
    assert store.query("SELECT ';' AS semicolon").rows == [[";"]]
    for bad, why in [("DROP TABLE x", "not DROP"), ("INSERT INTO t VALUES (1)", "not INSERT"),
                     ("SELECT 1; DROP TABLE x", "one statement"), ("", "empty"), ("/* x */", "empty")]:
        with pytest.raises(NotReadOnly, match=why):
            store.query(bad)
    assert sql_literal("it's \\ here") == "'it\\'s \\\\ here'"


def test_engine_refuses_writes_and_the_session_stays_writable():
    store = new_store()
    fx = analytics_fixture(per_day=2, days=1)
    # The readonly setting store.query puts on every SELECT: the engine refuses a write under it ...
    with pytest.raises(Exception, match="(?i)readonly"):
        store.client.command(f"INSERT INTO {store.database}.weights SELECT * FROM {store.database}.weights "
                             "SETTINGS readonly = 2")
    with pytest.raises(NotReadOnly, match=r"file\(\)"):
        store.query("SELECT * FROM file('/etc/passwd')")
    assert store.query("SELECT 'file(x)' AS s").rows == [["file(x)"]]
    # ... and after read-only queries the sink's session still writes.
    assert store.query(f"SELECT count() FROM {store.database}.feedback").rows == [[0]]
    insert_events(store, fx.completions)
    assert store.count("completions") == len(fx.completions)


def test_tables_hold_each_event_once(loaded):
    store, fx, _ = loaded
    assert store.count("completions", final=True) == len(fx.completions)
    assert store.count("episodes", final=True) == len(fx.episodes)
    assert store.count("feedback", final=True) == len(fx.feedback)
    # the raw rows include the 100 redelivered copies; FINAL folds them
    assert store.count("completions") + store.count("episodes") == len(fx.completions) + len(fx.episodes) + 100


def test_acceptance_by_version_matches_python(loaded):
    store, _, want = loaded
    got = {}
    for r in store.query(f"SELECT * FROM {store.database}.acceptance_by_version").records():
        got[(r["policy_version"], _day(r["day"]))] = {k: r[k] for k in
                                                     ("episodes", "accepted", "rejected", "ignored", "gate_hidden", "acceptance_rate")}
    assert got == want["acceptance_by_version"]
    assert len(got) >= 8  # versions × days: a real breakdown, not one group


def test_acceptance_breakdown_by_language_project_user_matches_python(loaded):
    store, _, want = loaded
    got = {}
    for r in store.query(f"SELECT * FROM {store.database}.acceptance").records():
        key = (r["policy_version"], _day(r["day"]), r["language"], r["project_id"], r["user_id"])
        got[key] = {k: r[k] for k in ("episodes", "accepted", "rejected", "ignored", "gate_hidden", "acceptance_rate")}
    assert got == want["acceptance"]
    assert {k[2] for k in got} >= {"python", "typescript", "go", "rust", "other", "unknown"}


def test_shown_vs_accepted_matches_python(loaded):
    store, _, want = loaded
    got = {(_day(r["day"]), r["project_id"], r["policy_version"]):
           {k: r[k] for k in ("served", "shown", "accepted", "rejected", "gate_hidden")}
           for r in store.query(f"SELECT * FROM {store.database}.shown_vs_accepted").records()}
    assert got == want["shown_vs_accepted"]


def test_latency_percentiles_match_python(loaded):
    store, _, want = loaded
    got = {_day(r["day"]): {k: r[k] for k in ("completions", "latency_p50", "latency_p90", "latency_p99", "ttft_p50")}
           for r in store.query(f"SELECT * FROM {store.database}.latency_by_day").records()}
    assert got == want["latency_by_day"]
    per_version = store.query(f"SELECT sum(completions) FROM {store.database}.latency").rows[0][0]
    assert per_version == sum(v["completions"] for v in want["latency_by_day"].values())


def test_reward_by_version_matches_python(loaded):
    store, _, want = loaded
    got = {(r["policy_version"], _day(r["day"])): {"episodes": r["episodes"], "reward_mean": r["reward_mean"]}
           for r in store.query(f"SELECT * FROM {store.database}.reward_by_version").records()}
    assert got == want["reward_by_version"]


def test_retention_is_set_per_table_and_changes_in_place():
    store = new_store({"completions": 90, "episodes": 0})
    create = store.query(f"SHOW CREATE TABLE {store.database}.completions").rows[0][0]
    assert "toIntervalDay(90)" in create
    assert "TTL" not in store.query(f"SHOW CREATE TABLE {store.database}.episodes").rows[0][0]
    store.retention = {"completions": 7, "episodes": 365}
    actions = store.ensure_schema()
    assert "completions: retention 90 -> 7 days" in actions and "episodes: retention forever -> 365 days" in actions
    assert "toIntervalDay(7)" in store.query(f"SHOW CREATE TABLE {store.database}.completions").rows[0][0]
    assert store.ensure_schema() == []  # nothing left to change
