"""What a person's SQL may do against the history, decided on the engine's own parse, and the capped
session it runs in.

Anyone with the history token can send SQL (``POST /sql``, ``tabloop sql``). A guard that reads the query
text is fooled by quoting (`` `file`('/etc/passwd') ``), heredocs and comments, so nothing here reads it:

1. **The engine parses.** ``formatQuery()`` (the text travels as a bound parameter, never spliced into SQL)
   gives the canonical text of exactly one statement: comments gone, names and literals re-quoted. That
   canonical text is both what is checked and what runs, so the check and the run can't disagree.
2. **Allowed by construction.** ``EXPLAIN AST`` of the canonical text (it only parses) is walked node by
   node: the statement must be SELECT/WITH, SHOW TABLES, SHOW CREATE, DESCRIBE, EXISTS or EXPLAIN of a
   SELECT; every table source must be a table or view of the history database or a subquery (no table
   function at all); no ``INTO OUTFILE``, no ``SETTINGS``, no function that reads files or names
   dictionaries, Join tables or other tables by string, and none that tells of the server instead of the
   history (its settings and paths, its disks, the machine: ``SERVER_FUNCTIONS``).
3. **Least privilege underneath.** Queries run on reader handles of their own (chdb allows many handles on
   its one engine, each with its own session), set once to the caps below and then to ``readonly = 1``:
   after that nothing in the session can change a setting, the engine refuses every write and every table
   function, and a query's own SETTINGS clause is refused too. Every statement, EXPLAIN included, runs
   under the time, memory and result-size caps.

The readers are a small pool, apart from the sink's handle: a heavy query neither holds the sink's inserts
nor makes a trivial query wait, and when every reader is busy the caller is told so (``HistoryBusy``)
instead of queueing without bound.

Walking ``EXPLAIN AST``'s text tree is safe although names print raw (a name holding a newline adds a row):
the walk looks at every row on its own, or at a row and the one printed right after a nameless row, and only
ever refuses on what it sees. An injected row can add a refusal; it can't hide a real row, because every
real node still prints a row of its own, at its own depth.
"""

from __future__ import annotations

import os
import queue
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable


class NotReadOnly(ValueError):
    """A statement refused where only reading the history is allowed; the message says why."""


class ResultTooBig(RuntimeError):
    """A result over the byte cap; the message says what to do."""


class HistoryBusy(RuntimeError):
    """Every reader is running a query; try again shortly."""


class UnreadableResult(RuntimeError):
    """A result column of a type the driver can't read (AggregateFunction); the message says what to do."""


