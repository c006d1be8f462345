"""The history port as hardened as the front door (issue 29): deadlines on headers and bodies, the body's
size checked before it is read, hostile JSON answered 400, no traceback for a client that goes away, and a
memory cap over all the process's queries together; every type the engine returns answered as JSON, and every
reader busy answered 503 on each route. A real server on a free port, raw sockets and httpx."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

import httpx
import pytest

from infra.local import wait_ready
from streams.history.guard import QueryLimits
from streams.history.sink import HistoryStore
from streams.history.sql import MAX_QUERY_BYTES, RETRY_AFTER_S, HistoryServer, json_safe
from tests.history_fixture import new_store

TOKEN = "tlh_port"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEADER_TIMEOUT_S = 1.0
LIMITS = QueryLimits(timeout_s=10, max_memory_bytes=64 * 2**20, max_total_memory_bytes=96 * 2**20)


@pytest.fixture(scope="module")
def store():
    base = new_store()
    return HistoryStore(base.client, base.database, limits=LIMITS)


@pytest.fixture(scope="module")
def server(store):
    srv = HistoryServer(store, TOKEN, "127.0.0.1", 0, header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=1.0).start()
    assert wait_ready(f"{srv.url}/health", 5), "the SQL server did not answer"
    yield srv
    srv.stop()


def post(server, query: str) -> httpx.Response:
    return httpx.post(f"{server.url}/sql", json={"query": query}, headers=AUTH, timeout=30)


def _connect(server) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_silent_and_trickling_connections_are_closed_with_408(server):
    silent, trickling = _connect(server), _connect(server)
    start = time.monotonic()
    trickling.sendall(b"POST /sql HTTP/1.1\r\n")
    for _ in range(3):
        time.sleep(0.3)
        trickling.sendall(b"X-Slow: y\r\n")  # bytes keep coming: the deadline is not pushed back
    for sock in (silent, trickling):
        answer = _read_all(sock)
        assert answer.startswith(b"HTTP/1.1 408"), answer
    assert time.monotonic() - start < HEADER_TIMEOUT_S + 2


def test_a_body_over_the_cap_is_refused_before_it_is_read(server):
    sock = _connect(server)
    sock.sendall(b"POST /sql HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (100 * MAX_QUERY_BYTES))
    answer = _read_all(sock)  # answered without a byte of the body sent
    assert answer.startswith(b"HTTP/1.1 413"), answer
    streamed = httpx.post(f"{server.url}/sql", content=iter([b"x" * 65536] * 8), timeout=10,
                          headers={"Authorization": f"Bearer {TOKEN}"})  # chunked: no length to check first
    assert streamed.status_code == 413, streamed.text


def test_hostile_json_is_a_400(server):
    body = b'{"query": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(f"{server.url}/sql", content=body, timeout=30,
                   headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "nests deeper" in r.text, r.text


def test_a_client_that_leaves_mid_body_leaves_no_traceback(server, caplog):
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            sock = _connect(server)
            sock.sendall(b"POST /sql HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
                         b"\r\nContent-Length: 1000\r\n\r\n" + b"x" * 100)
            time.sleep(0.1)
            sock.close()
        time.sleep(0.5)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()], caplog.text


def test_the_queries_together_have_one_memory_cap(server, store):
    # Asked on a reader itself: getSetting() is refused over /sql (it tells of the server, not the history).
    [[cap]] = store.readers.run(lambda reader: reader.client.query(
        "SELECT getSetting('max_memory_usage_for_user')").result_rows)
    assert cap == LIMITS.max_total_memory_bytes
    r = post(server, "SELECT getSetting('max_memory_usage_for_user') AS m")
    assert r.status_code == 403 and "getSetting" in r.json()["error"]["message"], r.text


# -- every type the engine returns, as JSON ------------------------------------------------------------------

# Each type family the engine has (system.data_type_families, aliases aside) → a literal of it and the JSON
# /sql must answer for it, worked out by hand from json_safe's rules. A family the engine gains and this table
# lacks fails test_every_type_family_of_the_engine_has_a_case_here: add it, and it is tested.
TYPES = {
    "Array": ("[1, 2]", [1, 2]),
    "BFloat16": ("toBFloat16(1.5)", 1.5),
    "Bool": ("true", True),
    "Date": ("toDate('2024-01-02')", "2024-01-02"),
    "Date32": ("toDate32('1900-01-02')", "1900-01-02"),
    "DateTime": ("toDateTime('2024-01-02 03:04:05', 'UTC')", "2024-01-02T03:04:05+00:00"),
    # the same instant, given by the driver in UTC
    "DateTime32": ("toDateTime32('2024-01-02 03:04:05', 'Asia/Tokyo')", "2024-01-01T18:04:05+00:00"),
    "DateTime64": ("toDateTime64('2024-01-02 03:04:05.123456', 6, 'Asia/Tokyo')", "2024-01-02T03:04:05.123456+09:00"),
    "Decimal": ("CAST('3.10', 'Decimal(5, 2)')", "3.10"),
    "Decimal32": ("toDecimal32('-1.5', 1)", "-1.5"),
    "Decimal64": ("toDecimal64('0.1', 17)", "0.10000000000000000"),
    "Decimal128": ("toDecimal128('123456789012345678901234.5', 1)", "123456789012345678901234.5"),  # no float holds it
    "Decimal256": ("toDecimal256('1e-70', 76)", "0." + "0" * 69 + "1000000"),  # never exponent notation
    "Dynamic": ("CAST(toIPv4('10.0.0.1'), 'Dynamic')", "10.0.0.1"),
    "Enum": ("CAST('b', 'Enum(''a'' = 1, ''b'' = 2)')", "b"),
    "Enum8": ("CAST('x', 'Enum8(''x'' = -1)')", "x"),
    "Enum16": ("CAST('y', 'Enum16(''y'' = 1000)')", "y"),
    "FixedString": ("toFixedString('ab', 4)", "ab\x00\x00"),
    "Float32": ("toFloat32(0.5)", 0.5),
    "Float64": ("nan", None),
    "Geometry": ("CAST(CAST((1.5, 2), 'Point'), 'Geometry')", [1.5, 2.0]),
    "IPv4": ("toIPv4('1.2.3.4')", "1.2.3.4"),
    "IPv6": ("toIPv6('2001:db8::1')", "2001:db8::1"),
    "Int8": ("toInt8(-8)", -8),
    "Int16": ("toInt16(-16)", -16),
    "Int32": ("toInt32(-32)", -32),
    "Int64": ("toInt64(-9223372036854775808)", -9223372036854775808),
    "Int128": ("toInt128('-170141183460469231731687303715884105728')", -2**127),
    "Int256": ("toInt256('-57896044618658097711785492504343953926634992332820282019728792003956564819968')", -2**255),
    "UInt8": ("toUInt8(255)", 255),
    "UInt16": ("toUInt16(65535)", 65535),
    "UInt32": ("toUInt32(4294967295)", 4294967295),
    "UInt64": ("toUInt64(18446744073709551615)", 2**64 - 1),
    "UInt128": ("toUInt128('340282366920938463463374607431768211455')", 2**128 - 1),
    "UInt256": ("toUInt256('115792089237316195423570985008687907853269984665640564039457584007913129639935')",
                2**256 - 1),
    "IntervalNanosecond": ("toIntervalNanosecond(1)", 1),
    "IntervalMicrosecond": ("toIntervalMicrosecond(2)", 2),
    "IntervalMillisecond": ("toIntervalMillisecond(3)", 3),
    "IntervalSecond": ("toIntervalSecond(4)", 4),
    "IntervalMinute": ("toIntervalMinute(5)", 5),
    "IntervalHour": ("toIntervalHour(6)", 6),
    "IntervalDay": ("INTERVAL 7 DAY", 7),
    "IntervalWeek": ("toIntervalWeek(8)", 8),
    "IntervalMonth": ("toIntervalMonth(9)", 9),
    "IntervalQuarter": ("toIntervalQuarter(10)", 10),
    "IntervalYear": ("toIntervalYear(11)", 11),
    "JSON": ("CAST('{\"ip\": \"1.2.3.4\", \"n\": {\"b\": 1}, \"c\": [1, 2]}', 'JSON(ip IPv4)')",
             {"ip": "1.2.3.4", "n": {"b": 1}, "c": [1, 2]}),
    "LineString": ("CAST([(1, 2), (3, 4)], 'LineString')", [[1.0, 2.0], [3.0, 4.0]]),
    "LowCardinality": ("toLowCardinality(toNullable('lc'))", "lc"),
    "Map": ("map(toIPv4('1.2.3.4'), [toTime('01:00:00')])", {"1.2.3.4": ["01:00:00"]}),
    "MultiLineString": ("CAST([[(1, 2)]], 'MultiLineString')", [[[1.0, 2.0]]]),
    "MultiPoint": ("CAST([(1, 2)], 'MultiPoint')", [[1.0, 2.0]]),
    "MultiPolygon": ("CAST([[[(1, 2)]]], 'MultiPolygon')", [[[[1.0, 2.0]]]]),
    "Nested": ("CAST([(toIPv6('::1'), toDecimal32('2.5', 1))], 'Nested(ip IPv6, d Decimal(9, 1))')",
               [{"ip": "::1", "d": "2.5"}]),
    "Nothing": ("[]", []),
    "Nullable": ("CAST(NULL, 'Nullable(IPv6)')", None),
    "Point": ("CAST((1, 2), 'Point')", [1.0, 2.0]),
    "Polygon": ("CAST([[(1, 2)]], 'Polygon')", [[[1.0, 2.0]]]),
    "QBit": ("CAST([1, 2, 3, 4, 5, 6, 7, 8], 'QBit(Float32, 8)')", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]),
    "Ring": ("CAST([(1, 2)], 'Ring')", [[1.0, 2.0]]),
    "SimpleAggregateFunction": ("CAST(1, 'SimpleAggregateFunction(sum, UInt64)')", 1),
    "String": ("'text'", "text"),
    "Time": ("toTime('-01:02:03')", "-01:02:03"),
    "Time64": ("toTime64('123:04:05.678', 3)", "123:04:05.678000"),
    "Tuple": ("CAST((toTime64('00:00:01.5', 1), [toUUID('61f0c404-5cb3-11e7-907b-a6006ad3dba0')]), "
              "'Tuple(t Time64(1), ids Array(UUID))')", {"t": "00:00:01.500000",
                                                         "ids": ["61f0c404-5cb3-11e7-907b-a6006ad3dba0"]}),
    "UUID": ("toUUID('61f0c404-5cb3-11e7-907b-a6006ad3dba0')", "61f0c404-5cb3-11e7-907b-a6006ad3dba0"),
    "Variant": ("CAST(toTime('01:02:03'), 'Variant(Time, String)')", "01:02:03"),
}
# Families whose values this port can't answer with, each with why; tested on their own below.
NOT_RETURNED = {"AggregateFunction": "a partial aggregation state: test_aggregation_states_are_a_400_saying_what_to_do"}
# The type a family's literal shows as, where the engine names it otherwise.
SHOWN_AS = {"DateTime32": "DateTime", "Decimal32": "Decimal", "Decimal64": "Decimal", "Decimal128": "Decimal",
            "Decimal256": "Decimal", "Enum": "Enum8"}
# The values nested in one another, and the rules' corners: keys that are not text, bytes that are not UTF-8,
# the floats JSON has no number for, Variant and Dynamic holding the types that used to fail.
NESTED = {
    "arrays_of_tuples": ("[(toIPv6('::ffff:1.2.3.4'), toDecimal64('1.25', 2), toDate32('2299-12-31'))]",
                         [["::ffff:102:304", "1.25", "2299-12-31"]]),
    "keys": ("(map(toDate('2024-01-02'), 1), map((1, 2), 'a'), map(1, 'b'), map(true, 'c'), "
             "map(toDateTime('2024-01-02 03:04:05', 'UTC'), 'd'))",
             [{"2024-01-02": 1}, {"[1,2]": "a"}, {"1": "b"}, {"true": "c"}, {"2024-01-02T03:04:05+00:00": "d"}]),
    "bytes": ("(unhex('FFFE'), toFixedString(unhex('FFFE'), 2), toFixedString('\\xC3\\xA9', 2))",
              ["fffe", "fffe", "é"]),  # not UTF-8: hex, String and FixedString alike; UTF-8: the text
    "no_number": ("[inf, -inf, nan, 1.5]", [None, None, None, 1.5]),
    "nullable_deep": ("[toNullable(toDecimal32('2.5', 1)), NULL]", ["2.5", None]),
    "dynamic_json": ("CAST('{\"t\": \"12:00:00\", \"d\": \"2024-01-02\"}', 'JSON(t Time, d Date)')",
                     {"t": "12:00:00", "d": "2024-01-02"}),
    "variant_array": ("[CAST(toDecimal32('9.5', 1), 'Variant(Decimal(9, 1), IPv4)'), "
                      "CAST(toIPv4('1.1.1.1'), 'Variant(Decimal(9, 1), IPv4)')]", ["9.5", "1.1.1.1"]),
    "tuple_unnamed": ("(1, 'a', toTime64('00:00:00', 3), toDateTime64('2024-01-02 03:04:05.123456789', 9, 'UTC'))",
                      [1, "a", "00:00:00", "2024-01-02T03:04:05.123456+00:00"]),  # the driver stops at µs
    "enum_in_map": ("map('k', CAST(1, 'Enum8(''on'' = 1)'))", {"k": "on"}),
}


def test_every_type_family_of_the_engine_has_a_case_here(store):
    families = {r[0] for r in store.query("SELECT name FROM system.data_type_families WHERE alias_to = ''",
                                          read_only=False).rows}
    assert len(families) > 50, families  # the engine's own list, not an empty answer
    missing = families - set(TYPES) - set(NOT_RETURNED)
    assert not missing, (f"the engine has type families with no case in TYPES: {sorted(missing)}; add a literal of "
                         "each and the JSON /sql must answer for it")
    assert not (set(TYPES) | set(NOT_RETURNED)) - families, "TYPES names a family the engine doesn't have"


@pytest.mark.parametrize("cases", [TYPES, NESTED], ids=["every_family", "nested"])
def test_every_type_the_engine_returns_is_answered_as_json(server, cases):
    """The issue's finding: SELECT toIPv4('1.2.3.4') was a 500 (IPv4Address is not JSON serializable).
    All the cases in one SELECT, through the real port, read back by httpx's JSON parser."""
    r = post(server, "SELECT " + ", ".join(f"{sql} AS `{name}`" for name, (sql, _) in cases.items()))
    assert r.status_code == 200, r.text[:2000]
    body = r.json()
    assert body["columns"] == list(cases)
    [row] = body["rows"]
    got = dict(zip(body["columns"], row))
    if cases is TYPES:
        for name, shown in zip(body["columns"], body["types"]):
            family = SHOWN_AS.get(name, name)
            assert re.search(rf"(?<![A-Za-z]){family}(?![0-9A-Za-z])", shown), \
                f"the literal for {name} gave a {shown}: it doesn't test {name}"
    wrong = {name: (got[name], want) for name, (_, want) in cases.items() if got[name] != want}
    assert not wrong, "values answered otherwise than json_safe's rules say (got, want): " + repr(wrong)
    # types match too: a Decimal is text (a float would have rounded it), a big integer an exact number
    if cases is TYPES:
        assert isinstance(got["Decimal128"], str) and isinstance(got["UInt256"], int)


