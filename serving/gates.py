"""Show-gate pickup: follow ``tabloop.gates`` and keep, per project, the gate the front door scores with.

Every replica reads the whole (compacted) topic without a consumer group, as the weight watcher does. The
rule (``fold_gate_event`` and ``gate_for``, pure): a project is served its newest PROMOTED gate that has not
been ROLLED_BACK; a rollback of it goes back to the gate promoted before it; a project with no gate of its
own gets the shared one (project ""); with none at all every completion is shown. Installing a gate is
swapping one small object: no restart, no reload of weights, and a request keeps the gate it started with.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from infra.bus import decode_message, make_codec
from infra.settings import Settings
from policy.show_gate import Gate
from schemas.topics import GATES

log = logging.getLogger("tabloop.gates")


@dataclass(frozen=True)
class GateHistory:
    """One project's gate versions as the topic told them: promoted ones in order, and those rolled back."""

    promoted: tuple[Gate, ...] = ()
    rolled_back: frozenset[int] = frozenset()

    def serving(self) -> Gate | None:
        return next((g for g in reversed(self.promoted) if g.version not in self.rolled_back), None)


def fold_gate_event(book: dict[str, GateHistory], record: dict) -> dict[str, GateHistory]:
    """Pure rule: the book after one GateVersion record (a new dict when it changes). A gate over features
    this build does not compute is skipped with an error in the log, never served."""
    project = record.get("project_id") or ""
    history = book.get(project, GateHistory())
    status = record["status"]
    if status == "PROMOTED":
        try:
            gate = Gate.from_record(record)
        except ValueError as exc:
            log.error("gate v%s of project %r not served: %s", record.get("version"), project, exc)
            return book
        kept = tuple(g for g in history.promoted if g.version != gate.version)
        after = replace(history, promoted=kept + (gate,), rolled_back=history.rolled_back - {gate.version})
    elif status == "ROLLED_BACK":
        after = replace(history, rolled_back=history.rolled_back | {record["version"]})
    else:  # CANDIDATE: not served (gates are promoted on their off-policy estimate, without a canary)
        return book
    return {**book, project: after}


def gate_for(book: dict[str, GateHistory], project: str) -> Gate | None:
    """The gate a project's completions are scored with: its own, else the shared one, else none."""
    own = book.get(project)
    gate = own.serving() if own is not None else None
    if gate is None and project:
        shared = book.get("")
        gate = shared.serving() if shared is not None else None
    return gate


class GateWatcher:
    """Follows ``tabloop.gates`` in a thread of its own; ``for_project`` is what a request asks."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.codec = make_codec(settings)
        self.book: dict[str, GateHistory] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="tabloop-gates", daemon=True)

    def for_project(self, project: str) -> Gate | None:
        return gate_for(self.book, project)  # the book is replaced whole, never changed in place

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _follow(self) -> None:
        consumer = Consumer({"bootstrap.servers": self.settings.kafka_bootstrap, "group.id": "tabloop-gates",
                             "enable.auto.commit": False, "log_level": 3})
        consumer.assign([TopicPartition(GATES.name, 0, OFFSET_BEGINNING)])
        try:
            while not self._stop.is_set():
                book = self.book
                for m in consumer.consume(500, 0.5):
                    if m.error() is not None:
                        continue  # e.g. the topic is not created yet: keep polling
                    received = decode_message(self.codec, m)
                    if received.event is None:
                        log.error("undecodable gate event at offset %d: %s", m.offset(), received.error)
                        continue
                    book = fold_gate_event(book, received.event.record)
                if book is not self.book:
                    for project, history in book.items():
                        gate = history.serving()
                        before = self.book.get(project)
                        if before is None or before.serving() != gate:
                            label = f"project {project}: " if project else ""
                            log.info("%sshow-gate %s", label, f"v{gate.version} (threshold {gate.threshold:.3f})"
                                     if gate else "none: every completion is shown")
                    self.book = book
        except Exception:
            log.exception("the gate watcher stopped; the gates it had stay in force")
        finally:
            consumer.close()
