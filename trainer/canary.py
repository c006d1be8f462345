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
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
