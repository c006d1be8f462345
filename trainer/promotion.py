"""The promotion gate (``TABLOOP_PROMOTE_GATE=ope``): a new version goes out only if the log says it is better.

A share of the episodes (``promote_gate_share``, chosen by a hash of the completion id, so the same
episode is held out on every replay) is never trained on. When the trainer saves a version V it estimates
V's mean reward on the held-out episodes that the serving (promoted) version served, off-policy
(``trainer.ope``: clipped self-normalised importance weights, doubly robust), and compares the estimate's
lower bound with what the serving version actually earned on those same episodes. V is promoted (or put
on canary) only if the bound is higher; otherwise it is published as a CANDIDATE that waits, with the
estimate in its metrics either way.

The held-out episodes the estimate weighs are the sampled ones: the exploration samples (the coin's share of
the traffic, ``policy.exploration``) and requests at a client's own temperature. Greedy ones are point
masses with no importance weight (``trainer.ope_episodes.select_episodes`` skips them), so the comparison is
of V sampled as those were against what the serving version earned on the same sampled episodes, and the
gate needs ``promote_gate_min_episodes`` of them: about 1 / share times the held-out traffic.

Why held out: the episodes a version was trained on are the ones it has learnt to give more probability
when they were accepted; weighed by that version they would flatter it. Why the serving version's own
episodes: on them its value is not an estimate but the logged mean, so the gate compares an estimate with a
measurement, not two estimates.

The figures travel in the WeightVersion's ``metrics`` under ``ope_*`` names (``estimate_metrics``) and the
history's ``version_estimates`` view lists them beside what a canary later measured.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

OPE_PREFIX = "ope_"


def in_gate_holdout(completion_id: str, share: float) -> bool:
    """Whether the episode of ``completion_id`` is held out of training for the gate: the same answer on every
    replay and in every process (a hash, not a random draw)."""
    digest = hashlib.sha256(completion_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < share


class HeldOutPool:
    """The newest ``size`` held-out episodes, each once: two readers bring them (trainer/head_feed.py)."""

    def __init__(self, size: int):
        self.size = size
        self._episodes: deque[dict] = deque()
        self._ids: set[str] = set()

    def add(self, episode: dict) -> bool:
        """Keep ``episode`` (dropping the oldest past ``size``) unless it is kept already; whether it was new."""
        if episode["completion_id"] in self._ids:
            return False
        self._episodes.append(episode)
        self._ids.add(episode["completion_id"])
        if len(self._episodes) > self.size:
            self._ids.discard(self._episodes.popleft()["completion_id"])
        return True

    def __iter__(self) -> Iterator[dict]:
        return iter(self._episodes)

    def __len__(self) -> int:
        return len(self._episodes)


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    reason: str


def gate_decision(estimate_low: float | None, serving_reward: float | None, episodes: int, *,
                  min_episodes: int) -> GateDecision:
    """Pass only with at least ``min_episodes`` held-out episodes and a lower bound above the serving
    version's logged mean reward."""
    if episodes < min_episodes or serving_reward is None:
        return GateDecision(False, f"{episodes} held-out episodes of the serving version, {min_episodes} needed")
    if estimate_low is None:
        return GateDecision(False, "no estimate (every weight was zero)")
    if estimate_low > serving_reward:
        return GateDecision(True, f"estimate's lower bound {estimate_low:.4f} > serving {serving_reward:.4f}")
    return GateDecision(False, f"estimate's lower bound {estimate_low:.4f} <= serving {serving_reward:.4f}")


def gate_reward(result: dict) -> dict | None:
    """The interval the gate reads from an evaluation (``trainer.ope_episodes.evaluate_logged``): the doubly
    robust mean reward, or the plain importance-sampled one where there is no DR estimate."""
    return result.get("reward_mean_dr") or result.get("reward_mean")


def estimate_metrics(result: dict | None, *, serving_version: int, held_out: int, decision: GateDecision
                     ) -> dict[str, float]:
    """The gate's figures as WeightVersion metrics (flat ``ope_*`` doubles; absent figures are left out)."""
    out = {f"{OPE_PREFIX}serving_version": float(serving_version), f"{OPE_PREFIX}held_out": float(held_out),
           f"{OPE_PREFIX}gate_passed": 1.0 if decision.passed else 0.0}
    if result is None:
        return out
    out[f"{OPE_PREFIX}episodes"] = float(result["episodes"])
    out[f"{OPE_PREFIX}ess"] = float(result["effective_sample_size"])
    out[f"{OPE_PREFIX}clipped_share"] = float(result["clipped_share"])
    out[f"{OPE_PREFIX}level"] = float(result["level"])
    for name in ("accept_rate_shown", "shown_share", "reward_mean", "reward_mean_dr"):
        interval = result.get(name)
        if interval:
            out[f"{OPE_PREFIX}{name}"] = float(interval["value"])
            out[f"{OPE_PREFIX}{name}_low"] = float(interval["low"])
            out[f"{OPE_PREFIX}{name}_high"] = float(interval["high"])
    for name, value in result.get("logged", {}).items():
        if value is not None:
            out[f"{OPE_PREFIX}serving_{name}"] = float(value)
    return out
