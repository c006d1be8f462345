"""`tabloop train`: continuous PPO on ``tabloop.episodes``, publishing weight versions.

The loop, in the order that makes a crash harmless:

1. poll episodes (a consumer group; one second at a time, so an idle trainer
   costs nothing); each becomes a training sample or is dropped and counted
   (too stale, empty);
2. when ``trainer_batch_size`` samples are waiting, or the oldest has waited
   ``trainer_batch_wait_s``, run one policy update (``trainer.update.ppo_update``:
   batch → advantages → losses → step → metrics);
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
version (``trainer.canary.CanaryWatch.holds_back``).

A policy per project (``TABLOOP_PROJECT_POLICIES``): every episode trains the
shared policy; once an opted-in project has ``project_min_episodes`` trainable
episodes, its episodes also train a LoRA adapter of its own, which starts from
the shared policy's newest saved version. At each save, every project policy
updated since its last save is written first (a version with the project's id),
then the shared version, whose manifest lists each project's version: it is the
save point's commit record. A restart loads the project versions the newest
shared manifest names; a project version written after it (a crash between the
two) is removed at the start, never announced, and its episodes are trained
again. A version number is never skipped: a crash while saving leaves a
directory without a manifest, whose number the next save uses (so the versions
on tabloop.weights are 1..N, unbroken).

The trainer's collaborators, each in its own module: the update (trainer/update.py), checkpoints
(trainer/checkpoints.py), the project policies (trainer/project_policies.py), the canaries
(trainer/canary.py), the promotion gate (trainer/promotion.py), the WeightVersion records
(trainer/weight_records.py), the head reader (trainer/head_feed.py) and the show-gate's learner
(trainer/show_gate_learner.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from bisect import bisect_right
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from infra.bus import EventProducer, decode_message, make_codec
from infra.settings import Settings
from infra.stall_guard import StallGuard, guarded, held_partitions
from policy.models import use_torch_threads
from policy.weight_store import Manifest, WeightStore, base_version_event, read_weight_records, version_event
from rewards.spec import RewardSpecs
from schemas.topics import EPISODES, WEIGHTS
from trainer.build_models import build_named_model
from trainer.canary import CANARY_SHARE, CanaryTally, CanaryWatch, release
from trainer.checkpoints import (Checkpoints, Progress, averaged, baseline_from, baseline_metrics,
                                 discard_unfinished_save_point, load_policy, unannounced)
from trainer.episodes import drop_reason, episode_sample, episode_sampler
from trainer.head_feed import HeadFeed
from trainer.learner import PolicyTrainer, describe_device
from trainer.losses import BaselineState
from trainer.project_policies import ProjectPolicies, ProjectPolicy
from trainer.promotion import HeldOutPool, PromotionGate
from trainer.show_gate_learner import GateLearnerThread
from trainer.update import Batch, MetricsLog, ppo_update, update_config
from trainer.weight_records import WeightRecords, publish

log = logging.getLogger("tabloop.trainer")


class OnlineTrainer:
    """The loop of the module doc: it takes episodes into a batch, runs the update (``ppo_update``) when the
    batch is due, and saves, announces and commits versions; its collaborators keep the rest."""

    def __init__(self, settings: Settings, *, topic: str = EPISODES.name, group_id: str | None = None):
        use_torch_threads(settings.torch_threads)
        self._settings = settings
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

        self.checkpoints = Checkpoints(settings, self.store, topic=topic, work_dir=self.log_dir)
        discard_unfinished_save_point(self.store)
        latest = self.store.latest(project="")
        self.policy = self.checkpoints.load(latest)
        self.version = latest.version if latest else 0
        self.total_consumed = latest.episodes_consumed_total if latest else 0
        self.trainer_step = latest.trainer_step if latest else 0
        offsets = dict(latest.source_offsets) if latest else {}
        self.progress = Progress(dict(offsets), dict(offsets))
        self.baseline = baseline_from(latest) if latest is not None else BaselineState.empty()
        self.shared_versions = sorted(m.version for m in self.store.manifests() if not m.project_id)
        self.project_policies = ProjectPolicies(settings, self.checkpoints, latest)
        self.pending = Batch()
        self._tail_committed: dict[str, int] = {}  # offsets committed past dropped episodes (no version)
        self.producer = EventProducer(settings, client_id="tabloop-trainer")
        self.codec = make_codec(settings)
        self.weight_versions = WeightRecords(self.base_model)
        self.canary_watch = CanaryWatch(settings, self.store, self.weight_versions, self.producer)
        self.gate_learner: GateLearnerThread | None = None
        """While ``run`` runs with ``show_gate``: the show-gate's learner thread (trainer/show_gate_learner.py)."""
        self.head_feed: HeadFeed | None = None
        """While ``run`` runs: the reader at the head of the topic, for the canaries and the gate
        (trainer/head_feed.py)."""
        # The reward specs are read at each verdict: an edited spec file counts from the next version on.
        self.promotion = PromotionGate(settings, reward_specs=lambda: RewardSpecs.from_settings(self.settings))
        self.metrics_log = MetricsLog(self.log_dir)
        self._resumed = False
        """Whether ``run`` applied the resume rule (``_resume_from_serving``), once per process."""
        self.guard: StallGuard | None = None
        """Set by `tabloop train`: ends the process when a commit to Kafka never returns, or its consumer holds
        no partition for as long (infra/stall_guard.py)."""
        log.info("trainer for %s on %s: newest manifest version %d, %s, offsets %s", self.base_model, self.device,
                 self.version, "full fine-tuning" if self.policy.full else f"LoRA rank {settings.trainer_lora_rank}",
                 offsets or "from the committed/earliest")

    # -- what the collaborators keep, under the trainer's names ---------------------------

    @property
    def settings(self) -> Settings:
        return self._settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        """The trainer and its collaborators read one settings object (a test swaps it between two runs)."""
        self._settings = settings
        for part in (self.checkpoints, self.project_policies, self.canary_watch, self.promotion):
            part.settings = settings

    @property
    def projects(self) -> dict[str, ProjectPolicy]:
        return self.project_policies.policies

    @property
    def canaries(self) -> dict[str, CanaryTally]:
        """project ("" the shared policy) -> its running canary."""
        return self.canary_watch.running

    @property
    def gate_episodes(self) -> HeldOutPool:
        """Episodes held out of training for the promotion gate (trainer/promotion.py), newest last."""
        return self.promotion.episodes

    @property
    def weight_records(self) -> list[dict]:
        return self.weight_versions.records

    @property
    def serving_version(self) -> int:
        return self.weight_versions.serving_version

    @property
    def project_serving(self) -> dict[str, int]:
        return self.weight_versions.project_serving

    # -- which weights to go on from -------------------------------------------------------

    def _resume_from_serving(self) -> None:
        """The resume rule: a (re)started trainer goes on from the weights of the version serving its project
        (the promoted one not rolled back, else the base model; a project policy: the project's own promoted
        version, else the shared policy's serving weights), never from a newer version still on canary or rolled
        back. The data side (offsets, step, baseline, totals) stays the newest manifest's: those episodes are
        in a saved version, so they are not trained again.
        """
        self._resumed = True
        statuses = self.weight_versions.statuses()
        newest, target = self.version, self.weight_versions.serving_version
        if target != newest:
            manifest = self.checkpoints.saved(target)
            self.policy = self.checkpoints.load(manifest)
            self.version = manifest.version if manifest is not None else 0
        status = statuses[newest].status if newest in statuses else "unannounced"
        skipped = ("" if self.version == newest
                   else f"; version {newest}, the newest written, is {status}: not a starting point")
        log.info("resuming at version %d, the version serving%s", self.version, skipped)
        self.project_policies.resume(self.weight_versions, shared_version=self.version, newest=newest)

    def _follow_rollbacks(self) -> None:
        """If the version this trainer builds on was rolled back, go on from the promoted one instead.

        Otherwise the next version, trained on from rejected weights, would be
        promoted and undo the rollback. Updates made since the last save are
        discarded with the old weights; their episodes are counted as dropped
        ("rolled_back"), so the manifests still account for every episode.
        Episodes waiting for the next update are trained on the new weights.
        """
        self.project_policies.follow_rollbacks(self.weight_versions)
        if self.version == 0:
            return
        status = self.weight_versions.statuses().get(self.version)
        if status is None or status.status != "ROLLED_BACK":
            return
        target = self.weight_versions.serving_version
        if target == self.version:
            return
        manifest = self.checkpoints.saved(target)
        log.info("version %d was rolled back: training goes on from version %d", self.version,
                 target if manifest is not None else 0)
        self.policy = self.checkpoints.load(manifest)
        p = self.progress
        if p.trained:  # trained into the weights just discarded; episodes still waiting are trained as usual
            p.drop("rolled_back", p.trained)
            p.trained = 0
        p.update_metrics.clear()
        p.updates = 0
        self.version = manifest.version if manifest is not None else 0

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

    # -- the loop ------------------------------------------------------------------

    def run(self, *, max_versions: int | None = None, idle_exit_s: float | None = None) -> None:
        """Train until stopped (``stop()``, or ``max_versions`` new versions, or idle ``idle_exit_s`` — tests)."""
        self.weight_versions.reset()
        for record in read_weight_records(self.settings):
            self.weight_versions.add(record)
        self._publish_unannounced()
        if not self._resumed:
            self._resume_from_serving()
        self.canary_watch.refresh()
        self._follow_rollbacks()
        episodes, weights = make_consumers(self.settings, self.group_id, self.topic, self._on_assign)
        self.head_feed = HeadFeed(self.settings, self.topic, self.group_id)
        if self.settings.show_gate:  # the show-gate is learned at the head of the topic, beside the PPO loop
            self.gate_learner = GateLearnerThread(self.settings, self.base_model, self.producer,
                                                  topic=self.topic).start()
        published = 0
        last_activity = time.monotonic()
        try:
            while not self.stop_event.is_set():
                for m in weights.consume(100, 0):
                    if m.error() is None and (r := decode_message(self.codec, m)) and r.event is not None \
                            and self.weight_versions.add(r.event.record):
                        self.canary_watch.refresh()
                        self._follow_rollbacks()
                if self._read_head_feed():
                    last_activity = time.monotonic()
                messages = episodes.consume(500, 1.0)
                held_partitions(self.guard, episodes)  # a rejoin that never ends: the guard ends the process
                for m in messages:
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
                batch_wait_s = self.settings.trainer_batch_wait_s
                if self.pending.samples and time.monotonic() - self.pending.first_at >= batch_wait_s:
                    published += self._update_and_maybe_save(episodes)
                if not messages:
                    self._commit_dropped_tail(episodes)
                self._judge_canary()
                if self.progress.updates >= self.settings.trainer_save_every and self.canary_watch.overdue(""):
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

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        self.producer.close()
        self.codec.close()
        self.metrics_log.close()
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
        with guarded(self.guard, "committing the offsets of dropped episodes to Kafka"):
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
            p.drop("undecodable")
            log.error("undecodable episode at %s/%d@%d: %s", received.topic, received.partition, received.offset,
                      received.error)
            return
        ep = received.event.record
        project = ep["project_id"]
        self.canary_watch.count(ep)
        if self.promotion.holds_out(ep):
            self.promotion.episodes.add(ep)
            p.drop("gate_holdout")
            return
        reason = drop_reason(ep, self.version, self.settings.trainer_max_staleness,
                             serving_version=self.weight_versions.serving_of(project),
                             staleness_of=self._staleness if self.settings.project_policies else None)
        if reason is not None:
            p.drop(reason)
            return
        try:
            sample = episode_sample(ep, self.policy.tokenizer, max_prompt_tokens=self.settings.max_prompt_tokens)
        except ValueError as exc:
            p.drop("invalid")
            log.warning("episode %s not trainable: %s", ep["completion_id"], exc)
            return
        if sample is None:
            p.drop("empty")
            return
        staleness = self.version - ep["policy_version"] if ep["policy_version"] is not None else 0
        if ep["policy_version"] == self.version and self.progress.updates == 0:
            # Served by the weights the next update starts from (no update since they were saved): the gap
            # between its logprobs and the trainer's is the server's numerics (losses.train_inference_correction).
            sample = dataclasses.replace(sample, same_weights=True)
        self.pending.add(sample, reward=float(ep["reward"]), accepted=ep["outcome"] == "ACCEPTED",
                         staleness=staleness, project=project)
        self.project_policies.count(project)

    def _update_and_maybe_save(self, consumer: Consumer) -> int:
        """One update on the waiting batch (the shared policy, then each project's own), then a save if due."""
        batch, self.pending = self.pending, Batch()
        log.info("update %d started: %d episodes", self.trainer_step + 1, len(batch.samples))
        update = ppo_update(self.policy, batch, self.baseline, decay=self.settings.trainer_baseline_decay)
        self.baseline, metrics = update.baseline, update.metrics
        self.trainer_step += 1
        self.project_policies.update(update.samples, batch, shared_version=self.version,
                                     log_metrics=self._log_metrics)
        p = self.progress
        p.trained += len(update.samples)
        p.updates += 1
        p.update_metrics.append(metrics)
        metrics.update(dropped_stale_total=float(p.dropped.get("stale", 0)))
        self._log_metrics(metrics)
        log.info("update %d done: reward %.3f, loss %.4f, kl %.4f, %.0f tokens/s, %.2fs", self.trainer_step,
                 metrics["reward_mean"], metrics["policy_loss"], metrics["approx_kl"], metrics["tokens_per_s"],
                 metrics["update_seconds"])
        self._read_head_feed()  # an update takes seconds: a canary's episodes may have come meanwhile
        return self._save_if_due(consumer)

    def _log_metrics(self, metrics: dict, project: str = "") -> None:
        self.metrics_log.write(metrics, step=self.trainer_step, version=self.version, project=project)

    def _save_if_due(self, consumer: Consumer) -> int:
        """Save a version if ``trainer_save_every`` updates wait and no canary holds the save back; 1 if saved."""
        if (self.progress.updates >= self.settings.trainer_save_every
                and not self.canary_watch.holds_back("", self.progress.updates)):
            self._save_version(consumer)
            return 1
        return 0

    # -- versions ------------------------------------------------------------------

    def _save_version(self, consumer: Consumer) -> Manifest:
        p = self.progress
        # The projects' versions first, the shared one last: its manifest names them, so it is the commit record
        # of the whole save point (module docstring).
        project_manifests = [self.project_policies.save(own, self._write, shared_version=self.version,
                                                        trainer_step=self.trainer_step)
                             for own in self.projects.values()
                             if own.updates and not self.canary_watch.holds_back(own.project, own.updates)]
        metrics = averaged(p.update_metrics)
        metrics.update(baseline_metrics(self.baseline))
        metrics.update(self.project_policies.manifest_metrics())
        manifest = self._write(self.policy, dict(
            parent_version=self.version, trainer_step=self.trainer_step, episodes_consumed=p.consumed,
            episodes_trained=p.trained, episodes_dropped=dict(p.dropped), metrics=metrics))
        self.shared_versions.append(manifest.version)
        for project_manifest in project_manifests:
            self._announce(project_manifest, weights_in_memory=True)
        self._announce(manifest, weights_in_memory=True)
        # Weights and manifest are on disk, Kafka has the WeightVersion: now the offsets may move.
        commit = [TopicPartition(self.topic, int(part), off) for part, off in p.offsets.items()]
        if commit:
            with guarded(self.guard, f"committing the offsets of version {manifest.version} to Kafka"):
                consumer.commit(offsets=commit, asynchronous=False)
        self.version = manifest.version
        self.total_consumed += p.consumed
        self.progress = Progress(dict(p.offsets), dict(p.offsets))
        log.info("version %d saved (%d episodes, %d trained, dropped %s) at %s", manifest.version,
                 manifest.episodes_consumed, manifest.episodes_trained, manifest.episodes_dropped or "none",
                 manifest.uri)
        return manifest

    def _write(self, policy: PolicyTrainer, fields: dict) -> Manifest:
        return self.checkpoints.write(policy, self.progress, self.total_consumed, fields)

    def _announce(self, manifest: Manifest, *, weights_in_memory: bool = False) -> None:
        """Publish the version's WeightVersion and wait for the ack (the status the settings ask for, if the
        promotion gate lets the version out; ``weights_in_memory``: the policy holds this version's weights)."""
        project = manifest.project_id
        status, extra = release(self.settings, self.weight_versions.serving_of(project))
        if self.promotion.on and (status == "PROMOTED" or CANARY_SHARE in extra):  # it would reach users
            policy = (self.projects[project].policy if project else self.policy) if weights_in_memory else None
            status, extra = self.promotion.let_out(manifest, status, extra, policy,
                                                   serving=self.weight_versions.serving_of(project))
        publish(self.producer, self.weight_versions, version_event(manifest, status, extra))
        self.canary_watch.refresh()

    def _publish_unannounced(self) -> None:
        """A crash between the manifest and the WeightVersion left a version nobody heard of: announce it now."""
        for manifest in unannounced(self.store, self.weight_versions.statuses()):
            self._announce(manifest)

    # -- the head of the topic: canaries and the gate's pool ---------------------------

    def _read_head_feed(self) -> bool:
        """Count what the head reader brought for the canaries (it follows the oldest running canary's start,
        else the head while the gate is on), keep its held-out episodes for the gate, and judge the canaries.
        Whether it brought anything."""
        feed = self.head_feed
        if feed is None:
            return False
        feed.follow(self.canary_watch.oldest_start_ms(), at_head=self.promotion.on)
        messages = feed.poll()
        for m in messages:
            received = decode_message(self.codec, m)
            if received is not None and received.event is not None:
                ep = received.event.record
                self.canary_watch.count(ep)
                if self.promotion.holds_out(ep):
                    self.promotion.episodes.add(ep)
        if messages:
            self._judge_canary()
        return bool(messages)

    def _judge_canary(self) -> None:
        """Publish each canary its episodes decide, and follow a rollback at once."""
        for tally, decision in self.canary_watch.decided():
            self.canary_watch.conclude(tally, decision)
            self._follow_rollbacks()
            self.metrics_log.scalar("canary/promoted", 1.0 if decision == "PROMOTED" else 0.0, tally.candidate)


def make_consumers(settings: Settings, group_id: str, topic: str, on_assign) -> tuple[Consumer, Consumer]:
    """The trainer's consumers: the episodes' (its group, seeking in ``on_assign``) and the weights topic's."""
    episodes = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": group_id,
                         "enable.auto.commit": False, "auto.offset.reset": "earliest",
                         "partition.assignment.strategy": "range", "log_level": 3,
                         # Static membership: a restarted trainer takes its partitions back at once
                         # instead of waiting out the dead process's session; a second trainer with
                         # the same group fences the first (one trainer per base model).
                         "group.instance.id": f"{group_id}-trainer", "session.timeout.ms": 30000})
    episodes.subscribe([topic], on_assign=on_assign)
    weights = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": f"{group_id}-weights",
                        "enable.auto.commit": False, "log_level": 3})
    weights.assign([TopicPartition(WEIGHTS.name, 0, OFFSET_BEGINNING)])
    return episodes, weights


__all__ = ["OnlineTrainer", "drop_reason", "episode_sample", "episode_sampler", "load_policy", "update_config",
           "base_version_event"]
