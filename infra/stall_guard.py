"""Ends a process whose loop is stuck inside one call, so that a restart begins with fresh clients.

librdkafka's synchronous commit can block for good when the broker goes away while the request is out: in
CI's fuzz drill (the ``kafka-30s`` schedule) the history sink's loop blocked in one call for 20 minutes from
the moment the broker stopped, through its restart, and did not even end on SIGTERM (no librdkafka log line
either, which its polls deliver: every sign points at the commit, the one call that waits on the broker
without a timeout). Its health was "alive", so nothing restarted it, and the history fell behind for good. A call that never returns cannot be interrupted from Python;
the process can only end. The loops guarded here commit their offsets only after their work is durable (the
sink's rows are in ClickHouse, the trainer's version is saved), so ending one loses nothing acknowledged:
its successor reads from the last commit and skips or redoes what came after.

    guard = StallGuard("tabloop history", settings.stall_limit_s).start()
    with guard.call("committing offsets to Kafka"):
        consumer.commit(...)
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Callable, Iterator

log = logging.getLogger("tabloop.stall")

EXIT_STALLED = 77
"""The exit code of a process ended by its guard: the supervisor restarts it (as after any crash)."""


class StallGuard:
    """Watches the calls one thread makes inside ``call``; one that has not returned ``limit_s`` after it
    began ends the process (exit code ``EXIT_STALLED``), or, with ``on_stall``, is handed to it once instead
    (a test, or a caller that runs the loop in a thread of its own).

    One call at a time: the guarded loop is one thread; a ``call`` inside another is not watched on its own
    (the outer one's clock keeps running)."""

    def __init__(self, name: str, limit_s: float, *, on_stall: Callable[[str], None] | None = None,
                 check_every_s: float | None = None):
        if limit_s <= 0:
            raise ValueError(f"a stall limit must be more than 0 s, not {limit_s}")
        self.name = name
        self.limit_s = limit_s
        self.on_stall = on_stall
        self.check_every_s = check_every_s if check_every_s is not None else min(5.0, limit_s / 4)
        self.stalls: list[str] = []
        self._current: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "StallGuard":
        self._thread = threading.Thread(target=self._watch, name=f"stall-guard {self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.check_every_s + 1)

    @contextmanager
    def call(self, what: str) -> Iterator[None]:
        """Watch the block's duration; ``what`` names it in the message when it stalls."""
        if self._current is not None:  # nested: the outer call is the one watched
            yield
            return
        self._current = (what, time.monotonic())
        try:
            yield
        finally:
            self._current = None

    def _watch(self) -> None:
        reported: tuple[str, float] | None = None
        while not self._stop.wait(self.check_every_s):
            current = self._current
            if current is None or current is reported:
                continue
            what, since = current
            blocked_s = time.monotonic() - since
            if blocked_s < self.limit_s:
                continue
            message = (f"{self.name}: {what} has not returned after {blocked_s:.0f} s (limit {self.limit_s:g} s, "
                       "TABLOOP_STALL_LIMIT_S); ending the process so that a restart begins with fresh clients "
                       "(offsets are committed only after the work is stored: nothing acknowledged is lost)")
            log.critical(message)
            self.stalls.append(message)
            if self.on_stall is not None:
                reported = current
                self.on_stall(message)
                continue
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(EXIT_STALLED)


def guarded(guard: StallGuard | None, what: str) -> AbstractContextManager:
    """``guard.call(what)``, or nothing where the loop runs without a guard (in-process tests, library use)."""
    return guard.call(what) if guard is not None else nullcontext()
