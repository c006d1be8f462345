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

The online trainer runs the gate through ``PromotionGate``: the held-out pool and the verdict on each version.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from infra.settings import Settings
from policy.weight_store import Manifest
from rewards.spec import RewardSpecs
from trainer.learner import PolicyTrainer
from trainer.ope_episodes import evaluate_logged, select_episodes

log = logging.getLogger("tabloop.trainer")

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


class PromotionGate:
    """The gate as the online trainer runs it: which episodes it holds out of training, the pool of them
    (newest last; not kept across restarts: after one, the gate waits for new held-out episodes before it
    lets a version out), and its verdict on a version about to reach users."""

    def __init__(self, settings: Settings, *, reward_specs: Callable[[], RewardSpecs]):
        self.settings = settings
        self.reward_specs = reward_specs
        """The reward specs, read at each verdict (what an IGNORED episode earns, per project)."""
        self.episodes = HeldOutPool(settings.promote_gate_episodes)

    @property
    def on(self) -> bool:
        return self.settings.promote_gate != "none"

    def holds_out(self, ep: dict) -> bool:
        """Whether the gate holds this episode out of training. A completion the show-gate hid is never held
        out: the user saw nothing, so it says nothing of a weight version (``drop_reason`` drops it as
        "gate_hidden")."""
        return self.on and ep.get("gate_shown") is not False and in_gate_holdout(ep["completion_id"],
                                                                                   self.settings.promote_gate_share)

    def let_out(self, manifest: Manifest, status: str, extra: dict[str, float], policy: PolicyTrainer | None, *,
                serving: int) -> tuple[str, dict[str, float]]:
        """The (status, metrics) a version about to reach users goes out with: as it would (the gate's figures
        added) if the gate passes it or only shadows, else a CANDIDATE that waits with the figures alone.
        ``policy``: the one holding the version's weights (None: announced after a restart)."""
        gate = self.settings.promote_gate
        decision, figures = self.judge(manifest, policy, serving=serving)
        if gate == "shadow":
            verdict = "would go out" if decision.passed else "would wait (shadow: goes out anyway)"
        else:
            verdict = "goes out" if decision.passed else "waits as CANDIDATE"
        log.info("promotion gate: version %d%s %s: %s", manifest.version,
                 f" (project {manifest.project_id})" if manifest.project_id else "", verdict, decision.reason)
        if decision.passed or gate == "shadow":
            return status, {**extra, **figures}
        return "CANDIDATE", figures  # no canary share: nobody is served a refused version

    def judge(self, manifest: Manifest, policy: PolicyTrainer | None, *, serving: int
              ) -> tuple[GateDecision, dict[str, float]]:
        """Estimate the version on the held-out episodes its project's serving version (``serving``) served (a
        project's version: that project's episodes only)."""
        version, project = manifest.version, manifest.project_id
        if policy is None:  # announced after a restart: those weights are not the ones loaded
            decision = GateDecision(False, f"version {version} was saved before a restart and not re-evaluated")
            return decision, estimate_metrics(None, serving_version=serving, held_out=0, decision=decision)
        s = self.settings
        logged = select_episodes((ep for ep in self.episodes if ep["policy_version"] == serving
                                  and (not project or ep["project_id"] == project)),
                                 policy.tokenizer, max_prompt_tokens=s.max_prompt_tokens)
        held_out = len(logged.samples)
        result = None
        if held_out >= s.promote_gate_min_episodes:
            specs = self.reward_specs()
            result = evaluate_logged(policy.model, policy.tokenizer, logged, clip=s.promote_gate_clip,
                                     level=s.promote_gate_level,
                                     ignored_reward=(specs.for_project(project) if project else specs.default).ignored,
                                     device=policy.device)
        interval = gate_reward(result) if result else None
        decision = gate_decision(interval["low"] if interval else None,
                                 result["logged"].get("reward_mean") if result else None, held_out,
                                 min_episodes=s.promote_gate_min_episodes)
        return decision, estimate_metrics(result, serving_version=serving, held_out=held_out, decision=decision)
