"""`tabloop train`: continuous PPO on ``tabloop.episodes``, publishing weight versions.

The loop, in the order that makes a crash harmless:

1. poll episodes (a consumer group; one second at a time, so an idle trainer
   costs nothing); each becomes a training sample or is dropped and counted
   (too stale, empty);
2. when ``trainer_batch_size`` samples are waiting, or the oldest has waited
   ``trainer_batch_wait_s``, run one policy update;
3. every ``trainer_save_every`` updates: write the weights and a manifest to the
   weight store (the manifest last, fsynced), publish the WeightVersion and wait
   for Kafka's ack, and only then commit the consumer offsets.

A restart seeks every partition to the newest manifest's ``source_offsets``:
episodes trained after that manifest are trained again (their effect was lost
with the process), none twice into a saved version and none skipped. Its
weights are those of the version serving (the resume rule,
``_resume_from_serving``): the promoted version not rolled back, else the base
model; a newer version still on canary, or rolled back, is never a starting
point. Run one trainer per base model: a second member of the group would take
half the partitions.

The canary rule: a canary is decided (PROMOTED, ROLLED_BACK, or withdrawn after
``canary_max_wait_s``, a WeightVersion saying so) before the next version of
its project goes out; the updates made meanwhile are folded into that next
version (``_waiting_for_canary``).

A policy per project (``TABLOOP_PROJECT_POLICIES``): every episode trains the
shared policy; once an opted-in project has ``project_min_episodes`` trainable
episodes, its episodes also train a LoRA adapter of its own, which starts from
the shared policy's newest saved version. At each save, every project policy
updated since its last save is written first (a version with the project's id),
then the shared version, whose manifest lists each project's version: it is the
save point's commit record. A restart loads the project versions the newest
shared manifest names; a project version written after it (a crash between the
two) is never announced, and its episodes are trained again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from infra.bus import EventProducer, decode_message, make_codec
from infra.settings import Settings
from schemas.topics import EPISODES, WEIGHTS
from trainer.canary import BASELINE_VERSION, CANARY_SHARE, CanaryTally
from trainer.episodes import drop_reason, episode_sample, episode_sampler
from trainer.promotion import (OPE_PREFIX, GateDecision, HeldOutPool, estimate_metrics, gate_decision, gate_reward,
                          in_gate_holdout)
from trainer.head_feed import HeadFeed
from trainer.losses import BaselineState, baseline_advantages
from trainer.learner import PolicyTrainer, Sample, UpdateConfig, describe_device
from policy.weight_store import (Manifest, WeightStore, base_version_event, fold_statuses, promoted_version,
                                  read_weight_records, version_event)

log = logging.getLogger("tabloop.trainer")


@dataclass
class Pending:
    """Samples waiting for the next update, and what they came from."""

    samples: list[Sample] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    projects: list[str] = field(default_factory=list)
    accepted: int = 0
    staleness: list[int] = field(default_factory=list)
    first_at: float | None = None


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


CANARY_WITHDRAWN = "canary_withdrawn"
"""WeightVersion metric: 1 on the CANDIDATE (canary share 0) that withdraws a canary nobody decided in time."""
CANARY_WAITED_S = "canary_waited_s"
PROJECT_VERSION = "project_version/"  # shared manifest metrics: the project versions saved with it
PROJECT_EPISODES = "project_episodes/"  # ... and each opted-in project's trainable episodes so far


@dataclass
class Progress:
    """What the next version's manifest will say about its episodes."""

    offsets_start: dict[str, int]
    offsets: dict[str, int]
    consumed: int = 0
    trained: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    updates: int = 0
    update_metrics: list[dict] = field(default_factory=list)


def update_config(settings: Settings) -> UpdateConfig:
    return UpdateConfig(lr=settings.trainer_lr, warmup_updates=settings.trainer_warmup_updates,
                        clip_eps=settings.trainer_clip_eps, clip_ratio_c=settings.trainer_clip_ratio_c,
                        kl_coef=settings.trainer_kl_coef,
                        entropy_coef=settings.trainer_entropy_coef, max_grad_norm=settings.trainer_max_grad_norm,
                        micro_batch=settings.trainer_micro_batch, epochs=settings.trainer_epochs)


