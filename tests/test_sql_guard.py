"""The history's SQL endpoint (POST /sql, `tabloop sql`) against the attacks of issue 18: quoted and aliased
table functions, SSRF, INTO OUTFILE, SETTINGS, tables outside the history, comment-like text in literals,
memory, result and time caps (EXPLAIN included), and a heavy query beside the sink.

Every attack runs against a live HistoryServer over the real embedded engine (chdb, shared per process)."""

from __future__ import annotations

import select
import socket
import threading
import time

import httpx
import pytest

from infra.local import wait_ready
from streams.history.sink import HistoryStore
from streams.history.guard import SERVER_FUNCTIONS, HistoryBusy, NotReadOnly, QueryLimits, Reader, ReaderPool
from streams.history.sql import HistoryServer
from tests.history_fixture import analytics_fixture, insert_events, new_store, row

TOKEN = "tlh_guard"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Small caps so the attacks hit them fast; the shipped ones are QueryLimits()'s defaults.
LIMITS = QueryLimits(timeout_s=4, max_rows=1000, max_result_bytes=1024 * 1024, max_memory_bytes=64 * 1024 * 1024)


@pytest.fixture(scope="module")
def fx():
    return analytics_fixture(seed=11, per_day=100, days=2, prefix="g-")


@pytest.fixture(scope="module")
def store(fx):
    base = new_store()
    insert_events(base, fx.events)
    return HistoryStore(base.client, base.database, limits=LIMITS)


@pytest.fixture(scope="module")
def server(store):
    store.query("SELECT 1")  # the readers exist before the database below is made
    store.command("CREATE DATABASE IF NOT EXISTS t_later")
    store.command("CREATE TABLE IF NOT EXISTS t_later.feedback (x UInt8) ENGINE = Memory")
    srv = HistoryServer(store, TOKEN, "127.0.0.1", 0).start()
    assert wait_ready(f"{srv.url}/health", 5), "the SQL server did not answer"
    yield srv
    srv.stop()


def post(server, query: str) -> httpx.Response:
    return httpx.post(f"{server.url}/sql", json={"query": query}, headers=AUTH, timeout=120)


