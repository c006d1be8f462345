"""Ends a process whose loop is stuck inside one call, so that a restart begins with fresh clients.

librdkafka's synchronous commit can block for good when the broker goes away while the request is out: in
CI's fuzz drill (the ``kafka-30s`` schedule) the history sink's loop blocked in one call for 20 minutes from
the moment the broker stopped, through its restart, and did not even end on SIGTERM (no librdkafka log line
either, which its polls deliver: every sign points at the commit, the one call that waits on the broker
without a timeout). Its health was "alive", so nothing restarted it, and the history fell behind for good. A call that never returns cannot be interrupted from Python;
the process can only end. The loops guarded here commit their offsets only after their work is durable (the
sink's rows are in ClickHouse, the trainer's version is saved), so ending one loses nothing acknowledged:
its successor reads from the last commit and skips or redoes what came after.

A loop can also be stuck while every call returns: its consumer holds no partition and never gets one back.
In a clean-clone CI the history sink's session timed out while the restarted broker was still loading its
coordinators ("session timed out (in join-state steady) … revoking assignment and rejoining group"), and the
rejoin never finished: polls returned nothing for 8 minutes with 3,376 events behind, health "alive".
librdkafka's rejoin of a static member (``group.instance.id``) can hang so (confluentinc/librdkafka#3437); a
fresh consumer with the same instance id takes the member's place. ``held_partitions`` ends such a loop the
same way, once it has held no partition for the same limit.

    guard = StallGuard("tabloop history", settings.stall_limit_s).start()
    with guard.call("committing offsets to Kafka"):
        consumer.commit(...)
    guard.held_partitions(len(consumer.assignment()))
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
        self._unassigned_since: float | None = None
        self._unassigned_reported = False
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

    def held_partitions(self, count: int, now: float | None = None) -> None:
        """Called by the loop after each poll with how many partitions its consumer holds: none for longer
        than the limit ends the process (or is handed to ``on_stall`` once per such stretch)."""
        now = time.monotonic() if now is None else now
        if count > 0:
            self._unassigned_since, self._unassigned_reported = None, False
            return
        if self._unassigned_since is None:
            self._unassigned_since = now
        held_none_s = now - self._unassigned_since
        if held_none_s < self.limit_s or self._unassigned_reported:
            return
        self._unassigned_reported = True
        self._stalled(f"{self.name}: its Kafka consumer has held no partition for {held_none_s:.0f} s (limit "
                      f"{self.limit_s:g} s, TABLOOP_STALL_LIMIT_S): a group rejoin that never finished, or a broker "
                      "away that long; ending the process so that a restart begins with a fresh consumer "
                      "(offsets are committed only after the work is stored: nothing acknowledged is lost)")

    def _stalled(self, message: str) -> None:
        log.critical(message)
        self.stalls.append(message)
        if self.on_stall is not None:
            self.on_stall(message)
            return
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(EXIT_STALLED)

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
            reported = current
            self._stalled(f"{self.name}: {what} has not returned after {blocked_s:.0f} s (limit {self.limit_s:g} "
                          "s, TABLOOP_STALL_LIMIT_S); ending the process so that a restart begins with fresh "
                          "clients (offsets are committed only after the work is stored: nothing acknowledged "
                          "is lost)")


def guarded(guard: StallGuard | None, what: str) -> AbstractContextManager:
    """``guard.call(what)``, or nothing where the loop runs without a guard (in-process tests, library use)."""
    return guard.call(what) if guard is not None else nullcontext()


def held_partitions(guard: StallGuard | None, consumer) -> None:
    """``guard.held_partitions`` with the consumer's assignment (a local call, no broker round trip); nothing
    without a guard. From the loop's own thread: a consumer is not to be called from two."""
    if guard is not None:
        guard.held_partitions(len(consumer.assignment()))
