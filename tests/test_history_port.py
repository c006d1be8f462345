"""The history port as hardened as the front door (issue 29): deadlines on headers and bodies, the body's
size checked before it is read, hostile JSON answered 400, no traceback for a client that goes away, and a
memory cap over all the process's queries together. A real server on a free port, raw sockets and httpx."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest

from infra.local import wait_ready
from streams.history.guard import QueryLimits
from streams.history.sink import HistoryStore
from streams.history.sql import MAX_QUERY_BYTES, HistoryServer
from tests.history_fixture import new_store

TOKEN = "tlh_port"
HEADER_TIMEOUT_S = 1.0
LIMITS = QueryLimits(timeout_s=10, max_memory_bytes=64 * 2**20, max_total_memory_bytes=96 * 2**20)


@pytest.fixture(scope="module")
def server():
    base = new_store()
    store = HistoryStore(base.client, base.database, limits=LIMITS)
    srv = HistoryServer(store, TOKEN, "127.0.0.1", 0, header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=1.0).start()
    assert wait_ready(f"{srv.url}/health", 5), "the SQL server did not answer"
    yield srv
    srv.stop()


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


def test_the_queries_together_have_one_memory_cap(server):
    r = httpx.post(f"{server.url}/sql", json={"query": "SELECT getSetting('max_memory_usage_for_user') AS m"},
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200 and r.json()["rows"] == [[LIMITS.max_total_memory_bytes]], r.text