class OnlineTrainer:
    def __init__(self, settings: Settings, *, topic: str = EPISODES.name, group_id: str | None = None):
        from policy.models import use_torch_threads
        from trainer.build_models import build_named_model

        use_torch_threads(settings.torch_threads)
        self.settings = settings
        self.topic = topic
        self.group_id = group_id or settings.trainer_group
        self.base_model = build_named_model(settings)
        self.store = WeightStore(settings.effective_weight_store, self.base_model)
        self.device = describe_device(settings.trainer_device)
        self.stop_event = threading.Event()
        self.log_dir = Path(settings.trainer_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._file_log = logging.FileHandler(self.log_dir / "trainer.log")
        self._file_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger("tabloop").addHandler(self._file_log)
        if logging.getLogger("tabloop").level == logging.NOTSET:
            logging.getLogger("tabloop").setLevel(logging.INFO)

        latest = self.store.latest(project="")
        self.policy = self._load_policy(latest)
        self.version = latest.version if latest else 0
        self.total_consumed = latest.episodes_consumed_total if latest else 0
        self.trainer_step = latest.trainer_step if latest else 0
        offsets = dict(latest.source_offsets) if latest else {}
        self.progress = Progress(dict(offsets), dict(offsets))
        baseline = _baseline_from(latest) if latest is not None else BaselineState.empty()
        self.baseline = baseline
        manifests = self.store.manifests()
        self.shared_versions = sorted(m.version for m in manifests if not m.project_id)
        saved = latest.metrics if latest is not None else {}
        self.project_episodes = {k.removeprefix(PROJECT_EPISODES): int(v) for k, v in saved.items()
                                 if k.startswith(PROJECT_EPISODES)}
        self.projects: dict[str, ProjectPolicy] = {}
        for key, version in saved.items():
            if key.startswith(PROJECT_VERSION):
                project = key.removeprefix(PROJECT_VERSION)
                manifest = self.store.manifest(int(version)) if version else latest
                self.projects[project] = ProjectPolicy(project, self._load_policy(manifest), int(version))
        self.pending = Pending()
        self._tail_committed: dict[str, int] = {}  # offsets committed past dropped episodes (no version)
        self.producer = EventProducer(settings, client_id="tabloop-trainer")
        self.codec = make_codec(settings)
        self.weight_records: list[dict] = []
        self._weight_event_ids: set = set()
        self.serving_version = 0
        """The version users are served (``promoted_version`` of the weight records), kept as they come."""
        self.project_serving: dict[str, int] = {}
        """project -> its own promoted version (absent or 0: the shared policy serves it)."""
        self.version_project: dict[int, str] = {}
        self.canaries: dict[str, CanaryTally] = {}
        """project ("" the shared policy) -> its running canary."""
        self.gate_learner = None
        """While ``run`` runs with ``show_gate``: the show-gate's learner thread (trainer/show_gate_learner.py)."""
        self.head_feed: HeadFeed | None = None
        """While ``run`` runs: the reader at the head of the topic, for the canaries and the gate
        (trainer/head_feed.py)."""
        # Episodes held out of training for the promotion gate (trainer/promotion.py), newest last. Not kept across
        # restarts: after one, the gate waits for new held-out episodes before it lets a version out.
        self.gate_episodes = HeldOutPool(settings.promote_gate_episodes)
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir / "tensorboard"))
        except ImportError:  # pragma: no cover - tensorboard is a dependency; the log file still gets everything
            log.warning("tensorboard is not installed: metrics go to metrics.jsonl only")
        self.metrics_file = open(self.log_dir / "metrics.jsonl", "a")
        self._resumed = False
        """Whether ``run`` applied the resume rule (``_resume_from_serving``), once per process."""
        log.info("trainer for %s on %s: newest manifest version %d, %s, offsets %s", self.base_model, self.device,
                 self.version, "full fine-tuning" if self.policy.full else f"LoRA rank {settings.trainer_lora_rank}",
                 offsets or "from the committed/earliest")

    def _load_policy(self, manifest: Manifest | None) -> PolicyTrainer:
        """A trainer starting from ``manifest``'s weights (None: the base model with fresh adapters)."""
        return load_policy(self.settings, self.store, manifest)

    def _resume_from_serving(self) -> None:
        """The resume rule: a (re)started trainer goes on from the weights of the version serving its project
        (the promoted one not rolled back, else the base model; a project policy: the project's own promoted
        version, else the shared policy's serving weights), never from a newer version still on canary or rolled
        back. The data side (offsets, step, baseline, totals) stays the newest manifest's: those episodes are
        in a saved version, so they are not trained again.
        """
        self._resumed = True
        statuses = fold_statuses(self.weight_records, self.base_model)
        newest, target = self.version, self.serving_version
        if target != newest:
            manifest = self.store.manifest(target) if target in self.store.versions() else None
            self.policy = self._load_policy(manifest)
            self.version = manifest.version if manifest is not None else 0
        status = statuses[newest].status if newest in statuses else "unannounced"
        skipped = "" if self.version == newest else f"; version {newest}, the newest written, is {status}: not a starting point"
        log.info("resuming at version %d, the version serving%s", self.version, skipped)
        for project, own in list(self.projects.items()):
            own_target = self.project_serving.get(project, 0)
            if own.version == own_target and (own_target or self.version == newest):
                continue
            manifest = self.store.manifest(own_target or self.version) if (own_target or self.version) else None
            log.info("project %s: resuming from version %d, the version serving it (its newest written: %d)", project,
                     manifest.version if manifest is not None else 0, own.version)
            self.projects[project] = ProjectPolicy(project, self._load_policy(manifest), own_target)

    def _follow_rollbacks(self) -> None:
        """If the version this trainer builds on was rolled back, go on from the promoted one instead.

        Otherwise the next version, trained on from rejected weights, would be
        promoted and undo the rollback. Updates made since the last save are
        discarded with the old weights; their episodes are counted as dropped
        ("rolled_back"), so the manifests still account for every episode.
        Episodes waiting for the next update are trained on the new weights.
        """
        self._follow_project_rollbacks()
        if self.version == 0:
            return
        status = fold_statuses(self.weight_records, self.base_model).get(self.version)
        if status is None or status.status != "ROLLED_BACK":
            return
        target = self.serving_version
        if target == self.version:
            return
        manifest = self.store.manifest(target) if target in self.store.versions() else None
        log.info("version %d was rolled back: training goes on from version %d", self.version,
                 target if manifest is not None else 0)
        self.policy = self._load_policy(manifest)
        p = self.progress
        if p.trained:  # trained into the weights just discarded; episodes still waiting are trained as usual
            p.dropped["rolled_back"] = p.dropped.get("rolled_back", 0) + p.trained
            p.trained = 0
        p.update_metrics.clear()
        p.updates = 0
        self.version = manifest.version if manifest is not None else 0

    def _follow_project_rollbacks(self) -> None:
        """A project whose own version was rolled back goes on from its promoted version, or, with none, starts
        again from the shared policy's serving version (its updates since the last save are discarded)."""
        statuses = fold_statuses(self.weight_records, self.base_model)
        for project, own in list(self.projects.items()):
            status = statuses.get(own.version)
            if own.version == 0 or status is None or status.status != "ROLLED_BACK":
                continue
            target = self.project_serving.get(project, 0) or self.serving_version
            if target == own.version:
                continue
            manifest = self.store.manifest(target) if target in self.store.versions() else None
            log.info("project %s: version %d was rolled back: its policy goes on from version %d", project,
                     own.version, manifest.version if manifest is not None else 0)
            self.projects[project] = ProjectPolicy(project, self._load_policy(manifest),
                                                   target if self.project_serving.get(project) else 0)

    def _serving_of(self, project: str) -> int:
        """The version a project's users are served: its own promoted version, else the shared one."""
        return self.project_serving.get(project) or self.serving_version

    def _staleness(self, version: int) -> int:
        """Versions of the shared policy saved after ``version`` up to the trainer's (project versions share
        the numbering, so a plain difference would age episodes faster the more projects there are)."""
        return bisect_right(self.shared_versions, self.version) - bisect_right(self.shared_versions, version)

    # -- kafka ---------------------------------------------------------------------

    def _on_assign(self, consumer, partitions) -> None:
        """Seek to the last manifest's offsets: they, not the group's commits, say what is in a saved version."""
        for tp in partitions:
            if str(tp.partition) in self.progress.offsets:
                tp.offset = self.progress.offsets[str(tp.partition)]
        consumer.assign(partitions)
        log.info("assigned %s", {tp.partition: tp.offset for tp in partitions})

    def _make_consumers(self) -> tuple[Consumer, Consumer]:
        episodes = Consumer({"bootstrap.servers": self.settings.kafka_bootstrap, "group.id": self.group_id,
                             "enable.auto.commit": False, "auto.offset.reset": "earliest",
                             "partition.assignment.strategy": "range", "log_level": 3,
                             # Static membership: a restarted trainer takes its partitions back at once
                             # instead of waiting out the dead process's session; a second trainer with
                             # the same group fences the first (one trainer per base model).
                             "group.instance.id": f"{self.group_id}-trainer", "session.timeout.ms": 30000})
        episodes.subscribe([self.topic], on_assign=self._on_assign)
        weights = Consumer({"bootstrap.servers": self.settings.kafka_bootstrap, "group.id": f"{self.group_id}-weights",
                            "enable.auto.commit": False, "log_level": 3})
        weights.assign([TopicPartition(WEIGHTS.name, 0, OFFSET_BEGINNING)])
        return episodes, weights

    # -- the loop ------------------------------------------------------------------

    def run(self, *, max_versions: int | None = None, idle_exit_s: float | None = None) -> None:
        """Train until stopped (``stop()``, or ``max_versions`` new versions, or idle ``idle_exit_s`` — tests)."""
        self.weight_records, self._weight_event_ids, self.serving_version = [], set(), 0
        self.project_serving, self.version_project = {}, {}
        for record in read_weight_records(self.settings):
            self._new_weight_record(record)
        self._publish_unannounced()
        if not self._resumed:
            self._resume_from_serving()
        self._refresh_canary()
        self._follow_rollbacks()
        episodes, weights = self._make_consumers()
        self.head_feed = HeadFeed(self.settings, self.topic, self.group_id)
        if self.settings.show_gate:  # the show-gate is learned at the head of the topic, beside the PPO loop
            from trainer.show_gate_learner import GateLearnerThread

            self.gate_learner = GateLearnerThread(self.settings, self.base_model, self.producer,
                                                  topic=self.topic).start()
        published = 0
        last_activity = time.monotonic()
        try:
            while not self.stop_event.is_set():
                for m in weights.consume(100, 0):
                    if m.error() is None and (r := decode_message(self.codec, m)) and r.event is not None \
                            and self._new_weight_record(r.event.record):
                        self._refresh_canary()
                        self._follow_rollbacks()
                if self._read_head_feed():
                    last_activity = time.monotonic()
                batch = episodes.consume(500, 1.0)
                for m in batch:
                    received = decode_message(self.codec, m)
                    if received is None:
                        continue
                    last_activity = time.monotonic()
                    self._take(received)
                    # Judged as the episodes come, before an update: announcing the next version would
                    # replace this canary with a new one, undecided.
                    self._judge_canary()
                    if len(self.pending.samples) >= self.settings.trainer_batch_size:
                        published += self._update_and_maybe_save(episodes)
                if self.pending.samples and time.monotonic() - self.pending.first_at >= self.settings.trainer_batch_wait_s:
                    published += self._update_and_maybe_save(episodes)
                if not batch:
                    self._commit_dropped_tail(episodes)
                self._judge_canary()
                if self.progress.updates >= self.settings.trainer_save_every and self._canary_overdue(""):
                    published += self._save_if_due(episodes)  # a canary nobody decided in time: withdraw, save
                if max_versions is not None and published >= max_versions:
                    return
                if idle_exit_s is not None and time.monotonic() - last_activity > idle_exit_s:
                    return
        finally:
            if self.gate_learner is not None:
                self.gate_learner.stop()
                self.gate_learner = None
            episodes.close()
            weights.close()
            self.head_feed.close()
            self.head_feed = None

    def _new_weight_record(self, record: dict) -> bool:
        """Keep a WeightVersion record unless it is one already kept. The weights consumer reads the topic
        from its start, after ``run`` read it whole, and it reads back what this trainer published: a
        replayed CANDIDATE after its decision would bring a decided canary back to life."""
        if record["event_id"] in self._weight_event_ids:
            return False
        self._weight_event_ids.add(record["event_id"])
        self.weight_records.append(record)
        project = record.get("project_id") or ""
        if record["base_model"] == self.base_model:
            self.version_project[record["version"]] = project
        if project:
            self.project_serving[project] = promoted_version(self.weight_records, self.base_model, project)
        else:
            self.serving_version = promoted_version(self.weight_records, self.base_model)
        return True

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        self.producer.close()
        self.codec.close()
        if self.writer is not None:
            self.writer.close()
        self.metrics_file.close()
        logging.getLogger("tabloop").removeHandler(self._file_log)
        self._file_log.close()

    def _commit_dropped_tail(self, consumer: Consumer) -> None:
        """When the episodes consumed since the last version were all dropped (stale, empty …), there is
        nothing to save, so no version commits them: commit their offsets, or the group's lag never says
        the trainer is caught up. A restart still starts from the last manifest's offsets and drops them
        again; nothing trained or pending is ever passed (an update not yet saved holds this back)."""
        p = self.progress
        if self.pending.samples or p.update_metrics or not p.consumed or p.offsets == self._tail_committed:
            return
        consumer.commit(offsets=[TopicPartition(self.topic, int(part), off) for part, off in p.offsets.items()],
                        asynchronous=False)
        self._tail_committed = dict(p.offsets)
        log.info("committed %d dropped episodes (%s) with no version to save", p.consumed, p.dropped)

    def _take(self, received) -> None:
        """One consumed message: a pending sample, or a counted drop."""
        p = self.progress
        p.offsets[str(received.partition)] = received.offset + 1
        p.consumed += 1
        if received.event is None:
            p.dropped["undecodable"] = p.dropped.get("undecodable", 0) + 1
            log.error("undecodable episode at %s/%d@%d: %s", received.topic, received.partition, received.offset,
                      received.error)
            return
        ep = received.event.record
        project = ep["project_id"]
        self._count_for_canaries(ep)
        if self._held_out(ep):
            self.gate_episodes.add(ep)
            p.dropped["gate_holdout"] = p.dropped.get("gate_holdout", 0) + 1
            return
        reason = drop_reason(ep, self.version, self.settings.trainer_max_staleness,
                             serving_version=self._serving_of(project),
                             staleness_of=self._staleness if self.settings.project_policies else None)
        if reason is not None:
            p.dropped[reason] = p.dropped.get(reason, 0) + 1
            return
        try:
            sample = episode_sample(ep, self.policy.tokenizer, max_prompt_tokens=self.settings.max_prompt_tokens)
        except ValueError as exc:
            p.dropped["invalid"] = p.dropped.get("invalid", 0) + 1
            log.warning("episode %s not trainable: %s", ep["completion_id"], exc)
            return
        if sample is None:
            p.dropped["empty"] = p.dropped.get("empty", 0) + 1
            return
        q = self.pending
        q.samples.append(sample)
        q.rewards.append(float(ep["reward"]))
        q.accepted += ep["outcome"] == "ACCEPTED"
        q.staleness.append(self.version - ep["policy_version"] if ep["policy_version"] is not None else 0)
        q.projects.append(project)
        if self.settings.has_project_policy(project):
            self.project_episodes[project] = self.project_episodes.get(project, 0) + 1
        if q.first_at is None:
            q.first_at = time.monotonic()

    def _update_and_maybe_save(self, consumer: Consumer) -> int:
        q, self.pending = self.pending, Pending()
        advantages, self.baseline = baseline_advantages(q.rewards, q.projects, self.baseline,
                                                        decay=self.settings.trainer_baseline_decay)
        samples = [dataclasses.replace(s, advantage=a) for s, a in zip(q.samples, advantages)]
        log.info("update %d started: %d episodes", self.trainer_step + 1, len(samples))
        metrics = self.policy.update(samples)
        self.trainer_step += 1
        metrics.update(reward_mean=sum(q.rewards) / len(q.rewards), accept_rate=q.accepted / len(q.rewards),
                       staleness_mean=sum(q.staleness) / len(q.staleness), staleness_max=float(max(q.staleness)))
        self._update_projects(samples, q)
        p = self.progress
        p.trained += len(samples)
        p.updates += 1
        p.update_metrics.append(metrics)
        metrics.update(dropped_stale_total=float(p.dropped.get("stale", 0)))
        self._log_metrics(metrics)
        log.info("update %d done: reward %.3f, loss %.4f, kl %.4f, %.0f tokens/s, %.2fs", self.trainer_step,
                 metrics["reward_mean"], metrics["policy_loss"], metrics["approx_kl"], metrics["tokens_per_s"],
                 metrics["update_seconds"])
        self._read_head_feed()  # an update takes seconds: a canary's episodes may have come meanwhile
        return self._save_if_due(consumer)

    def _save_if_due(self, consumer: Consumer) -> int:
        """Save a version if ``trainer_save_every`` updates wait and no canary holds the save back; 1 if saved."""
        if self.progress.updates >= self.settings.trainer_save_every and not self._waiting_for_canary(""):
            self._save_version(consumer)
            return 1
        return 0

    def _canary_overdue(self, project: str) -> bool:
        tally = self.canaries.get(project)
        return tally is not None and time.time() - tally.since_ms / 1000 >= self.settings.canary_max_wait_s

    def _waiting_for_canary(self, project: str) -> bool:
        """Whether a save of ``project``'s policy ("" the shared one) waits for that policy's running canary.

        The canary rule: a canary is decided before the next version of its project goes out. A trainer that
        saves faster than the canary gathers its episodes (or that reads a backlog: the canary counts only
        episodes joined after it started) keeps updating, and every update made meanwhile is folded into the
        version saved after the decision. A canary still undecided ``canary_max_wait_s`` after it went out (too
        little traffic to decide it) is withdrawn first, with a WeightVersion that says so (``_withdraw_canary``),
        and then the save goes ahead: slow traffic must not keep the trainer's progress unsaved forever.
        """
        tally = self.canaries.get(project)
        if tally is None:
            return False
        if self._canary_overdue(project):
            self._withdraw_canary(tally)
            return False
        updates = self.projects[project].updates if project else self.progress.updates
        if updates == self.settings.trainer_save_every:
            log.info("canary%s: the next version waits for version %d's decision (%s)",
                     f" of project {project}" if project else "", tally.candidate, tally.summary())
        return True

    def _update_projects(self, samples: list[Sample], q: Pending) -> None:
        """Each project's own policy trains on that project's samples of the batch (with the same advantages:
        the baseline is already per project). A project gets its policy once it has enough episodes."""
        for project in dict.fromkeys(q.projects):
            if (project not in self.projects and self.settings.has_project_policy(project)
                    and self.project_episodes.get(project, 0) >= self.settings.project_min_episodes):
                start = self.store.manifest(self.version) if self.version else None
                log.info("project %s: %d episodes, its own policy starts from version %d", project,
                         self.project_episodes[project], self.version)
                self.projects[project] = ProjectPolicy(project, self._load_policy(start), 0)
            own = self.projects.get(project) if self.settings.has_project_policy(project) else None
            if own is None:
                continue
            rows = [i for i, p in enumerate(q.projects) if p == project]
            metrics = own.policy.update([samples[i] for i in rows])
            metrics.update(reward_mean=sum(q.rewards[i] for i in rows) / len(rows))
            own.updates += 1
            own.trained += len(rows)
            own.update_metrics.append(metrics)
            self._log_metrics(metrics, project=project)
            log.info("project %s: update done on %d episodes, reward %.3f, kl %.4f", project, len(rows),
                     metrics["reward_mean"], metrics["approx_kl"])

    def _log_metrics(self, metrics: dict, project: str = "") -> None:
        row = {"step": self.trainer_step, "version": self.version, "time": time.time(), **metrics}
        self.metrics_file.write(json.dumps({**row, "project": project} if project else row) + "\n")
        self.metrics_file.flush()
        if self.writer is not None:
            prefix = f"project/{project}/" if project else "train/"
            for k, v in metrics.items():
                self.writer.add_scalar(f"{prefix}{k}", v, self.trainer_step)
            self.writer.flush()

    # -- versions ------------------------------------------------------------------

    def _save_version(self, consumer: Consumer) -> Manifest:
        p = self.progress
        # The projects' versions first, the shared one last: its manifest names them, so it is the commit record
        # of the whole save point (module docstring).
        project_manifests = [self._save_project(own) for own in self.projects.values()
                             if own.updates and not self._waiting_for_canary(own.project)]
        averaged = _averaged(p.update_metrics)
        averaged.update({f"baseline_mean/{proj}": mean for proj, mean in self.baseline.means.items()})
        averaged.update({f"baseline_count/{proj}": float(n) for proj, n in self.baseline.counts.items()})
        averaged.update({f"{PROJECT_VERSION}{proj}": float(own.version) for proj, own in self.projects.items()})
        averaged.update({f"{PROJECT_EPISODES}{proj}": float(n) for proj, n in self.project_episodes.items()})
        manifest = self._write(self.policy, dict(
            parent_version=self.version, trainer_step=self.trainer_step, episodes_consumed=p.consumed,
            episodes_trained=p.trained, episodes_dropped=dict(p.dropped), metrics=averaged))
        self.shared_versions.append(manifest.version)
        for project_manifest in project_manifests:
            self._announce(project_manifest, weights_in_memory=True)
        self._announce(manifest, weights_in_memory=True)
        # Weights and manifest are on disk, Kafka has the WeightVersion: now the offsets may move.
        commit = [TopicPartition(self.topic, int(part), off) for part, off in p.offsets.items()]
        if commit:
            consumer.commit(offsets=commit, asynchronous=False)
        self.version = manifest.version
        self.total_consumed += p.consumed
        self.progress = Progress(dict(p.offsets), dict(p.offsets))
        log.info("version %d saved (%d episodes, %d trained, dropped %s) at %s", manifest.version,
                 manifest.episodes_consumed, manifest.episodes_trained, manifest.episodes_dropped or "none",
                 manifest.uri)
        return manifest

    def _save_project(self, own: ProjectPolicy) -> Manifest:
        """A project's version: its adapter, the episodes it trained on since its last save, the same offsets."""
        manifest = self._write(own.policy, dict(
            parent_version=own.version or self.version, trainer_step=self.trainer_step,
            episodes_consumed=own.trained, episodes_trained=own.trained, episodes_dropped={},
            metrics=_averaged(own.update_metrics), project_id=own.project))
        log.info("project %s: version %d saved (%d episodes trained)", own.project, manifest.version, own.trained)
        own.version, own.updates, own.trained = manifest.version, 0, 0
        own.update_metrics.clear()
        return manifest

    def _write(self, policy: PolicyTrainer, fields: dict) -> Manifest:
        import tempfile

        p = self.progress
        with tempfile.TemporaryDirectory(dir=self.log_dir) as tmp:
            policy.save(Path(tmp))
            return self.store.save(self.store.next_version(), Path(tmp), dict(
                kind=policy.kind, source_topic=self.topic, source_offsets_start=dict(p.offsets_start),
                source_offsets=dict(p.offsets), episodes_consumed_total=self.total_consumed + p.consumed, **fields))

    def _announce(self, manifest: Manifest, *, weights_in_memory: bool = False) -> None:
        """Publish the version's WeightVersion and wait for the ack (the status the settings ask for, if the
        promotion gate lets the version out; ``weights_in_memory``: the policy holds this version's weights)."""
        extra = {}
        if self.settings.canary_share > 0:
            status = "CANDIDATE"
            extra = {CANARY_SHARE: self.settings.canary_share,
                     BASELINE_VERSION: float(self._serving_of(manifest.project_id))}
        else:
            status = "PROMOTED" if self.settings.auto_promote else "CANDIDATE"
        gate = self.settings.promote_gate
        if gate != "none" and (status == "PROMOTED" or CANARY_SHARE in extra):
            decision, figures = self._gate(manifest, weights_in_memory)
            if gate == "shadow":
                verdict = "would go out" if decision.passed else "would wait (shadow: goes out anyway)"
            else:
                verdict = "goes out" if decision.passed else "waits as CANDIDATE"
            log.info("promotion gate: version %d%s %s: %s", manifest.version,
                     f" (project {manifest.project_id})" if manifest.project_id else "", verdict, decision.reason)
            if decision.passed or gate == "shadow":
                extra = {**extra, **figures}
            else:
                status, extra = "CANDIDATE", figures  # no canary share: nobody is served a refused version
        event = version_event(manifest, status, extra)
        self.producer.publish(event)
        self.producer.flush()
        self._new_weight_record(event.record)
        self._refresh_canary()

    def _publish_unannounced(self) -> None:
        """A crash between the manifest and the WeightVersion left a version nobody heard of: announce it now."""
        announced = fold_statuses(self.weight_records, self.base_model)
        newest_shared = self.shared_versions[-1] if self.shared_versions else 0
        for manifest in self.store.manifests():
            if manifest.project_id and manifest.version > newest_shared:
                # Written in a save point whose shared manifest never was: not part of any saved state.
                log.warning("project %s: version %d was saved in an unfinished save point; not announced",
                            manifest.project_id, manifest.version)
                continue
            if manifest.version not in announced:
                log.info("announcing version %d, saved before the last stop but never published", manifest.version)
                self._announce(manifest)

    def _gate(self, manifest: Manifest, weights_in_memory: bool) -> tuple[GateDecision, dict[str, float]]:
        """Estimate the version on the held-out episodes its project's serving version served (a project's
        version: that project's episodes only; trainer/promotion.py)."""
        from rewards.spec import RewardSpecs
        from trainer.ope_episodes import evaluate_logged, select_episodes

        version, project = manifest.version, manifest.project_id
        serving = self._serving_of(project)
        if not weights_in_memory:  # announced after a restart: those weights are not the ones loaded
            decision = GateDecision(False, f"version {version} was saved before a restart and not re-evaluated")
            return decision, estimate_metrics(None, serving_version=serving, held_out=0, decision=decision)
        policy = self.projects[project].policy if project else self.policy
        s = self.settings
        logged = select_episodes((ep for ep in self.gate_episodes if ep["policy_version"] == serving
                                  and (not project or ep["project_id"] == project)),
                                 policy.tokenizer, max_prompt_tokens=s.max_prompt_tokens)
        held_out = len(logged.samples)
        result = None
        if held_out >= s.promote_gate_min_episodes:
            specs = RewardSpecs.from_settings(s)
            result = evaluate_logged(policy.model, policy.tokenizer, logged, clip=s.promote_gate_clip,
                                     level=s.promote_gate_level,
                                     ignored_reward=(specs.for_project(project) if project else specs.default).ignored,
                                     device=policy.device)
        interval = gate_reward(result) if result else None
        decision = gate_decision(interval["low"] if interval else None,
                                 result["logged"].get("reward_mean") if result else None, held_out,
                                 min_episodes=s.promote_gate_min_episodes)
        return decision, estimate_metrics(result, serving_version=serving, held_out=held_out, decision=decision)

    # -- canary ----------------------------------------------------------------------

    def _refresh_canary(self) -> None:
        """Follow each project's newest undecided CANDIDATE that asked for a canary ("" the shared policy's)."""
        statuses = fold_statuses(self.weight_records, self.base_model)
        live: dict[str, object] = {}
        for s in sorted(statuses.values(), key=lambda s: s.version):
            if s.status == "CANDIDATE" and s.metrics.get(CANARY_SHARE, 0) > 0:
                live[self.version_project.get(s.version, "")] = s
        for project in list(self.canaries):
            if project not in live:
                del self.canaries[project]
        for project, newest in live.items():
            tally = self.canaries.get(project)
            if tally is None or tally.candidate != newest.version:
                baseline = int(newest.metrics.get(BASELINE_VERSION, self._serving_of(project)))
                self.canaries[project] = CanaryTally(newest.version, baseline, newest.at_ms, project=project)
                log.info("canary%s: version %d serves %.0f%% of requests, compared with version %d",
                         f" of project {project}" if project else "", newest.version,
                         100 * newest.metrics[CANARY_SHARE], baseline)

    def _count_for_canaries(self, ep: dict) -> None:
        for tally in self.canaries.values():
            tally.add(ep["policy_version"], ep["outcome"], int(ep["joined_at"].timestamp() * 1000), ep["project_id"],
                      completion_id=ep["completion_id"])

    def _held_out(self, ep: dict) -> bool:
        """Whether the gate holds this episode out of training (trainer/promotion.py). A completion the show-gate
        hid is never held out: the user saw nothing, so it says nothing of a weight version (``drop_reason``
        drops it as "gate_hidden")."""
        return (self.settings.promote_gate != "none" and ep.get("gate_shown") is not False
                and in_gate_holdout(ep["completion_id"], self.settings.promote_gate_share))

    def _read_head_feed(self) -> bool:
        """Count what the head reader brought for the canaries (it follows the oldest running canary's start,
        else the head while the gate is on), keep its held-out episodes for the gate, and judge the canaries.
        Whether it brought anything."""
        feed = self.head_feed
        if feed is None:
            return False
        feed.follow(min((t.since_ms for t in self.canaries.values()), default=None),
                    at_head=self.settings.promote_gate != "none")
        messages = feed.poll()
        for m in messages:
            received = decode_message(self.codec, m)
            if received is not None and received.event is not None:
                ep = received.event.record
                self._count_for_canaries(ep)
                if self._held_out(ep):
                    self.gate_episodes.add(ep)
        if messages:
            self._judge_canary()
        return bool(messages)

    def _judge_canary(self) -> None:
        for project, tally in list(self.canaries.items()):
            decision = tally.decide(self.settings.canary_min_episodes, self.settings.canary_margin)
            if decision is not None:
                del self.canaries[project]
                self._decide_canary(tally, decision)

    def _withdraw_canary(self, tally: CanaryTally) -> None:
        """Withdraw a canary nobody decided in time: it is announced again as a CANDIDATE with no canary share
        (serving drops it; ``tabloop weights promote`` can still promote it), ``canary_withdrawn`` 1, how long it
        waited and its counts. A withdrawal is no verdict on the weights, so the trainer goes on from them."""
        waited_s = time.time() - tally.since_ms / 1000
        self.canaries.pop(tally.project, None)
        log.warning("canary%s: version %d withdrawn, undecided after %.0f s (%s); the next version goes out",
                    f" of project {tally.project}" if tally.project else "", tally.candidate, waited_s,
                    tally.summary())
        self._publish_canary_event(tally, "CANDIDATE", {CANARY_SHARE: 0.0, CANARY_WITHDRAWN: 1.0,
                                                        CANARY_WAITED_S: waited_s,
                                                        BASELINE_VERSION: float(tally.baseline)})

    def _decide_canary(self, tally: CanaryTally, decision: str) -> None:
        log.info("canary: version %d %s (%s)", tally.candidate, decision, tally.summary())
        self._publish_canary_event(tally, decision)
        self._follow_rollbacks()
        if self.writer is not None:
            self.writer.add_scalar("canary/promoted", 1.0 if decision == "PROMOTED" else 0.0, tally.candidate)

    def _publish_canary_event(self, tally: CanaryTally, status: str, extra: dict[str, float] | None = None) -> None:
        """The WeightVersion that ends a canary: its counts (and ``extra``) in the metrics, with the gate's
        estimate kept beside them (the history's version_estimates view)."""
        summary = {**tally.summary(), **(extra or {})}
        estimate = {k: v for r in self.weight_records if r["version"] == tally.candidate
                    and r["base_model"] == self.base_model for k, v in r["metrics"].items() if k.startswith(OPE_PREFIX)}
        if tally.candidate in self.store.versions():
            event = version_event(self.store.manifest(tally.candidate), status, {**estimate, **summary})
        else:  # published by someone else's store: restate what the topic said
            record = next(r for r in reversed(self.weight_records)
                          if r["version"] == tally.candidate and r["base_model"] == self.base_model)
            from schemas.events import new_event

            fields = {k: v for k, v in record.items() if k not in ("event_id", "created_at", "status", "metrics")}
            event = new_event("WeightVersion", **fields, metrics={**record["metrics"], **summary}, status=status)
        self.producer.publish(event)
        self.producer.flush()
        self._new_weight_record(event.record)


