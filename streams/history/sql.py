"""Read-only SQL over HTTP, and the dashboard, served by the history sink.

The embedded engine opens one data directory per process, so the process that
runs the sink owns it and answers everyone else's queries:

    POST /sql              {"query": "SELECT …"} → {"columns", "types", "rows"}   (Bearer token)
    GET  /api/dashboard    what the dashboard charts, from the views          (Bearer token)
    GET  /health           {"ok": true, "sink": …}                           (open)
    GET  /                 the dashboard page, /dashboard/* its script and style (open; no data in them)

Only reading statements over the history database pass, decided on the
engine's own parse, and they run on capped read-only handles of their own
(streams.history.guard). Unqualified names mean the history database's
tables. ``SqlClient`` is the other side: against ``chdb://`` it asks this
server; against an ``http://`` ClickHouse server it queries the server directly.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import math
import os
import secrets
import threading
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable
from uuid import UUID

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from infra.http_server import BodyRefused, GuardedH11Protocol, bind, read_body
from infra.settings import Settings
from streams.history.guard import HistoryBusy, NotReadOnly, QueryLimits, ReaderPool
from streams.history.sink import HistoryStore, QueryResult, open_client, sql_literal

log = logging.getLogger("tabloop.history")
DASHBOARD_DIR = Path(__file__).parent / "dashboard"
MAX_QUERY_BYTES = 256 * 1024
QUERY_TIMEOUT_S = QueryLimits().timeout_s
MAX_JSON_DEPTH = 32  # a {"query": …} body is 1 deep; Python's parser recurses per level
BODY_TIMEOUT_S = 30.0  # the whole body, once the headers are in (the front door's default)
RETRY_AFTER_S = 5  # every reader busy: when to ask again


def json_safe(value: Any) -> Any:
    """``value``, as the driver gives a value of any ClickHouse type, as data that ``json.dumps`` writes and
    JSON keeps exactly. Pure; the one place the history port (``/sql``, ``/api/dashboard``, ``tabloop sql``)
    decides what a value looks like in JSON:

    - None, bool, str and int as they are: Int128/UInt256 too (JSON numbers have no size limit, Python
      reads them back exactly; JavaScript's numbers lose digits past 2^53, so read such columns there with
      ``toString()`` in the query).
    - float as it is; NaN and ±inf as null (JSON has no such numbers; ClickHouse's JSON formats do the same).
    - Decimal as its exact text, never exponent notation (``"3.14"``, ``"0.0000001"``): a float would round it.
    - datetime (DateTime, DateTime64) and date (Date, Date32) as ISO 8601; a datetime without a zone is UTC,
      the zone the driver gives them in. Time and Time64 (a timedelta) as ClickHouse writes them,
      ``[-]HH:MM:SS[.ffffff]`` (hours go past 24, up to 999).
    - IPv4, IPv6 and UUID as their usual text (``"1.2.3.4"``, ``"2001:db8::1"``).
    - bytes (FixedString) as text when they are UTF-8 (NUL padding kept), else as hex: the driver already
      gives a String that is not UTF-8 as hex, so both read alike. ``hex(x)`` in the query gives hex always.
    - list and tuple (Array, unnamed Tuple, the geo types, QBit) as lists; dict (Map, named Tuple, JSON,
      a row of Nested) as objects, their keys text: a key whose JSON form is not a string is that JSON
      written out (``1`` → ``"1"``, ``(1, 2)`` → ``"[1,2]"``), so IPv4 or Date keys read as they do as values.

    Enum (its name), LowCardinality, Nullable, Variant, Dynamic, SimpleAggregateFunction and Interval (a
    number of the unit its type names) come from the driver as one of the above. Anything else is a
    TypeError naming its type: a value is never guessed at with ``str()``.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, datetime):  # before date: a datetime is a date too
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.isoformat()
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, timedelta):
        micros = value // timedelta(microseconds=1)
        seconds, fraction = divmod(abs(micros), 1_000_000)
        text = f"{'-' if micros < 0 else ''}{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        return f"{text}.{fraction:06d}" if fraction else text
    if isinstance(value, (ipaddress.IPv4Address, ipaddress.IPv6Address, UUID)):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return value.hex()
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {_json_key(k): json_safe(v) for k, v in value.items()}
    raise TypeError(f"no JSON form for a value of Python type {type(value).__module__}.{type(value).__qualname__} "
                    f"({value!r:.80}): add one to streams.history.sql.json_safe")


