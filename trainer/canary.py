"""Canary releases: a new version serves a share of requests until its episodes decide it.

The rule, stated once (``canary_decision``): wait until both the candidate and
the promoted version have at least ``min_episodes`` decided episodes (accepted
or rejected) since the candidate went out; then PROMOTE if the candidate's
accept rate is no more than ``margin`` below the promoted version's, else
ROLL BACK. Both rates are counted over the same period (episodes joined after
the candidate's WeightVersion event), so a quiet hour or a busy one affects
both alike.

A WeightVersion event with status CANDIDATE asks for a canary when its
``metrics`` map holds ``canary_share`` > 0; ``baseline_version`` names the
version it is compared with (the one promoted when it was published).

The online trainer runs its canaries through ``CanaryWatch``: the rule above applied to the episodes it reads,
and the WeightVersion that ends each canary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from infra.settings import Settings
from policy.weight_store import WeightStore, version_event
from schemas.events import new_event
from trainer.promotion import OPE_PREFIX
from trainer.weight_records import WeightRecords, publish

log = logging.getLogger("tabloop.trainer")

CANARY_SHARE = "canary_share"
BASELINE_VERSION = "baseline_version"
DECIDED_OUTCOMES = ("ACCEPTED", "REJECTED", "PARTIAL")


def canary_decision(candidate_accepted: int, candidate_total: int, baseline_accepted: int, baseline_total: int, *,
                    min_episodes: int, margin: float) -> str | None:
    """PROMOTED, ROLLED_BACK, or None while either version has fewer than ``min_episodes`` episodes."""
    if candidate_total < min_episodes or baseline_total < min_episodes:
        return None
    candidate_rate = candidate_accepted / candidate_total
    baseline_rate = baseline_accepted / baseline_total
    return "PROMOTED" if candidate_rate >= baseline_rate - margin else "ROLLED_BACK"


@dataclass
class CanaryTally:
    """Accepts and totals per version for one running canary."""

    candidate: int
    baseline: int
    since_ms: int
    accepted: dict[int, int] = field(default_factory=dict)
    total: dict[int, int] = field(default_factory=dict)
    project: str = ""
    """A project's canary counts that project's episodes only (its baseline may be the shared version, which
    other projects are served too); "" the shared policy's canary."""
    counted: set[str] = field(default_factory=set)
    """The completions counted: two readers feed a tally (trainer/head_feed.py), each episode counts once."""

    def add(self, policy_version: int | None, outcome: str, joined_at_ms: int, project: str = "", *,
            completion_id: str) -> None:
        """Count one episode if it is from either version, in the canary's period, decided, and not counted yet."""
        if policy_version not in (self.candidate, self.baseline) or joined_at_ms < self.since_ms:
            return
        if self.project and project != self.project:
            return
        if outcome not in DECIDED_OUTCOMES:
            return  # IGNORED: the user never saw it decided either way
        if completion_id in self.counted:
            return
        self.counted.add(completion_id)
        self.total[policy_version] = self.total.get(policy_version, 0) + 1
        if outcome == "ACCEPTED":
            self.accepted[policy_version] = self.accepted.get(policy_version, 0) + 1

    def decide(self, min_episodes: int, margin: float) -> str | None:
        return canary_decision(self.accepted.get(self.candidate, 0), self.total.get(self.candidate, 0),
                               self.accepted.get(self.baseline, 0), self.total.get(self.baseline, 0),
                               min_episodes=min_episodes, margin=margin)

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, v in (("candidate", self.candidate), ("baseline", self.baseline)):
            total = self.total.get(v, 0)
            out[f"canary_{name}_episodes"] = float(total)
            out[f"canary_{name}_accept_rate"] = self.accepted.get(v, 0) / total if total else 0.0
        return out


CANARY_WITHDRAWN = "canary_withdrawn"
"""WeightVersion metric: 1 on the CANDIDATE (canary share 0) that withdraws a canary nobody decided in time."""
CANARY_WAITED_S = "canary_waited_s"


def release(settings: Settings, baseline_version: int) -> tuple[str, dict[str, float]]:
    """How a new version goes out, before the promotion gate has its say: (status, WeightVersion metrics).
    On canary (a CANDIDATE serving ``canary_share`` of the requests, compared with ``baseline_version``, the
    version serving its project) when the share is above 0; else PROMOTED (``auto_promote``) or CANDIDATE."""
    if settings.canary_share > 0:
        return "CANDIDATE", {CANARY_SHARE: settings.canary_share, BASELINE_VERSION: float(baseline_version)}
    return "PROMOTED" if settings.auto_promote else "CANDIDATE", {}


