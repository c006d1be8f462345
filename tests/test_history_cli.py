"""`tabloop sql` and `tabloop history token|schema` through the CLI."""

from __future__ import annotations

import json
import stat

import pytest
from click.testing import CliRunner

from tabloop.cli import main
from infra.kafka_broker import free_port
from streams.history.sql import HistoryServer
from tests.history_fixture import analytics_fixture, expected_analytics, insert_events, new_store


@pytest.fixture(scope="module")
def sink(tmp_path_factory):
    fx = analytics_fixture(seed=5, per_day=30, days=2)
    store = new_store()
    insert_events(store, fx.events)
    server = HistoryServer(store, "tlh_cli", "127.0.0.1", 0).start()
    env = {"TABLOOP_STATE_DIR": str(tmp_path_factory.mktemp("cli")), "TABLOOP_HISTORY_PORT": str(server.port),
           "TABLOOP_HISTORY_TOKEN": "tlh_cli", "TABLOOP_HISTORY_DATABASE": store.database}
    yield store, env, expected_analytics(fx)
    server.stop()


def sql(env, *args):
    return CliRunner().invoke(main, ["sql", *args], env=env)


def test_sql_prints_a_table_and_json_lines(sink):
    store, env, want = sink
    query = f"SELECT day, latency_p50 FROM {store.database}.latency_by_day ORDER BY day"
    r = sql(env, query)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split() == ["day", "latency_p50"] and lines[-1] == f"({len(want['latency_by_day'])} rows)"
    for day, row in want["latency_by_day"].items():
        assert any(line.split() == [day, str(row["latency_p50"])] for line in lines), (day, lines)

    r = sql(env, query, "--format", "json")
    assert r.exit_code == 0, r.output
    got = {row["day"]: row["latency_p50"] for row in map(json.loads, r.output.splitlines())}
    assert got == {d: row["latency_p50"] for d, row in want["latency_by_day"].items()}


def test_sql_refuses_writes_and_says_when_the_sink_is_down(sink):
    store, env, _ = sink
    r = sql(env, f"INSERT INTO {store.database}.weights SELECT * FROM {store.database}.weights")
    assert r.exit_code == 1 and "refused" in r.output and "not INSERT" in r.output
    r = sql(env, "SELECT nosuchcolumn FROM feedback")
    assert r.exit_code == 1 and "nosuchcolumn" in r.output
    r = sql({**env, "TABLOOP_HISTORY_TOKEN": "wrong"}, "SELECT 1")
    assert r.exit_code == 1 and "401" in r.output
    r = sql({**env, "TABLOOP_HISTORY_PORT": str(free_port())}, "SELECT 1")
    assert r.exit_code == 1 and "tabloop history" in r.output and "does not answer" in r.output


def test_history_token_is_made_once_and_private(tmp_path):
    env = {"TABLOOP_STATE_DIR": str(tmp_path)}
    first = CliRunner().invoke(main, ["history", "token"], env=env)
    second = CliRunner().invoke(main, ["history", "token"], env=env)
    assert first.exit_code == 0 and first.output == second.output and first.output.startswith("tlh_")
    mode = (tmp_path / "history.token").stat().st_mode
    assert stat.S_IMODE(mode) == 0o600


def test_history_schema_prints_what_the_sink_makes():
    r = CliRunner().invoke(main, ["history", "schema"], env={"TABLOOP_HISTORY_RETENTION_DAYS": "feedback=9"})
    assert r.exit_code == 0
    assert r.output.count("CREATE TABLE") == 7 and r.output.count("CREATE OR REPLACE VIEW") == 7
    assert "CREATE TABLE IF NOT EXISTS tabloop.gates (" in r.output  # the show-gate's versions
    assert "CREATE OR REPLACE VIEW tabloop.version_estimates AS" in r.output
    assert "TTL toDateTime(received_at) + INTERVAL 9 DAY" in r.output
    bad = CliRunner().invoke(main, ["history", "schema"], env={"TABLOOP_HISTORY_RETENTION_DAYS": "x=1"})
    assert bad.exit_code == 1 and "TABLOOP_HISTORY_RETENTION_DAYS" in bad.output


def test_dashboard_api_filters_by_project(sink):
    import httpx
    from collections import defaultdict

    store, env, want = sink
    url = f"http://127.0.0.1:{env['TABLOOP_HISTORY_PORT']}/api/dashboard"
    assert httpx.get(url).status_code == 401
    auth = {"Authorization": "Bearer tlh_cli"}
    assert httpx.get(url, params={"days": "x"}, headers=auth).status_code == 400
    project = "p-a"
    body = httpx.get(url, params={"project": project, "days": 30}, headers=auth).json()
    shown = defaultdict(int)
    for (day, p, _), row in want["shown_vs_accepted"].items():
        if p == project:
            shown[day] += row["shown"]
    assert {r["day"]: r["shown"] for r in body["shown"]} == shown
    decided = defaultdict(lambda: [0, 0])
    for (v, day, _, p, _), row in want["acceptance"].items():
        if p == project and v is not None:
            decided[(v, day)][0] += row["accepted"]
            decided[(v, day)][1] += row["accepted"] + row["rejected"]
    expected = {k: round(a / n, 6) if n else None for k, (a, n) in decided.items()}  # None: only IGNORED
    assert {(r["policy_version"], r["day"]): r["acceptance_rate"] for r in body["acceptance"]} == expected