def _json_key(key: Any) -> str:
    safe = json_safe(key)
    return safe if isinstance(safe, str) else json.dumps(safe, separators=(",", ":"))


def history_token(settings: Settings, create: bool = False) -> str | None:
    """The SQL/dashboard token: the setting, else the one kept in the state dir (made once when ``create``)."""
    if settings.history_token:
        return settings.history_token
    path = settings.history_token_file
    if path.exists():
        return path.read_text().strip()
    if not create:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    token = "tlh_" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def _problem(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status, headers=headers)


def _busy(exc: HistoryBusy) -> JSONResponse:
    """Every reader busy, for every route that reads the history: 503 and when to ask again, never a 500."""
    return _problem(503, str(exc), {"Retry-After": str(RETRY_AFTER_S)})


def dashboard_data(store: HistoryStore, days: int = 30, project: str | None = None) -> dict[str, Any]:
    """What the dashboard draws: rows of the views for the last ``days`` days (JSON-ready).

    Latency percentiles can't be added up across projects, so with a project
    filter they come straight from the completions table.
    """
    db = store.database
    since = f"day >= today() - {int(days)}"
    where_project = f" AND project_id = {_literal(project)}" if project else ""

    def rows(sql: str) -> list[dict]:
        return [{k: json_safe(v) for k, v in r.items()} for r in store.query(sql).records()]

    if project:
        acceptance = rows(f"""SELECT policy_version, day, n AS episodes, a AS accepted, r AS rejected,
            round(a / nullIf(a + r, 0), 6) AS acceptance_rate
            FROM (SELECT policy_version, day, sum(episodes) AS n, sum(accepted) + sum(partial) AS a,
                  sum(rejected) AS r
                  FROM {db}.acceptance WHERE {since}{where_project} AND policy_version IS NOT NULL
                  GROUP BY policy_version, day)
            ORDER BY day, policy_version""")
        reward = rows(f"""SELECT policy_version, toDate(joined_at) AS day, count() AS episodes,
            round(avg(reward), 6) AS reward_mean FROM {db}.episodes FINAL
            WHERE toDate(joined_at) >= today() - {int(days)}{where_project} AND policy_version IS NOT NULL
            GROUP BY policy_version, day ORDER BY day, policy_version""")
        latency = rows(f"""SELECT toDate(served_at) AS day, count() AS completions,
            quantileExact(0.5)(latency_ms) AS latency_p50, quantileExact(0.9)(latency_ms) AS latency_p90,
            quantileExact(0.99)(latency_ms) AS latency_p99, quantileExact(0.5)(ttft_ms) AS ttft_p50
            FROM {db}.completions FINAL WHERE toDate(served_at) >= today() - {int(days)}{where_project}
            GROUP BY day ORDER BY day""")
    else:
        acceptance = rows(f"""SELECT policy_version, day, episodes, accepted + partial AS accepted, rejected,
            acceptance_rate FROM {db}.acceptance_by_version WHERE {since} AND policy_version IS NOT NULL
            ORDER BY day, policy_version""")
        reward = rows(f"""SELECT policy_version, day, episodes, reward_mean FROM {db}.reward_by_version
            WHERE {since} AND policy_version IS NOT NULL ORDER BY day, policy_version""")
        latency = rows(f"""SELECT day, completions, latency_p50, latency_p90, latency_p99, ttft_p50
            FROM {db}.latency_by_day WHERE {since} ORDER BY day""")
    shown = rows(f"""SELECT day, sum(served) AS served, sum(shown) AS shown, sum(accepted) AS accepted,
        sum(rejected) AS rejected, sum(gate_hidden) AS gate_hidden FROM {db}.shown_vs_accepted WHERE {since}{where_project}
        GROUP BY day ORDER BY day""")
    return {"days": days, "project": project, "acceptance": acceptance, "shown": shown, "latency": latency,
            "reward": reward}


async def _read_body(request: Request) -> bytes | Response:
    """The body (``infra.http_server.read_body``: size checked before and while it is read, a deadline, a
    client that left mid-body answered quietly), or the response refusing it."""
    try:
        return await read_body(request, MAX_QUERY_BYTES, BODY_TIMEOUT_S)
    except BodyRefused as refused:
        return JSONResponse({"error": {"message": refused.message, "code": refused.status}},
                            status_code=refused.status, headers=refused.headers)


