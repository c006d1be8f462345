"""A policy per project (``TABLOOP_PROJECT_POLICIES``), beside the shared one.

Every episode trains the shared policy; once an opted-in project has ``project_min_episodes`` trainable
episodes, its episodes also train a LoRA adapter of its own, which starts from the shared policy's newest
saved version. At each save point every project policy updated since its last save is written first (a
version with the project's id), then the shared version, whose manifest lists each project's version
(``manifest_metrics``): it is the save point's commit record. A restart loads the project versions the
newest shared manifest names; a project version written after it (a crash between the two) is never
announced, and its episodes are trained again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from infra.settings import Settings
from policy.weight_store import Manifest
from trainer.checkpoints import Checkpoints, averaged
from trainer.learner import PolicyTrainer, Sample
from trainer.update import Batch, project_update
from trainer.weight_records import WeightRecords

log = logging.getLogger("tabloop.trainer")

PROJECT_VERSION = "project_version/"  # shared manifest metrics: the project versions saved with it
PROJECT_EPISODES = "project_episodes/"  # ... and each opted-in project's trainable episodes so far


@dataclass
class ProjectPolicy:
    """A project's own policy: a LoRA adapter trained on that project's episodes only."""

    project: str
    policy: PolicyTrainer
    version: int
    """Its newest saved version; 0 before the first (it starts from the shared policy's weights)."""
    updates: int = 0
    trained: int = 0
    update_metrics: list[dict] = field(default_factory=list)


class ProjectPolicies:
    """The projects' own policies, restored from the newest shared manifest (``saved``), trained, saved and
    rolled back beside the shared policy."""

    def __init__(self, settings: Settings, checkpoints: Checkpoints, saved: Manifest | None):
        self.settings = settings
        self.checkpoints = checkpoints
        metrics = saved.metrics if saved is not None else {}
        self.episodes = {k.removeprefix(PROJECT_EPISODES): int(v) for k, v in metrics.items()
                         if k.startswith(PROJECT_EPISODES)}
        """project -> its trainable episodes so far (opted-in projects)."""
        self.policies: dict[str, ProjectPolicy] = {}
        for key, version in metrics.items():
            if key.startswith(PROJECT_VERSION):
                project = key.removeprefix(PROJECT_VERSION)
                manifest = checkpoints.store.manifest(int(version)) if version else saved
                self.policies[project] = ProjectPolicy(project, checkpoints.load(manifest), int(version))

    def count(self, project: str) -> None:
        """One more trainable episode of ``project``."""
        if self.settings.has_project_policy(project):
            self.episodes[project] = self.episodes.get(project, 0) + 1

    def update(self, samples: list[Sample], batch: Batch, *, shared_version: int,
               log_metrics: Callable[..., None]) -> None:
        """Each project's own policy trains on that project's ``samples`` of the batch (with the same advantages:
        the baseline is already per project). A project gets its policy once it has enough episodes."""
        for project in dict.fromkeys(batch.projects):
            if (project not in self.policies and self.settings.has_project_policy(project)
                    and self.episodes.get(project, 0) >= self.settings.project_min_episodes):
                start = self.checkpoints.store.manifest(shared_version) if shared_version else None
                log.info("project %s: %d episodes, its own policy starts from version %d", project,
                         self.episodes[project], shared_version)
                self.policies[project] = ProjectPolicy(project, self.checkpoints.load(start), 0)
            own = self.policies.get(project) if self.settings.has_project_policy(project) else None
            if own is None:
                continue
            rows = [i for i, p in enumerate(batch.projects) if p == project]
            metrics = project_update(own.policy, [samples[i] for i in rows], [batch.rewards[i] for i in rows])
            own.updates += 1
            own.trained += len(rows)
            own.update_metrics.append(metrics)
            log_metrics(metrics, project=project)
            log.info("project %s: update done on %d episodes, reward %.3f, kl %.4f", project, len(rows),
                     metrics["reward_mean"], metrics["approx_kl"])

    def save(self, own: ProjectPolicy, write: Callable[[PolicyTrainer, dict], Manifest], *, shared_version: int,
             trainer_step: int) -> Manifest:
        """A project's version: its adapter, the episodes it trained on since its last save, the same offsets."""
        manifest = write(own.policy, dict(
            parent_version=own.version or shared_version, trainer_step=trainer_step,
            episodes_consumed=own.trained, episodes_trained=own.trained, episodes_dropped={},
            metrics=averaged(own.update_metrics), project_id=own.project))
        log.info("project %s: version %d saved (%d episodes trained)", own.project, manifest.version, own.trained)
        own.version, own.updates, own.trained = manifest.version, 0, 0
        own.update_metrics.clear()
        return manifest

    def manifest_metrics(self) -> dict[str, float]:
        """What the shared manifest says of the projects: each one's version saved with it, its episodes."""
        out = {f"{PROJECT_VERSION}{proj}": float(own.version) for proj, own in self.policies.items()}
        out.update({f"{PROJECT_EPISODES}{proj}": float(n) for proj, n in self.episodes.items()})
        return out

    def resume(self, records: WeightRecords, *, shared_version: int, newest: int) -> None:
        """The resume rule for project policies: each goes on from the project's own promoted version, else
        from the shared policy's serving weights (``shared_version``; ``newest``: the newest one written)."""
        for project, own in list(self.policies.items()):
            own_target = records.project_serving.get(project, 0)
            if own.version == own_target and (own_target or shared_version == newest):
                continue
            start = own_target or shared_version
            manifest = self.checkpoints.store.manifest(start) if start else None
            log.info("project %s: resuming from version %d, the version serving it (its newest written: %d)", project,
                     manifest.version if manifest is not None else 0, own.version)
            self.policies[project] = ProjectPolicy(project, self.checkpoints.load(manifest), own_target)

    def follow_rollbacks(self, records: WeightRecords) -> None:
        """A project whose own version was rolled back goes on from its promoted version, or, with none, starts
        again from the shared policy's serving version (its updates since the last save are discarded)."""
        statuses = records.statuses()
        for project, own in list(self.policies.items()):
            status = statuses.get(own.version)
            if own.version == 0 or status is None or status.status != "ROLLED_BACK":
                continue
            target = records.project_serving.get(project, 0) or records.serving_version
            if target == own.version:
                continue
            manifest = self.checkpoints.saved(target)
            log.info("project %s: version %d was rolled back: its policy goes on from version %d", project,
                     own.version, manifest.version if manifest is not None else 0)
            self.policies[project] = ProjectPolicy(project, self.checkpoints.load(manifest),
                                                   target if records.project_serving.get(project) else 0)
