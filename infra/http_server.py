"""Serving HTTP on a socket of our own: the listening socket and uvicorn's h11 protocol with deadlines on
receiving a request. The front door's two ports and the history port use both, so a slow or silent client
is closed the same way everywhere."""

from __future__ import annotations

import asyncio
import logging
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("tabloop.http")
BODY_GRACE_S = 5.0
"""The connection-level body deadline trails the app's own (read_json's 408) by this much, so a client
whose body is being read gets the 408; the deadline only closes connections whose body nobody reads."""


def bind(host: str, port: int) -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say so, and without it
    # each streamed chunk after the first waits ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines on receiving a request, which uvicorn has none of.

    uvicorn's keep-alive timer runs only between requests, so a client that connects and sends nothing,
    or half a request line, or trickles headers a byte at a time, holds its connection forever. Here the
    request line and headers must all arrive within ``header_timeout_s`` of the connection opening (or of
    the first byte of the next request on a kept-alive connection), and the body within
    ``body_timeout_s`` (+ BODY_GRACE_S) of the headers; else the connection gets a 408 and is closed.
    Bytes arriving do not push a deadline back. Once a request is in, it has no deadline: generation
    and streamed responses take as long as they take.
    """

    header_timeout_s = 10.0
    body_timeout_s = 30.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._awaiting: str | None = None  # "headers" or "body": what the running deadline is for

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._await(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow(data_came=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow(data_came=False)

    def _follow(self, data_came: bool) -> None:
        """Arm, keep or cancel the deadline for what the client owes us now."""
        if self.transport.is_closing():
            return self._await(None)
        state = self.conn.their_state
        if state is h11.IDLE:
            # Between requests uvicorn's keep-alive timer closes an idle connection; a deadline starts with
            # the first byte of the next request (or one already buffered behind the last response).
            if data_came or self.conn.trailing_data[0]:
                self._await("headers")
            else:
                self._await(None)
        elif state is h11.SEND_BODY:
            self._await("body")
        else:  # the request is in (DONE), or the connection is ending
            self._await(None)

    def _await(self, what: str | None) -> None:
        if what == self._awaiting:
            return  # a running deadline is never pushed back
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._awaiting = what
        if what is not None:
            seconds = self.header_timeout_s if what == "headers" else self.body_timeout_s + BODY_GRACE_S
            self._deadline = self.loop.call_later(seconds, self._expire, what, seconds)

    def _expire(self, what: str, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if what == "headers" or not self.cycle.response_started:
            # Say why before closing; written raw, as h11 has no request to answer while the headers are
            # incomplete. (A request already answered, its body still trickling in, is just closed.)
            text = f"request {what} not received within {seconds:g}s".encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text))
        log.info("closed a connection from %s: request %s not received within %gs", self.client, what, seconds)
        self.transport.close()


def guarded_protocol(settings) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, with this server's deadlines."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": settings.header_timeout_s,
                                                              "body_timeout_s": settings.body_timeout_s})


class BodyRefused(Exception):
    """A request body not taken: what to answer (status, message, headers)."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


async def read_body(request, max_bytes: int, timeout_s: float | None = None) -> bytes:
    """A request's body, checked as it comes: 413 on a Content-Length over ``max_bytes`` before a byte is
    read, or as soon as the streamed bytes pass it; 408 when it has not all come within ``timeout_s``; 400
    for a client that went away mid-body (ordinary: no traceback; the answer goes nowhere). Raises
    BodyRefused with the answer; the front door and the history port each shape it their way."""
    import anyio
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise BodyRefused(413, f"request body of {declared} bytes is over the {max_bytes}-byte limit")
    body = bytearray()
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_bytes:
                    raise BodyRefused(413, f"request body is over the {max_bytes}-byte limit")
    except ClientDisconnect:
        raise BodyRefused(400, "the client went away before its body came", {"Connection": "close"}) from None
    except TimeoutError:
        # Connection: close, as the rest of the body may still be on its way.
        raise BodyRefused(408, f"request body not received within {timeout_s:g}s ({len(body)} bytes came)",
                          {"Connection": "close"}) from None
    return bytes(body)