def _literal(value: str) -> str:
    return sql_literal(value)


def build_app(store: HistoryStore, token: str, status: Callable[[], dict] | None = None) -> Starlette:
    """The SQL and dashboard routes over ``store``; ``token`` guards every route that returns data."""

    def authorized(request: Request) -> bool:
        header = request.headers.get("authorization", "")
        presented = header[7:].strip() if header[:7].lower() == "bearer " else ""
        return bool(presented) and hmac.compare_digest(presented.encode(), token.encode())

    def unauthorized() -> JSONResponse:
        return JSONResponse({"error": {"message": "missing or wrong Bearer token (see `tabloop history token`)",
                                       "code": 401}}, status_code=401, headers={"WWW-Authenticate": "Bearer"})

    async def sql(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        body = await _read_body(request)
        if isinstance(body, Response):
            return body
        query = body.decode(errors="replace")
        if "json" in request.headers.get("content-type", ""):
            try:
                parsed = json.loads(body)
            except RecursionError:
                return _problem(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels")
            except ValueError as exc:
                return _problem(400, f"request body is not valid JSON: {exc}")
            if not isinstance(parsed, dict) or not isinstance(parsed.get("query"), str):
                return _problem(400, "expected {\"query\": \"SELECT …\"}")
            query = parsed["query"]
        try:
            result = await run_in_threadpool(store.query, query)
        except NotReadOnly as exc:
            return _problem(403, f"refused: {exc}")
        except HistoryBusy as exc:
            return _busy(exc)
        except Exception as exc:  # the engine's own message: syntax errors, unknown tables…
            return _problem(400, _engine_message(exc))
        try:
            rows = [[json_safe(v) for v in row] for row in result.rows]
        except TypeError as exc:  # a value the driver gave that json_safe doesn't know: ours to fix, said so
            log.error("/sql: %s", exc)
            return _problem(500, f"the result could not be written as JSON: {exc}")
        return JSONResponse({"columns": result.columns, "types": result.types, "rows": rows})

    async def dashboard_api(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        try:
            days = int(request.query_params.get("days", "30"))
        except ValueError:
            return _problem(400, "days must be a whole number")
        if not 1 <= days <= 3660:
            return _problem(400, "days must be between 1 and 3660")
        project = request.query_params.get("project") or None
        try:
            data = await run_in_threadpool(dashboard_data, store, days, project)
        except HistoryBusy as exc:
            return _busy(exc)
        except Exception as exc:
            return _problem(500, _engine_message(exc))
        return JSONResponse(data)

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True, "database": store.database, "sink": status() if status else None})

    def static(name: str, media_type: str):
        async def serve(request: Request) -> Response:
            return FileResponse(DASHBOARD_DIR / name, media_type=media_type,
                                headers={"Cache-Control": "no-cache"})
        return serve

    routes = [
        Route("/sql", sql, methods=["POST"]),
        Route("/api/dashboard", dashboard_api, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/", static("index.html", "text/html; charset=utf-8"), methods=["GET"]),
        Route("/dashboard/dashboard.js", static("dashboard.js", "text/javascript; charset=utf-8"), methods=["GET"]),
        Route("/dashboard/charts.js", static("charts.js", "text/javascript; charset=utf-8"), methods=["GET"]),
        Route("/dashboard/style.css", static("style.css", "text/css; charset=utf-8"), methods=["GET"]),
    ]
    return Starlette(routes=routes)


_CAP_HINTS = {"TOO_MANY_ROWS_OR_BYTES": "results here are capped: add a LIMIT, or aggregate",
              "MEMORY_LIMIT_EXCEEDED": "each query here has a memory cap: aggregate over less, or filter first",
              "TIMEOUT_EXCEEDED": "queries here stop at the time cap: filter by day, or aggregate in a view"}


def _engine_message(exc: Exception) -> str:
    text = str(exc).strip()
    # clickhouse-connect wraps the server's message in lines of its own; the engine's line says what is wrong.
    line = next((ln.strip() for ln in text.splitlines() if "DB::Exception" in ln or "Code:" in ln),
                text.splitlines()[0] if text else type(exc).__name__)
    hint = next((h for code, h in _CAP_HINTS.items() if code in line), None)
    return f"{line} ({hint})" if hint else line


class HistoryServer:
    """The app on a socket, in a thread of its own (the sink loop keeps the main thread)."""

    def __init__(self, store: HistoryStore, token: str, host: str, port: int,
                 status: Callable[[], dict] | None = None, *, header_timeout_s: float = 10.0,
                 body_timeout_s: float = BODY_TIMEOUT_S):
        import uvicorn

        self.socket = bind(host, port)
        self.host, self.port = host, self.socket.getsockname()[1]
        # The front door's deadlines: request line and headers within header_timeout_s of connecting, the body
        # within body_timeout_s of the headers; else a 408 and the connection closed.
        protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s,
                                                                      "body_timeout_s": body_timeout_s})
        config = uvicorn.Config(build_app(store, token, status), log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=3, http=protocol, ws="none")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="history-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        import asyncio

        asyncio.run(self._server.serve(sockets=[self.socket]))

    def start(self) -> "HistoryServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