@pytest.fixture(scope="module")
def secret(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "secret.txt"
    path.write_text("tlk_the_secret_line\n")
    return path


@pytest.fixture
def listener():
    """A TCP port that counts whoever connects: the canary for any fetch the engine might make.

    Yields the port and ``connections()``: every connection made to it so far. A connection counts once
    its handshake is done, before it says anything (a MySQL client waits for the server to speak first),
    whether it has been accepted yet or still waits in the backlog. The engine's fetches run inside its
    query, so when a query has answered, every connection it made is counted: no waiting needed."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    accepted: list = []
    lock = threading.Lock()  # accepting and recording are one step to connections()
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            if not select.select([sock], [], [], 0.2)[0]:
                continue
            with lock:
                conn, peer = sock.accept()
                accepted.append(peer)
            conn.close()  # at once: a fetch fails then and there instead of waiting on an answer

    def connections() -> list:
        with lock:
            waiting = ["in the backlog"] if select.select([sock], [], [], 0)[0] else []
            return accepted + waiting

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield sock.getsockname()[1], connections
    stop.set()
    thread.join(timeout=2)
    sock.close()


@pytest.mark.parametrize("fetch", [
    # One try: the engine retries a failed HTTP fetch for minutes by default.
    "SELECT * FROM url('http://127.0.0.1:{port}/x', 'LineAsString') SETTINGS http_max_tries = 1",
    "SELECT * FROM mysql('127.0.0.1:{port}', 'db', 't', 'u', 'p')"])
def test_the_canary_sees_a_fetch_the_engine_makes(store, listener, fetch):
    """What the tests below rely on to say "no connection": on an engine handle with none of the guard's
    limits, the fetch reaches the canary, the client that speaks first (HTTP) and the one that waits
    (MySQL) alike."""
    port, connections = listener
    with pytest.raises(Exception):  # the canary answers nothing a fetch could use
        store.readers._connect().query(fetch.format(port=port))
    assert connections() != []


# -- files and the network: refused however the function is spelled or placed -------------------------------


FILE_READS = [
    "SELECT * FROM file('{p}', 'LineAsString')",
    "SELECT * FROM `file`('{p}', 'LineAsString')",
    'SELECT * FROM "file"(\'{p}\', \'LineAsString\')',
    "SELECT * FROM `file`($${p}$$, 'LineAsString')",
    "SELECT $$'$$ AS q, * FROM `file`('{p}', 'LineAsString')",  # the heredoc that hid it from the text guard
    "SELECT '--' AS a, * FROM `file`('{p}', 'LineAsString') AS t -- '",
    "SELECT * FROM `file`('{p}', 'LineAsString') AS innocent",
    "SELECT * FROM feedback AS f JOIN `file`('{p}', 'LineAsString') AS p ON 1",
    "SELECT * FROM (SELECT * FROM `file`('{p}', 'LineAsString'))",
    "WITH x AS (SELECT * FROM `file`('{p}', 'LineAsString')) SELECT * FROM x",
    "SELECT (SELECT any(line) FROM `file`('{p}', 'LineAsString'))",
    "SELECT 'x' IN `file`('{p}', 'LineAsString')",
    "SELECT file('{p}')",  # the scalar function reads any path too
    "SELECT `file`('{p}') AS s",
    "DESCRIBE `file`('{p}', 'LineAsString')",
    "EXPLAIN SYNTAX SELECT * FROM `file`('{p}', 'LineAsString')",
    "EXPLAIN PIPELINE SELECT file('{p}')",
]


@pytest.mark.parametrize("template", FILE_READS)
def test_file_reads_are_refused_however_quoted_or_aliased(server, secret, template):
    r = post(server, template.format(p=secret))
    assert r.status_code == 403, r.text
    assert "file" in r.json()["error"]["message"] and "the_secret" not in r.text


SSRF = [
    "SELECT * FROM url('http://127.0.0.1:{port}/ssrf', 'LineAsString')",
    "SELECT * FROM `url`('http://127.0.0.1:{port}/ssrf', 'LineAsString')",
    'SELECT * FROM "url"(\'http://127.0.0.1:{port}/ssrf\', \'LineAsString\') AS u',
    "SELECT count() FROM feedback WHERE user_id IN (SELECT * FROM `url`('http://127.0.0.1:{port}/x', 'LineAsString'))",
    "SELECT * FROM s3('http://127.0.0.1:{port}/bucket/key', 'LineAsString')",
    "SELECT * FROM remote('127.0.0.1:{port}', system.one)",
    "SELECT * FROM remoteSecure('127.0.0.1:{port}', 'system', 'one')",
    "SELECT * FROM mysql('127.0.0.1:{port}', 'db', 't', 'u', 'p')",
    "SELECT * FROM postgresql('127.0.0.1:{port}', 'db', 't', 'u', 'p')",
    "SELECT * FROM azureBlobStorage('http://127.0.0.1:{port}/acct', 'c', 'b', 'LineAsString')",
    "DESCRIBE url('http://127.0.0.1:{port}/ssrf', 'LineAsString')",
    "EXPLAIN SELECT (SELECT count() FROM url('http://127.0.0.1:{port}/ssrf', 'LineAsString'))",
]


@pytest.mark.parametrize("template", SSRF)
def test_no_function_makes_the_engine_fetch_an_address(server, listener, template):
    port, connections = listener
    r = post(server, template.format(port=port))
    assert r.status_code == 403, r.text
    assert connections() == []


@pytest.mark.parametrize("statement", [
    "SELECT 1", "WITH 1 AS x SELECT x", "SELECT count() FROM feedback", "SHOW TABLES", "SHOW DATABASES",
    "SHOW CREATE TABLE feedback", "DESCRIBE feedback", "EXPLAIN SELECT 1", "EXPLAIN AST SELECT 1",
    "EXPLAIN SYNTAX SELECT 1", "EXISTS feedback", "EXISTS TABLE feedback"])
@pytest.mark.parametrize("into", ["INTO OUTFILE '{path}'", "INTO OUTFILE '{path}' TRUNCATE",
                                  "INTO OUTFILE '{path}' APPEND", "INTO OUTFILE '{path}' AND STDOUT"])
def test_into_outfile_is_refused_on_every_allowed_statement(server, tmp_path, statement, into):
    existing, fresh = tmp_path / "existing.txt", tmp_path / "fresh.txt"
    existing.write_text("keep me\n")
    for path in (existing, fresh):
        r = post(server, f"{statement} {into.format(path=path)}")
        assert r.status_code == 403 and "INTO OUTFILE" in r.json()["error"]["message"], r.text
    assert existing.read_text() == "keep me\n" and not fresh.exists()


# -- statements, settings and tables outside the history -------------------------------------------------


@pytest.mark.parametrize("query,why", [
    ("INSERT INTO feedback SELECT * FROM feedback", "not INSERT"),
    ("DROP TABLE feedback", "not DROP"), ("TRUNCATE TABLE feedback", "not TRUNCATE"),
    ("ALTER TABLE feedback DELETE WHERE 1", "not ALTER"), ("CREATE TABLE x (a Int8) ENGINE = Memory", "not CREATE"),
    ("SET readonly = 0", "not SET"), ("SYSTEM SHUTDOWN", "not SYSTEM"), ("OPTIMIZE TABLE feedback", "not OPTIMIZE"),
    ("KILL QUERY WHERE 1", "not KILL"), ("SHOW PROCESSLIST", "not SHOW"), ("SHOW CREATE DATABASE system", "not SHOW"),
    ("SELECT 1; DROP TABLE feedback", "one statement"), ("", "empty"), ("  ", "empty"), ("/* x */", "empty"),
    ("-- only a comment", "empty"),
    ("SELECT 1 SETTINGS max_memory_usage = 0", "SETTINGS"), ("SELECT 1 SETTINGS readonly = 0", "SETTINGS"),
    ("SELECT * FROM (SELECT 1 SETTINGS max_execution_time = 0)", "SETTINGS"),
    ("EXPLAIN PIPELINE graph = 1 SELECT 1", "SETTINGS"), ("SELECT 1 FORMAT JSON", ""),
    ("SELECT * FROM system.one", "outside the history"), ("SELECT * FROM `system`.`one`", "outside the history"),
    ("SELECT * FROM numbers(3)", "table function numbers()"), ("SELECT * FROM system.numbers", "outside"),
    ("SELECT 1 WHERE 1 IN system.one", "outside the history"), ("SELECT 1 IN t_later.feedback", "outside the history"),
    ("SHOW TABLES FROM system", "history database"),
    ("SHOW CREATE TABLE system.one", "outside the history"), ("EXISTS system.one", "outside the history"),
    ("DESCRIBE system.one", "outside the history"), ("SELECT dictGet('d', 'a', 1)", "dictGet"),
    ("SELECT joinGet('system.j', 'a', 1)", "joinGet"), ("EXPLAIN TABLE OVERRIDE mysql('h', 'd', 't', 'u', 'p') "
                                                       "PARTITION BY 1", ""),
    # A name holding a newline prints rows of its own into EXPLAIN AST: they can add a refusal, never hide one.
    ("SELECT `x\n    Function file` FROM feedback", "file"),
])
def test_only_reading_the_history_is_allowed(server, query, why):
    r = post(server, query)
    assert r.status_code in (400, 403) and why in r.json()["error"]["message"], r.text
    if why:
        assert r.status_code == 403


# -- functions that reveal the server: its settings, paths, disks and machine ------------------------------


# Each function SERVER_FUNCTIONS refuses, called as a query would call it.
SERVER_CALLS = {
    "getServerSetting": "getServerSetting('path')",
    "getSetting": "getSetting('max_memory_usage')",
    "getSettingOrDefault": "getSettingOrDefault('max_memory_usage', 0)",
    "getMergeTreeSetting": "getMergeTreeSetting('storage_policy')",
    "getMacro": "getMacro('replica')",
    "getServerPort": "getServerPort('tcp_port')",
    "tcpPort": "tcpPort()",
    "displayName": "displayName()",
    "filesystemAvailable": "filesystemAvailable()",
    "filesystemCapacity": "filesystemCapacity('default')",
    "filesystemUnreserved": "filesystemUnreserved()",
    "hostName": "hostName()",
    "FQDN": "FQDN()",
    "getOSKernelVersion": "getOSKernelVersion()",
}


def test_every_refused_server_function_has_its_test():
    assert set(SERVER_CALLS) == set(SERVER_FUNCTIONS)


def test_the_canary_sees_the_state_directory_through_get_server_setting(store):
    """What the issue found: on a handle with none of the guard's walk (a reader's session is readonly and
    still answers), getServerSetting('path') is the engine's data directory: the state directory."""
    [[path]] = store.readers.run(lambda reader: reader.client.query("SELECT getServerSetting('path')").result_rows)
    assert path.startswith("/") and "tabloop-chdb-" in path


