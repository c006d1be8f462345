"""Show-gate pickup: follow ``tabloop.gates`` and keep, per project, the gate the front door scores with.

Every replica reads the whole (compacted) topic without a consumer group, as the weight watcher does, and
applies the rule the learner and ``tabloop gates`` apply (``policy.show_gate.serving_gates`` / ``gate_for``):
a project is served its newest PROMOTED gate that has not been ROLLED_BACK (a rollback goes back to the gate
promoted before it), a project with no gate of its own the shared one (project ""), and with none at all
every completion is shown. Installing a gate is swapping one small dict: no restart, no reload of weights,
and a request keeps the gate it started with.
"""

from __future__ import annotations

import logging
import threading

from infra.bus import decoded_records, make_codec, whole_topic_reader
from infra.settings import Settings
from policy.show_gate import Gate, gate_for, serving_gates
from schemas.topics import GATES

log = logging.getLogger("tabloop.gates")


class GateWatcher:
    """Follows ``tabloop.gates`` in a thread of its own; ``for_project`` is what a request asks."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.codec = make_codec(settings)
        self.latest: dict[tuple[str, int], dict] = {}
        """(project, version) -> its newest record: what compaction keeps, and all the rule needs."""
        self.gates: dict[str, Gate] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="tabloop-gates", daemon=True)

    def for_project(self, project: str) -> Gate | None:
        return gate_for(self.gates, project)  # the dict is replaced whole, never changed in place

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _follow(self) -> None:
        consumer = whole_topic_reader(self.settings, "tabloop-gates", GATES.name)
        try:
            while not self._stop.is_set():
                changed = False
                for record in decoded_records(self.codec, consumer.consume(500, 0.5), "gate"):
                    self.latest[(record.get("project_id") or "", record["version"])] = record
                    changed = True
                if not changed:
                    continue
                gates = serving_gates(list(self.latest.values()))
                for project in dict.fromkeys([*self.gates, *gates]):
                    gate = gates.get(project)
                    if gate != self.gates.get(project):
                        label = f"project {project}: " if project else ""
                        log.info("%sshow-gate %s", label, f"v{gate.version} (threshold {gate.threshold:.3f})"
                                 if gate else "none of its own")
                self.gates = gates
        except Exception:
            log.exception("the gate watcher stopped; the gates it had stay in force")
        finally:
            consumer.close()
