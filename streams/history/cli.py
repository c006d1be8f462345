"""`tabloop history`, `tabloop sql`, `tabloop replay`, `tabloop bench history`."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

import click

from infra.bus import broker_answers
from infra.errors import TabloopError
from infra.local import endpoints
from infra.settings import settings_of
from infra.stall_guard import StallGuard
from rewards.spec import RewardSpecs
from streams.history.bench import bench_history as run_bench_history
from streams.history.replay import Selection, parse_offset, replay as run_replay
from streams.history.sink import (EVENT_FOR_TABLE, GROUP_ID, HistoryError, HistorySink, HistoryStore, parse_retention,
                                  rejects_ddl, table_ddl, view_ddls)
from streams.history.sql import HistoryServer, SqlClient, SqlError, format_table, history_token

log = logging.getLogger("tabloop.history")



def _fail(message: str):
    raise TabloopError(message)


def _topic_map(pairs: tuple[str, ...]) -> dict[str, str] | None:
    if not pairs:
        return None
    out = {}
    for pair in pairs:
        topic, sep, table = pair.partition("=")
        if not sep or not topic or not table:
            _fail(f"--topic wants TOPIC=TABLE, got {pair!r}")
        out[topic] = table
    return out


@click.group(invoke_without_command=True)
@click.option("--topic", "topics", multiple=True, metavar="TOPIC=TABLE",
              help="Consume these topics instead of the catalog's (e.g. a replay topic into a scratch database).")
@click.option("--group", "group_id", default=None, help="Consumer group (default tabloop-history).")
@click.pass_context
def history(ctx: click.Context, topics: tuple[str, ...], group_id: str | None) -> None:
    """The history sink: every topic into ClickHouse; read-only SQL and the dashboard over HTTP."""
    if ctx.invoked_subcommand is not None:
        return

    s = settings_of(ctx)
    try:
        store = HistoryStore.from_settings(s)
        for action in store.ensure_schema():
            click.echo(action)
    except HistoryError as exc:
        _fail(str(exc))
    # A call that never returns (librdkafka's commit after a broker restart) ends the process for a fresh start.
    guard = StallGuard("tabloop history", s.stall_limit_s).start()
    sink = HistorySink(s, store, _topic_map(topics), group_id=group_id or GROUP_ID, guard=guard)
    token = history_token(s, create=True)
    try:
        server = HistoryServer(store, token, s.history_host, s.history_port, status=sink.stats.as_dict,
                               header_timeout_s=s.header_timeout_s, body_timeout_s=s.body_timeout_s).start()
    except OSError as exc:
        sink.close()
        _fail(f"cannot listen on {s.history_host}:{s.history_port}: {exc} (TABLOOP_HISTORY_PORT)")
    click.echo(f"tabloop history: {', '.join(sink.topics)} -> {s.effective_clickhouse_url} "
               f"(database {store.database}); SQL {server.url}/sql", err=False)
    # Not the token: this line goes to history.log and the supervisor's log. The URL with its token is printed to
    # the terminal only, by `tabloop history token --url` and `tabloop up`.
    click.echo(f"dashboard {server.url}/ (its token: `tabloop history token --url` prints the URL with it)")
    sys.stdout.flush()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        sink.run(stop)
    except HistoryError as exc:  # nothing committed past what was stored: a restart resumes from here
        _fail(str(exc))
    finally:
        with guard.call("closing the Kafka consumer"):
            sink.close()  # after the last batch was stored and committed
        server.stop()
        click.echo(f"history sink stopped: {json.dumps(sink.stats.as_dict())}")


@history.command("token")
@click.option("--url", "as_url", is_flag=True, help="Print the dashboard's URL with the token in it instead.")
@click.pass_context
def history_token_cmd(ctx: click.Context, as_url: bool) -> None:
    """Print the Bearer token of the SQL server and the dashboard (made once if missing)."""
    s = settings_of(ctx)
    token = history_token(s, create=True)
    click.echo(f"{endpoints(s)['history']}/#token={token}" if as_url else token)


@history.command("schema")
@click.pass_context
def history_schema(ctx: click.Context) -> None:
    """Print the CREATE statements of the tables and views (what the sink makes)."""
    s = settings_of(ctx)
    retention = parse_retention(s.history_retention_days)
    for table in EVENT_FOR_TABLE:
        click.echo(table_ddl(s.history_database, table, retention.get(table, 0)) + ";\n")
    click.echo(rejects_ddl(s.history_database) + ";\n")
    for name, select in view_ddls(s.history_database).items():
        click.echo(f"CREATE OR REPLACE VIEW {s.history_database}.{name} AS{select};\n")


@click.command()
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True,
              help="table: aligned text; json: one JSON object per row.")
@click.pass_context
def sql(ctx: click.Context, query: str, fmt: str) -> None:
    """Run one read-only query (SELECT, WITH, SHOW, DESCRIBE, EXPLAIN) against the history.

    Tables and views live in the database TABLOOP_HISTORY_DATABASE (tabloop), e.g.
    `tabloop sql "SELECT * FROM tabloop.acceptance_by_version"`.
    """
    try:
        result = SqlClient(settings_of(ctx)).query(query)
    except SqlError as exc:
        _fail(str(exc))
    if fmt == "json":
        for row in result.records():
            click.echo(json.dumps(row, default=str))
    else:
        click.echo(format_table(result))


def _when(text: str | None):
    if text is None:
        return None

    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        _fail(f"expected an ISO-8601 time such as 2026-11-30 or 2026-11-30T12:00:00Z, got {text!r}")
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


@click.command()
@click.option("--to", "topic", default=None, help="Topic the episodes go to (made if missing); not a catalog topic.")
@click.option("--dry-run", is_flag=True, help="Derive and count the episodes, publish nothing.")
@click.option("--source", type=click.Choice(["clickhouse", "kafka"]), default="clickhouse", show_default=True)
@click.option("--since", default=None, help="Event time from (ISO-8601, UTC unless it says).")
@click.option("--until", default=None, help="Event time before (ISO-8601).")
@click.option("--project", "projects", multiple=True, help="Only these projects (repeatable).")
@click.option("--policy-version", "versions", type=int, multiple=True,
              help="Keep episodes of these policy versions (repeatable).")
@click.option("--offset", "offsets", multiple=True, metavar="TOPIC:PARTITION:OFFSET",
              help="Start this partition here (repeatable); other partitions start at their beginning.")
@click.option("--reward-spec", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Reward specs YAML (default: TABLOOP_REWARD_SPEC_FILE, else the built-in spec).")
@click.pass_context
def replay(ctx: click.Context, topic: str | None, dry_run: bool, source: str, since: str | None, until: str | None,
           projects: tuple[str, ...], versions: tuple[int, ...], offsets: tuple[str, ...],
           reward_spec: str | None) -> None:
    """Re-derive episodes from history (ClickHouse or the Kafka topics) with the current reward spec.

    Prints a summary; its last line is JSON.
    """
    if not dry_run and not topic:
        _fail("say where the episodes go with --to TOPIC (or --dry-run)")
    try:
        start = dict(parse_offset(o) for o in offsets)
        specs = RewardSpecs.from_yaml(Path(reward_spec)) if reward_spec else None
        selection = Selection(_when(since), _when(until), tuple(projects), tuple(versions), start)
        summary = run_replay(settings_of(ctx), source, selection, None if dry_run else topic, specs)
    except (ValueError, SqlError) as exc:
        _fail(str(exc))
    except Exception as exc:  # Kafka down, publish failures: say so without a traceback
        _fail(f"replay failed: {type(exc).__name__}: {exc}")
    click.echo(json.dumps(summary, sort_keys=True))


@click.command("history")
@click.option("--events", "n", type=click.IntRange(min=1000), default=120_000, show_default=True,
              help="Events through Kafka into the sink (completions, feedback, episodes in equal parts); six "
                   "batches of the default TABLOOP_HISTORY_BATCH_SIZE, of which the first is not timed.")
@click.option("--episodes", type=click.IntRange(min=1000), default=1_000_000, show_default=True,
              help="Episodes in the table the acceptance query runs over.")
@click.pass_context
def bench_history(ctx: click.Context, n: int, episodes: int) -> None:
    """Rows/s stored by the sink (broker → embedded ClickHouse) and the acceptance-by-version query time."""
    s = settings_of(ctx)
    if n <= 2 * s.history_batch_size:
        # The first batch waits for the consumer group to form and is not timed: with fewer events than
        # that the rate would be of one or two batches, or of nothing at all (it printed 0 rows/s).
        _fail(f"--events {n} is too few to time the sink: give more than twice TABLOOP_HISTORY_BATCH_SIZE "
              f"({s.history_batch_size}), e.g. --events {max(120_000, 6 * s.history_batch_size)}")
    if not broker_answers(s):
        _fail(f"no Kafka answers on {s.kafka_bootstrap}: run `tabloop kafka start` first")
    run_bench_history(s, n, episodes)