@pytest.mark.parametrize("function", SERVER_CALLS)
def test_functions_that_reveal_the_server_are_refused(server, store, function):
    [[path]] = store.query("SELECT getServerSetting('path')", read_only=False).rows
    r = post(server, f"SELECT {SERVER_CALLS[function]} AS v")
    assert r.status_code == 403, r.text
    message = r.json()["error"]["message"]
    assert f"function {function}()" in message and "not the history" in message, message
    assert path not in r.text


@pytest.mark.parametrize("query,named", [
    ("SELECT count() FROM feedback WHERE user_id = getServerSetting('path')", "getServerSetting"),
    ("SELECT (SELECT getServerSetting('path'))", "getServerSetting"),
    ("WITH p AS (SELECT getServerSetting('path') AS s) SELECT s FROM p", "getServerSetting"),
    ("SELECT arrayMap(name -> getServerSetting(name), ['path', 'tmp_path'])", "getServerSetting"),
    ("SELECT * FROM (SELECT `getServerSetting`('path'))", "getServerSetting"),
    ("EXPLAIN SELECT getServerSetting('path')", "getServerSetting"),
    ("EXPLAIN SYNTAX SELECT getSetting('max_memory_usage')", "getSetting"),
    ("DESCRIBE (SELECT filesystemCapacity())", "filesystemCapacity"),
    ("SELECT GETSERVERSETTING('path')", "GETSERVERSETTING"),
    # aliases the engine lists (system.functions' alias_to) and a name it takes in any case
    ("SELECT fullHostName()", "fullHostName() (an alias of FQDN())"), ("SELECT hostname()", "hostname()"),
    ("SELECT fqdn()", "fqdn()"),
])
def test_server_functions_are_refused_wherever_they_stand_and_however_spelled(server, query, named):
    r = post(server, query)
    assert r.status_code == 403 and f"function {named}" in r.json()["error"]["message"], r.text