def load_policy(settings: Settings, store: WeightStore, manifest: Manifest | None, *,
                config: UpdateConfig | None = None, full: bool | None = None) -> PolicyTrainer:
    """A trainer starting from ``manifest``'s weights: a LoRA adapter over the base, or full weights; None: the
    base model (LoRA adapters, or every weight when ``full`` / ``trainer_full_finetune``).

    The KL reference is the base model whatever the trainer resumes from: a full fine-tune resumed from
    saved full weights loads the base a second time for it (a copy of the resumed weights would make the
    KL measure the distance from the last save, 0 after every restart).
    """
    from policy.models import load_model

    device = describe_device(settings.trainer_device)
    config = config or update_config(settings)
    full = settings.trainer_full_finetune if full is None else full
    # Full fine-tuning in fp32; LoRA over a bf16 base on a GPU.
    dtype = "float32" if (full or not device.startswith("cuda")) else "bfloat16"
    cache = Path(settings.trainer_dir) / "cache"
    adapter_dir = None
    reference = None
    if manifest is not None and manifest.kind == "FULL":
        model, tokenizer = load_model(str(store.materialize(manifest.version, cache)), device=device, dtype="float32")
        full = True
        if config.kl_coef > 0:
            reference, _ = load_model(store.base_model, device=device, dtype="float32")
    else:
        model, tokenizer = load_model(store.base_model, device=device, dtype=dtype)
        if manifest is not None:
            adapter_dir = store.materialize(manifest.version, cache)
            full = False
    return PolicyTrainer(model, tokenizer, config, device=device, full=full, lora_rank=settings.trainer_lora_rank,
                         adapter_dir=adapter_dir, seed=settings.trainer_seed, reference_model=reference)


def _averaged(update_metrics: list[dict]) -> dict[str, float]:
    """Each metric's mean over the updates that reported it in every update."""
    return {k: sum(m[k] for m in update_metrics) / len(update_metrics)
            for k in update_metrics[-1] if all(k in m for m in update_metrics)}


def _baseline_from(manifest: Manifest) -> BaselineState:
    """The per-project reward means a manifest saved, so a restart does not start the baseline over."""
    means = {k.split("/", 1)[1]: v for k, v in manifest.metrics.items() if k.startswith("baseline_mean/")}
    counts = {k.split("/", 1)[1]: int(v) for k, v in manifest.metrics.items() if k.startswith("baseline_count/")}
    return BaselineState(means, counts)


__all__ = ["OnlineTrainer", "drop_reason", "episode_sample", "episode_sampler", "load_policy", "update_config", "base_version_event"]