def test_a_value_json_safe_does_not_know_is_named_not_guessed():
    with pytest.raises(TypeError, match=r"no JSON form for a value of Python type builtins\.complex"):
        json_safe([{"k": 1j}])


def test_aggregation_states_are_a_400_saying_what_to_do(server):
    r = post(server, "SELECT (SELECT sumState(toUInt64(1))) AS s")
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "AggregateFunction" in message and "finalizeAggregation" in message, message
    r = post(server, "SELECT finalizeAggregation((SELECT sumState(toUInt64(1)))) AS s")
    assert r.status_code == 200 and r.json()["rows"] == [[1]], r.text  # and the reader it ran on still reads


# -- every reader busy: 503 and Retry-After on each route ---------------------------------------------------


def test_every_reader_busy_is_a_503_with_retry_after_on_every_route():
    """/api/dashboard answered 500 after 10 s where /sql answered 503. All the readers of a real pool are held
    (each by a thread inside ReaderPool.run, until released); a short wait keeps the test quick."""
    base = new_store()
    store = HistoryStore(base.client, base.database, limits=LIMITS)
    store.readers.wait_s = 0.5
    srv = HistoryServer(store, TOKEN, "127.0.0.1", 0).start()
    held, release = threading.Semaphore(0), threading.Event()

    def hold(reader):
        held.release()
        release.wait(30)

    holders = [threading.Thread(target=store.readers.run, args=(hold,)) for _ in range(store.readers.size)]
    try:
        assert wait_ready(f"{srv.url}/health", 5), "the SQL server did not answer"
        for t in holders:
            t.start()
        for _ in holders:
            assert held.acquire(timeout=30), "a holder never got its reader"
        answers = {"/sql": post(srv, "SELECT 1"),
                   "/api/dashboard": httpx.get(f"{srv.url}/api/dashboard", headers=AUTH, timeout=30),
                   "/api/dashboard?project": httpx.get(f"{srv.url}/api/dashboard", params={"project": "p"},
                                                       headers=AUTH, timeout=30)}
        for route, r in answers.items():
            assert r.status_code == 503, (route, r.status_code, r.text)
            assert r.headers.get("retry-after") == str(RETRY_AFTER_S), (route, r.headers)
            assert "busy" in r.json()["error"]["message"], (route, r.text)
    finally:
        release.set()
        for t in holders:
            t.join(10)
    try:
        r = httpx.get(f"{srv.url}/api/dashboard", headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json()["days"] == 30, r.text  # the readers are back: answered
    finally:
        srv.stop()