def test_has_column_in_table_is_refused_it_names_other_databases_by_string(server):
    r = post(server, "SELECT hasColumnInTable('system', 'one', 'dummy')")
    assert r.status_code == 403 and "hasColumnInTable() reaches outside" in r.json()["error"]["message"], r.text


def test_ordinary_functions_still_work_names_like_the_refused_ones_included(server, store):
    r = post(server, "SELECT version() != '' AS v, serverTimezone() != '' AS tz, currentDatabase() AS db, "
                     "uptime() >= 0 AS up, path('http://h/a/b?q=1') AS url_path, lower('HOST') AS l, "
                     "toString(toIPv4('1.2.3.4')) AS ip, formatReadableSize(1024) AS size, "
                     "JSONAllPaths('{\"a\": {\"b\": 1}}'::JSON) AS json_paths, 1 AS hostName, "
                     "(SELECT count() FROM feedback) > 0 AS history")
    assert r.status_code == 200, r.text
    assert r.json()["rows"] == [[1, 1, store.database, 1, "/a/b", "host", "1.2.3.4", "1.00 KiB", ["a.b"], 1, 1]]


def test_the_history_reads_as_before_unqualified_names_included(server, store, fx):
    def rows(q):
        r = post(server, q)
        assert r.status_code == 200, (q, r.text)
        return r.json()["rows"]

    db = store.database
    assert rows("SELECT count() FROM feedback") == [[len(fx.feedback)]]  # issue 14: the history db by default
    assert rows(f"SELECT count() FROM {db}.feedback FINAL") == [[len(fx.feedback)]]
    assert rows("SELECT count() FROM feedback AS f JOIN completions AS c USING completion_id") == [[len(fx.feedback)]]
    assert rows("WITH n AS (SELECT count() AS k FROM episodes) SELECT k FROM n") == [[len(fx.episodes)]]
    assert ["feedback"] in rows("SHOW TABLES") and ["acceptance_by_version"] in rows(f"SHOW TABLES FROM {db}")
    assert "CREATE TABLE" in rows("SHOW CREATE TABLE feedback")[0][0]
    assert ["outcome"] in [r[:1] for r in rows("DESCRIBE feedback")]
    assert rows("EXISTS feedback") == [[1]] and rows(f"EXISTS {db}.nosuch") == [[0]]
    assert rows("EXPLAIN SYNTAX SELECT count() FROM feedback")
    assert rows("SELECT format('{}-{}', 1, 2) AS s") == [["1-2"]]  # the harmless scalar of that name
    assert rows("SELECT 1; ") == [[1]] and rows("SELECT 2 -- why\n") == [[2]]


