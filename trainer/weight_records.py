"""The WeightVersion records as the online trainer follows them: every version announced on
``tabloop.weights``, and which one serves each project.

The trainer reads the topic whole when ``run`` starts, then keeps reading it, and reads back what it
published itself; each record is kept once (by event id).
"""

from __future__ import annotations

from policy.weight_store import VersionStatus, fold_statuses, promoted_version
from schemas.events import Event


class WeightRecords:
    def __init__(self, base_model: str):
        self.base_model = base_model
        self.reset()

    def reset(self) -> None:
        """Forget every record (``run`` reads the topic again from its start)."""
        self.records: list[dict] = []
        self._event_ids: set = set()
        self.serving_version = 0
        """The version users are served (``promoted_version`` of the weight records), kept as they come."""
        self.project_serving: dict[str, int] = {}
        """project -> its own promoted version (absent or 0: the shared policy serves it)."""
        self.version_project: dict[int, str] = {}
        """version -> the project it was trained for ("" the shared policy), of this base model's versions."""

    def add(self, record: dict) -> bool:
        """Keep a WeightVersion record unless it is one already kept. The weights consumer reads the topic
        from its start, after ``run`` read it whole, and it reads back what this trainer published: a
        replayed CANDIDATE after its decision would bring a decided canary back to life."""
        if record["event_id"] in self._event_ids:
            return False
        self._event_ids.add(record["event_id"])
        self.records.append(record)
        project = record.get("project_id") or ""
        if record["base_model"] == self.base_model:
            self.version_project[record["version"]] = project
        if project:
            self.project_serving[project] = promoted_version(self.records, self.base_model, project)
        else:
            self.serving_version = promoted_version(self.records, self.base_model)
        return True

    def serving_of(self, project: str) -> int:
        """The version a project's users are served: its own promoted version, else the shared one."""
        return self.project_serving.get(project) or self.serving_version

    def statuses(self) -> dict[int, VersionStatus]:
        """Each version's newest status (``policy.weight_store.fold_statuses``)."""
        return fold_statuses(self.records, self.base_model)


def publish(producer, records: WeightRecords, event: Event) -> None:
    """Publish a WeightVersion, wait for Kafka's ack, and keep its record (as the weights consumer would)."""
    producer.publish(event)
    producer.flush()
    records.add(event.record)