class CanaryWatch:
    """The online trainer's running canaries, one per project ("" the shared policy's).

    It follows the CANDIDATEs that asked for a canary (``refresh``), counts the episodes of each (``count``),
    decides them (``decided``, ``conclude``) and applies the canary rule to saves (``holds_back``): a canary is
    decided before the next version of its project goes out, or withdrawn once ``canary_max_wait_s`` passed
    (``withdraw``). Each ending is a WeightVersion it publishes.
    """

    def __init__(self, settings: Settings, store: WeightStore, records: WeightRecords, producer):
        self.settings = settings
        self.store = store
        self.records = records
        self.producer = producer
        self.running: dict[str, CanaryTally] = {}
        """project ("" the shared policy) -> its running canary."""

    def refresh(self) -> None:
        """Follow each project's newest undecided CANDIDATE that asked for a canary ("" the shared policy's)."""
        live: dict[str, object] = {}
        for s in sorted(self.records.statuses().values(), key=lambda s: s.version):
            if s.status == "CANDIDATE" and s.metrics.get(CANARY_SHARE, 0) > 0:
                live[self.records.version_project.get(s.version, "")] = s
        for project in list(self.running):
            if project not in live:
                del self.running[project]
        for project, newest in live.items():
            tally = self.running.get(project)
            if tally is None or tally.candidate != newest.version:
                baseline = int(newest.metrics.get(BASELINE_VERSION, self.records.serving_of(project)))
                self.running[project] = CanaryTally(newest.version, baseline, newest.at_ms, project=project)
                log.info("canary%s: version %d serves %.0f%% of requests, compared with version %d",
                         f" of project {project}" if project else "", newest.version,
                         100 * newest.metrics[CANARY_SHARE], baseline)

    def count(self, ep: dict) -> None:
        for tally in self.running.values():
            tally.add(ep["policy_version"], ep["outcome"], int(ep["joined_at"].timestamp() * 1000), ep["project_id"],
                      completion_id=ep["completion_id"])

    def oldest_start_ms(self) -> int | None:
        """When the oldest running canary started (None: none runs): its episodes are read from there on."""
        return min((t.since_ms for t in self.running.values()), default=None)

    def decided(self) -> Iterator[tuple[CanaryTally, str]]:
        """Each canary its episodes decide now (PROMOTED or ROLLED_BACK), no longer running once yielded."""
        for project, tally in list(self.running.items()):
            decision = tally.decide(self.settings.canary_min_episodes, self.settings.canary_margin)
            if decision is not None:
                del self.running[project]
                yield tally, decision

    def conclude(self, tally: CanaryTally, decision: str) -> None:
        """Publish a decided canary's WeightVersion."""
        log.info("canary: version %d %s (%s)", tally.candidate, decision, tally.summary())
        self._publish_end(tally, decision)

    def overdue(self, project: str) -> bool:
        tally = self.running.get(project)
        return tally is not None and time.time() - tally.since_ms / 1000 >= self.settings.canary_max_wait_s

    def holds_back(self, project: str, updates: int) -> bool:
        """Whether a save of ``project``'s policy ("" the shared one), ``updates`` updates since its last save,
        waits for that policy's running canary.

        The canary rule: a canary is decided before the next version of its project goes out. A trainer that
        saves faster than the canary gathers its episodes (or that reads a backlog: the canary counts only
        episodes joined after it started) keeps updating, and every update made meanwhile is folded into the
        version saved after the decision. A canary still undecided ``canary_max_wait_s`` after it went out (too
        little traffic to decide it) is withdrawn first, with a WeightVersion that says so (``withdraw``), and
        then the save goes ahead: slow traffic must not keep the trainer's progress unsaved forever.
        """
        tally = self.running.get(project)
        if tally is None:
            return False
        if self.overdue(project):
            self.withdraw(tally)
            return False
        if updates == self.settings.trainer_save_every:
            log.info("canary%s: the next version waits for version %d's decision (%s)",
                     f" of project {project}" if project else "", tally.candidate, tally.summary())
        return True

    def withdraw(self, tally: CanaryTally) -> None:
        """Withdraw a canary nobody decided in time: it is announced again as a CANDIDATE with no canary share
        (serving drops it; ``tabloop weights promote`` can still promote it), ``canary_withdrawn`` 1, how long it
        waited and its counts. A withdrawal is no verdict on the weights, so the trainer goes on from them."""
        waited_s = time.time() - tally.since_ms / 1000
        self.running.pop(tally.project, None)
        log.warning("canary%s: version %d withdrawn, undecided after %.0f s (%s); the next version goes out",
                    f" of project {tally.project}" if tally.project else "", tally.candidate, waited_s,
                    tally.summary())
        self._publish_end(tally, "CANDIDATE", {CANARY_SHARE: 0.0, CANARY_WITHDRAWN: 1.0, CANARY_WAITED_S: waited_s,
                                               BASELINE_VERSION: float(tally.baseline)})

    def _publish_end(self, tally: CanaryTally, status: str, extra: dict[str, float] | None = None) -> None:
        """The WeightVersion that ends a canary: its counts (and ``extra``) in the metrics, with the gate's
        estimate kept beside them (the history's version_estimates view)."""
        summary = {**tally.summary(), **(extra or {})}
        base_model = self.records.base_model
        estimate = {k: v for r in self.records.records if r["version"] == tally.candidate
                    and r["base_model"] == base_model for k, v in r["metrics"].items() if k.startswith(OPE_PREFIX)}
        if tally.candidate in self.store.versions():
            event = version_event(self.store.manifest(tally.candidate), status, {**estimate, **summary})
        else:  # published by someone else's store: restate what the topic said
            record = next(r for r in reversed(self.records.records)
                          if r["version"] == tally.candidate and r["base_model"] == base_model)
            fields = {k: v for k, v in record.items() if k not in ("event_id", "created_at", "status", "metrics")}
            event = new_event("WeightVersion", **fields, metrics={**record["metrics"], **summary}, status=status)
        publish(self.producer, self.records, event)