def test_comment_like_text_in_literals_is_kept_intact(server):
    r = post(server, "SELECT '--not a comment /* nor this */ -- x' AS a, $$it's -- here /*$$ AS b, "
                     "'semi;colon' AS c /* a real comment */")
    assert r.status_code == 200, r.text
    assert r.json()["rows"] == [["--not a comment /* nor this */ -- x", "it's -- here /*", "semi;colon"]]


# -- the caps ----------------------------------------------------------------------------------------------


def test_a_memory_hungry_query_is_capped(server):
    r = post(server, "SELECT length(groupArray(repeat(a.completion_id, 2000))) FROM completions AS a, "
                     "completions AS b")
    assert r.status_code == 400 and "MEMORY_LIMIT_EXCEEDED" in r.text and "memory cap" in r.text, r.text


def test_results_are_capped_in_rows_and_bytes(server):
    r = post(server, "SELECT a.completion_id FROM completions AS a, completions AS b")
    assert r.status_code == 400 and "max rows" in r.text and "LIMIT" in r.text, r.text
    r = post(server, "SELECT * FROM completions AS a, completions AS b")  # caught by the engine between blocks
    assert r.status_code == 400 and ("max bytes" in r.text or "max rows" in r.text), r.text
    r = post(server, "SELECT repeat('x', 100000) FROM completions")  # one wide block: caught as it arrives
    assert r.status_code == 400 and f"over {LIMITS.max_result_bytes} bytes" in r.text, r.text
    assert post(server, "SELECT completion_id FROM completions LIMIT 1000").status_code == 200


HEAVY = ("SELECT count() FROM completions AS a, completions AS b, completions AS c, completions AS d, completions AS e "
         "WHERE cityHash64(a.completion_id, b.completion_id, c.completion_id, d.completion_id, e.event_id) % 7 = 1")


def test_explain_runs_under_the_time_cap(server):
    """EXPLAIN computes scalar subqueries; the session's cap stops it like any query."""
    r = post(server, f"EXPLAIN SELECT ({HEAVY})")
    assert r.status_code == 400 and "TIMEOUT_EXCEEDED" in r.text, r.text


def test_the_engine_itself_refuses_what_the_walk_refuses(store, listener):
    """Underneath the walk, each reader's session: readonly = 1 after the caps, so no table function,
    no write, no setting changed, whatever reaches the engine."""
    port, connections = listener
    reader = Reader(store.readers._connect(), store.database, LIMITS)
    for sql in (f"SELECT * FROM url('http://127.0.0.1:{port}/x', 'LineAsString')",
                f"INSERT INTO {store.database}.weights SELECT * FROM {store.database}.weights",
                "SELECT 1 SETTINGS max_memory_usage = 0", "SET readonly = 0", "SET max_execution_time = 0"):
        with pytest.raises(Exception, match="(?i)readonly"):
            reader.client.query(sql)
    assert reader.client.query("SELECT getSetting('max_memory_usage'), currentDatabase()").result_rows == \
        [(LIMITS.max_memory_bytes, store.database)]
    assert connections() == []