@dataclass(frozen=True)
class QueryLimits:
    """Caps every read query runs under (session settings of each reader, fixed before ``readonly = 1``)."""

    timeout_s: int = 60
    max_rows: int = 100_000
    max_result_bytes: int = 64 * 1024 * 1024
    max_memory_bytes: int = 1024 * 1024 * 1024
    # All the process's queries together (the engine's per-user tracker: every reader is the same user), so
    # the readers of a pool can't take their per-query cap each at once.
    max_total_memory_bytes: int = 1024 * 1024 * 1024
    # Half the cores (at least one): analytics never takes every core from the sink beside it.
    max_threads: int = max(1, (os.cpu_count() or 2) // 2)

    def settings(self) -> list[str]:
        return [f"max_execution_time = {int(self.timeout_s)}", "timeout_overflow_mode = 'throw'",
                f"max_memory_usage = {int(self.max_memory_bytes)}",
                f"max_memory_usage_for_user = {int(self.max_total_memory_bytes)}",
                f"max_result_rows = {int(self.max_rows)}", f"max_result_bytes = {int(self.max_result_bytes)}",
                # throw, not break: a result cut short without a word would read as the whole answer
                "result_overflow_mode = 'throw'", f"max_threads = {int(self.max_threads)}"]


ALLOWED = "SELECT, WITH, SHOW TABLES, SHOW CREATE, DESCRIBE, EXISTS and EXPLAIN (of a SELECT)"
# Root node of each allowed statement → the kinds of node allowed right under it. Anything else at depth 1
# is a clause of the statement itself: INTO OUTFILE (a Literal), SETTINGS (Set), FORMAT (Identifier).
_ROOTS = {
    "SelectWithUnionQuery": {"ExpressionList"},
    "DescribeQuery": {"TableExpression"},
    "Explain": {"SelectWithUnionQuery"},
    "ShowTables": {"Identifier"},
    "ShowCreateTableQuery": {"Identifier"},
    "ShowCreateViewQuery": {"Identifier"},
    "ExistsTableQuery": {"Identifier"},
    "ExistsViewQuery": {"Identifier"},
}
_NAMED_ROOT = re.compile(r"(ShowCreateTableQuery|ShowCreateViewQuery|ExistsTableQuery|ExistsViewQuery) "
                         r"(\w*) (\w+) \(children \d+\)")
_EXPLAIN_KINDS = {"EXPLAIN", "EXPLAIN AST", "EXPLAIN SYNTAX", "EXPLAIN PLAN", "EXPLAIN PIPELINE",
                  "EXPLAIN ESTIMATE", "EXPLAIN QUERY TREE"}
_TABLE_NAME = re.compile(r"(?:(\w+)\.)?(\w+)(?: \(alias .*\))?")
# Scalar functions that reach past the history: file() reads any path the process can; the dictionary and
# Join-table getters name their source in a string, out of the walk's sight, and so does hasColumnInTable()
# ('system', 'one', 'dummy': the columns of any database's tables).
_OUTSIDE_PREFIXES = ("dictget", "dicthas", "dictisin", "joinget")
_OUTSIDE_FUNCTIONS = {"file", "hascolumnintable"}
# Table functions that are also harmless scalar functions of the same name (format('{}-{}', a, b)).
_SCALAR_TOO = {"format"}
# Scalar functions that tell of the server rather than of the history: its settings and configuration
# (getServerSetting('path') gave every token holder the state directory), its disks, and the machine it runs
# on. The readers' own caps are settings too: what they are is in docs/security.md, not for a query to probe.
# Each reader adds every alias the engine lists for them (fullHostName for FQDN), so no spelling gets past.
# Left allowed on purpose: version(), serverTimezone() (what a query needs to read the history's times
# right) and currentDatabase(), currentUser(), uptime(), which tell nothing of the host.
SERVER_FUNCTIONS = {
    "getServerSetting": "a server setting", "getSetting": "a setting", "getSettingOrDefault": "a setting",
    "getMergeTreeSetting": "a MergeTree setting", "getMacro": "a macro of the server's configuration",
    "getServerPort": "a port the server is configured with", "tcpPort": "the port the server is configured with",
    "displayName": "the display name of the server's configuration",
    "filesystemAvailable": "the free space of the server's disks",
    "filesystemCapacity": "the size of the server's disks",
    "filesystemUnreserved": "the free space of the server's disks",
    "hostName": "the machine's name", "FQDN": "the machine's name", "getOSKernelVersion": "the machine's kernel",
}


class Reader:
    """One engine handle in the history database, capped and read-only for good."""

    def __init__(self, client, database: str, limits: QueryLimits):
        self.client = client
        self.database = database
        for setting in limits.settings():
            client.command(f"SET {setting}")
        # Last: once readonly is 1 the session can change no setting, so the caps above stay.
        client.command("SET readonly = 1")
        client.database = database  # unqualified names mean the history's tables
        self.max_result_bytes = limits.max_result_bytes
        self.table_functions = {r[0].lower() for r in client.query(
            "SELECT name FROM system.table_functions").result_rows} - _SCALAR_TOO
        # Each lower-case name (aliases too) of a function SERVER_FUNCTIONS refuses → that function's own name;
        # filtered by the engine, as the list of all functions is over a small max_result_rows.
        canonical = {name.lower(): name for name in SERVER_FUNCTIONS}
        self.server_functions = {name.lower(): canonical[real] for name, real in client.query(
            "SELECT name, lower(if(alias_to = '', name, alias_to)) AS real FROM system.functions "
            "WHERE has({refused:Array(String)}, real)", parameters={"refused": list(canonical)}).result_rows}

    def canonical(self, sql: str) -> tuple[str, str]:
        """The one statement in ``sql`` as the engine formats it and its kind (the root node of its AST),
        or NotReadOnly saying why it is refused."""
        if not sql.strip():
            raise NotReadOnly("empty query")
        try:
            text = self.client.query("SELECT formatQuery({q:String})", parameters={"q": sql}).result_rows[0][0]
        except Exception as exc:
            message = str(exc)
            if "Empty query" in message:
                raise NotReadOnly("empty query") from None
            if "Multi-statements" in message:
                raise NotReadOnly("one statement per query") from None
            raise  # a syntax error: the engine's own message, for the caller to show
        try:
            tree = [r[0] for r in self.client.query(f"EXPLAIN AST {text}").result_rows]
        except Exception as exc:
            if "READONLY" in str(exc):  # the session's readonly refused a SETTINGS clause while parsing
                raise NotReadOnly("SETTINGS clauses are not allowed: the caps are fixed") from None
            raise
        # Asked each time: a database made after this reader must count as outside too.
        others = {r[0] for r in self.client.query("SELECT name FROM system.databases").result_rows} - {self.database}
        return text, check_tree(tree, text, self.database, self.table_functions, others, self.server_functions)

    def query(self, sql: str) -> tuple[list[str], list[str], list[list[Any]]]:
        """Columns, their types and the rows of the checked query, capped in bytes as the blocks arrive:
        the engine's max_result_bytes is weighed only between blocks, so one wide block passes it."""
        from clickhouse_connect.driver.exceptions import NotSupportedError

        text, root = self.canonical(sql)
        try:
            return self._run(text, root)
        except NotSupportedError as exc:
            # The driver reads every type but AggregateFunction: a partial aggregation state, bytes laid out
            # as each function likes, that only the engine can finish.
            raise UnreadableResult(f"{exc}: the result holds aggregation states (an AggregateFunction column, "
                                   "from a …State() function), which have no value to show; "
                                   "finalizeAggregation(x) or the function's …Merge() gives their value") from None

    def _run(self, text: str, root: str) -> tuple[list[str], list[str], list[list[Any]]]:
        rows: list[list[Any]] = []
        size, cap = 0, self.max_result_bytes

        def add(block) -> None:
            nonlocal size
            size += sum(_size(r) for r in block)
            if size > cap:
                raise ResultTooBig(f"the result is over {cap} bytes, the cap on results here: "
                                   "add a LIMIT, or aggregate")
            rows.extend(list(r) for r in block)

        if root != "SelectWithUnionQuery":  # the embedded engine streams SELECTs only; the rest are small
            result = self.client.query(text)
            add(result.result_rows)
            return list(result.column_names), [t.name for t in result.column_types], rows
        with self.client.query_row_block_stream(text) as stream:
            columns = list(stream.source.column_names)
            types = [t.name for t in stream.source.column_types]
            for block in stream:
                add(block)
        return columns, types, rows


def _size(value: Any) -> int:
    """About the bytes ``value`` takes in a result (strings by length, other scalars 8)."""
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return 8 + sum(_size(v) for v in value)
    if isinstance(value, dict):
        return 8 + sum(_size(k) + _size(v) for k, v in value.items())
    return 8


def check_tree(rows: list[str], text: str, database: str, table_functions: set[str],
               other_databases: set[str], server_functions: dict[str, str]) -> str:
    """The statement's kind (its root node), or NotReadOnly when its ``EXPLAIN AST`` rows (``rows``) show
    something not allowed; see the module doc. ``server_functions``: each lower-case name (aliases too) of
    a function SERVER_FUNCTIONS refuses → that function's own name."""
    if rows and rows[-1] == " Identifier Native":
        rows = rows[:-1]  # the FORMAT Native the driver appends to every query, ours
    if not rows:
        raise NotReadOnly("empty query")
    root = rows[0].split(" ", 1)[0]
    if root not in _ROOTS:
        word = text.split(None, 1)[0].upper() if text.split() else root
        raise NotReadOnly(f"only {ALLOWED} are allowed here, not {word}")
    if root == "Explain":
        kind = re.sub(r" \(children \d+\)$", "", rows[0].split(" ", 1)[1] if " " in rows[0] else "")
        if kind not in _EXPLAIN_KINDS:
            raise NotReadOnly(f"{kind or 'this EXPLAIN'} is not allowed here; EXPLAIN [AST|SYNTAX|PLAN|PIPELINE|"
                              "ESTIMATE|QUERY TREE] of a SELECT is")
    named = _NAMED_ROOT.fullmatch(rows[0])
    if root in ("ShowCreateTableQuery", "ShowCreateViewQuery", "ExistsTableQuery", "ExistsViewQuery"):
        if not named:
            raise NotReadOnly("name the table plainly (letters, digits and _)")
        if named.group(2) not in ("", database):
            raise NotReadOnly(f"{named.group(2)}.{named.group(3)} is outside the history database {database}")
    for i, row in enumerate(rows[1:], start=1):
        depth = len(row) - len(row.lstrip(" "))
        parts = row.lstrip(" ").split(" ")
        kind, name = parts[0], parts[1] if len(parts) > 1 else ""
        if kind == "Set":
            raise NotReadOnly("SETTINGS clauses (and EXPLAIN options) are not allowed: the caps are fixed")
        if depth == 1 and kind not in _ROOTS[root]:
            if kind == "Literal":
                raise NotReadOnly("INTO OUTFILE is not allowed: queries here return rows, they write no files")
            raise NotReadOnly(f"this clause of the statement ({kind}) is not allowed here")
        if depth == 2 and root == "Explain" and kind != "ExpressionList":
            # EXPLAIN AST keeps the SELECT's own clauses (INTO OUTFILE, FORMAT) one level down
            if kind == "Literal":
                raise NotReadOnly("INTO OUTFILE is not allowed: queries here return rows, they write no files")
            raise NotReadOnly(f"this clause of the explained SELECT ({kind}) is not allowed here")
        if depth == 1 and root == "ShowTables" and kind == "Identifier" and name != database:
            raise NotReadOnly(f"SHOW TABLES lists the history database {database} only")
        if kind == "TableExpression":
            source = rows[i + 1].lstrip(" ").split(" ") if i + 1 < len(rows) else [""]
            if source[0] not in ("TableIdentifier", "Subquery"):
                what = f"table function {source[1]}()" if source[0] == "Function" and len(source) > 1 else source[0]
                raise NotReadOnly(f"{what} is not allowed: read the history's tables and views, or subqueries")
        elif kind == "Function":
            lower = name.lower()
            if lower in table_functions or lower in _OUTSIDE_FUNCTIONS or lower.startswith(_OUTSIDE_PREFIXES):
                raise NotReadOnly(f"function {name}() reaches outside the history database")
            if lower in server_functions:
                real = server_functions[lower]
                alias = "" if real.lower() == lower else f" (an alias of {real}())"
                raise NotReadOnly(f"function {name}(){alias} reveals {SERVER_FUNCTIONS[real]}, not the history: "
                                  "queries here read the history database only")
        elif kind == "TableIdentifier":
            table = _TABLE_NAME.fullmatch(row.lstrip(" ").split(" ", 1)[1] if " " in row.lstrip(" ") else "")
            if not table:
                raise NotReadOnly("name tables plainly (letters, digits and _)")
            if table.group(1) not in (None, database):
                raise NotReadOnly(f"{table.group(1)}.{table.group(2)} is outside the history database {database}")
        elif kind == "Identifier" and "." in name and name.split(".", 1)[0] in other_databases:
            raise NotReadOnly(f"{name} is outside the history database {database}")
    return root


class ReaderPool:
    """A few readers, made as needed; a query takes a free one or, after ``wait_s``, HistoryBusy."""

    def __init__(self, connect: Callable[[], Any], database: str, limits: QueryLimits, size: int = 3,
                 wait_s: float = 10.0):
        self._connect, self.database, self.limits = connect, database, limits
        self.size, self.wait_s = size, wait_s
        self._free: queue.Queue[Reader] = queue.Queue()
        self._made = 0
        self._lock = threading.Lock()

    def _take(self) -> Reader:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            make = self._made < self.size
            if make:
                self._made += 1
        if make:
            try:
                return Reader(self._connect(), self.database, self.limits)
            except Exception:
                with self._lock:
                    self._made -= 1
                raise
        try:
            return self._free.get(timeout=self.wait_s)
        except queue.Empty:
            raise HistoryBusy(f"all {self.size} history readers are busy with other queries; "
                              f"try again shortly") from None

    def run(self, fn: Callable[[Reader], Any]) -> Any:
        reader = self._take()
        try:
            return fn(reader)
        finally:
            self._free.put(reader)

    def query(self, sql: str):
        return self.run(lambda reader: reader.query(sql))