# -- the client side: `tabloop sql`, replay from ClickHouse ---------------------------------------------


class SqlError(RuntimeError):
    """A query that could not run; the message is for a person."""


class SqlClient:
    """Read-only queries against the configured history: via the sink (chdb) or a ClickHouse server (http)."""

    def __init__(self, settings: Settings, *, sink_url: str | None = None, token: str | None = None):
        self.settings = settings
        self.url = settings.effective_clickhouse_url
        self.database = settings.history_database
        self.sink_url = sink_url or f"http://{settings.history_host}:{settings.history_port}"
        self.token = token
        self._client = None

    @property
    def direct(self) -> bool:
        return self.url.startswith(("http://", "https://"))

    def query(self, sql: str) -> QueryResult:
        """The sink checks and caps what it is sent; a server is asked through the same guard, here."""
        if self.direct:
            return self._query_server(sql)
        return self._query_sink(sql)

    def _query_server(self, sql: str) -> QueryResult:
        if self._client is None:
            url = self.url
            self._client = ReaderPool(lambda: open_client(url), self.database, QueryLimits(), size=1)
        try:
            columns, types, rows = self._client.query(sql)
        except NotReadOnly as exc:
            raise SqlError(f"refused: {exc}") from None
        except Exception as exc:
            raise SqlError(_engine_message(exc)) from None
        return QueryResult(columns, types, [[json_safe(v) for v in r] for r in rows])

    def _query_sink(self, sql: str) -> QueryResult:
        import httpx

        token = self.token or history_token(self.settings)
        if not token:
            raise SqlError(f"no history token: set TABLOOP_HISTORY_TOKEN or start `tabloop history` "
                           f"(it writes {self.settings.history_token_file})")
        try:
            r = httpx.post(f"{self.sink_url}/sql", json={"query": sql},
                           headers={"Authorization": f"Bearer {token}"}, timeout=QUERY_TIMEOUT_S + 30)
        except httpx.TransportError as exc:
            raise SqlError(f"the history sink does not answer on {self.sink_url} ({exc}); it owns {self.url}, "
                           "so start it with `tabloop history`") from None
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:500]
            raise SqlError(f"{r.status_code}: {message}")
        body = r.json()
        return QueryResult(body["columns"], body["types"], body["rows"])


def format_table(result: QueryResult, max_width: int = 60) -> str:
    """Rows as an aligned text table; long cells cut to ``max_width`` characters."""
    def cell(v: Any) -> str:
        text = "NULL" if v is None else str(json_safe(v))
        text = text.replace("\n", "\\n")
        return text if len(text) <= max_width else text[: max_width - 1] + "…"

    cells = [[cell(v) for v in row] for row in result.rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(result.columns)]
    numeric = [any(k in t for k in ("Int", "Float", "Decimal")) for t in result.types] if result.types else \
        [False] * len(result.columns)
    lines = ["  ".join(c.ljust(w) for c, w in zip(result.columns, widths)),
             "  ".join("-" * w for w in widths)]
    for r in cells:
        lines.append("  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(r, widths, numeric)))
    lines.append(f"({len(cells)} row{'s' if len(cells) != 1 else ''})")
    return "\n".join(lines)