def test_every_reader_busy_is_said_not_queued(store):
    pool = ReaderPool(store.readers._connect, store.database, LIMITS, size=1, wait_s=0.2)
    started, release = threading.Event(), threading.Event()

    def hold(reader):
        started.set()
        release.wait(10)

    holder = threading.Thread(target=pool.run, args=(hold,))
    holder.start()
    started.wait(10)
    with pytest.raises(HistoryBusy, match="busy"):
        pool.query("SELECT 1")
    release.set()
    holder.join()
    assert pool.query("SELECT 1")[2] == [[1]]
    with pytest.raises(NotReadOnly):
        pool.query("DROP TABLE feedback")


def test_a_heavy_query_beside_the_sink_holds_neither_the_sink_nor_a_trivial_query(server, store, fx):
    """The issue's finding: a trivial query waited 38 s behind a heavy one on the single engine lock."""
    heavy: dict = {}

    def run_heavy():
        t0 = time.monotonic()
        heavy["response"] = post(server, HEAVY)
        heavy["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run_heavy)
    thread.start()
    time.sleep(1.0)  # the heavy query is under way
    t0 = time.monotonic()
    trivial = post(server, "SELECT count() FROM feedback")
    trivial_s = time.monotonic() - t0
    extra = fx.completions[0]
    t0 = time.monotonic()
    store.insert("completions", [row(store, extra, topic="beside-heavy", offset=10**6)])  # the sink's write path
    insert_s = time.monotonic() - t0
    rows = store.query("SELECT count() FROM completions WHERE _topic = 'beside-heavy'").rows
    still_running = thread.is_alive()
    thread.join()
    print(f"\nheavy query: {heavy['seconds']:.2f}s ({heavy['response'].status_code}); beside it: trivial /sql "
          f"{trivial_s * 1000:.1f} ms, sink insert {insert_s * 1000:.1f} ms")
    assert trivial.status_code == 200 and trivial.json()["rows"] == [[len(fx.feedback)]]
    assert rows == [[1]]
    assert still_running, "the heavy query had already ended: this test shows nothing"
    assert heavy["response"].status_code == 400 and "TIMEOUT_EXCEEDED" in heavy["response"].text


def test_tabloop_sql_runs_in_the_history_database(server, store, fx, tmp_path):
    """Issue 14: `tabloop sql "SELECT count() FROM feedback"` failed (the session's database was default)."""
    import json

    from click.testing import CliRunner

    from tabloop.cli import main

    env = {"TABLOOP_STATE_DIR": str(tmp_path), "TABLOOP_HISTORY_PORT": str(server.port),
           "TABLOOP_HISTORY_TOKEN": TOKEN, "TABLOOP_HISTORY_DATABASE": store.database}
    r = CliRunner().invoke(main, ["sql", "SELECT count() AS n FROM feedback", "--format", "json"], env=env)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"n": len(fx.feedback)}
    r = CliRunner().invoke(main, ["sql", "SELECT * FROM `file`('/etc/passwd', 'LineAsString')"], env=env)
    assert r.exit_code == 1 and "403: refused: table function file()" in r.output


@pytest.mark.parametrize("statement", [
    "SHOW PROCESSLIST", "SHOW GRANTS", "SHOW COLUMNS FROM feedback", "SHOW ENGINES", "KILL QUERY WHERE 1",
    "OPTIMIZE TABLE feedback", "CHECK TABLE feedback", "DROP TABLE feedback", "EXISTS DATABASE system",
    "EXPLAIN EXPLAIN SELECT 1", "EXPLAIN AST EXPLAIN AST SELECT 1", "(SELECT 1)", "SELECT 1 UNION ALL SELECT 2"])
def test_parsing_a_statement_with_into_outfile_writes_nothing(server, tmp_path, statement):
    """The guard parses every statement with EXPLAIN AST before refusing it: that parse must not write either."""
    target = tmp_path / "target.txt"
    r = post(server, f"{statement} INTO OUTFILE '{target}'")
    assert r.status_code in (400, 403), r.text  # 400: the engine's parser refused it first
    assert not target.exists()
