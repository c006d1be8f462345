"""One online policy update, read as the algorithm: batch → advantages → losses → step → metrics.

``ppo_update`` is the whole of it:

1. the batch: the samples the trainer's consumer took since the last update (``Batch``), with their rewards
   and projects;
2. advantages: each reward minus its project's running mean reward before this batch
   (``trainer.losses.baseline_advantages``), written into the samples;
3. losses: per micro-batch, PPO's clipped surrogate against the behaviour logprobs, the entropy bonus and the
   KL to the reference, each term named (``trainer.losses.LossTerms``, computed by ``PolicyTrainer.update``);
4. step: per epoch, the gradient's norm clipped and one AdamW step;
5. metrics: the loss terms and the step's figures, then the batch's own (reward, accept rate, staleness).

Everything around it (which episodes become samples, canaries, the promotion gate, per-project policies,
checkpoints) is the online trainer's business (trainer/online.py) and its collaborators'.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra.settings import Settings
from trainer.learner import PolicyTrainer, Sample, UpdateConfig
from trainer.losses import BaselineState, baseline_advantages

log = logging.getLogger("tabloop.trainer")


@dataclass
class Batch:
    """Samples waiting for the next update, and what they came from."""

    samples: list[Sample] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    projects: list[str] = field(default_factory=list)
    accepted: int = 0
    staleness: list[int] = field(default_factory=list)
    first_at: float | None = None

    def add(self, sample: Sample, *, reward: float, accepted: bool, staleness: int, project: str) -> None:
        self.samples.append(sample)
        self.rewards.append(reward)
        self.accepted += accepted
        self.staleness.append(staleness)
        self.projects.append(project)
        if self.first_at is None:
            self.first_at = time.monotonic()

    def figures(self) -> dict[str, float]:
        """The batch's own metrics: mean reward, accept rate, and how many versions old its episodes were."""
        return dict(reward_mean=sum(self.rewards) / len(self.rewards), accept_rate=self.accepted / len(self.rewards),
                    staleness_mean=sum(self.staleness) / len(self.staleness), staleness_max=float(max(self.staleness)))


@dataclass(frozen=True)
class Update:
    samples: list[Sample]
    """The batch's samples, each with its advantage."""
    metrics: dict[str, float]
    baseline: BaselineState
    """The per-project reward means after this batch."""


def ppo_update(policy: PolicyTrainer, batch: Batch, baseline: BaselineState, *, decay: float) -> Update:
    """One PPO update of ``policy`` on ``batch`` (the module doc's five steps)."""
    # Advantages: reward − the project's running mean before this batch; the means move on (decay per episode).
    advantages, baseline = baseline_advantages(batch.rewards, batch.projects, baseline, decay=decay)
    samples = [dataclasses.replace(s, advantage=a) for s, a in zip(batch.samples, advantages)]
    # Losses and step: each micro-batch's named terms (trainer/losses.py), one clipped AdamW step per epoch.
    metrics = policy.update(samples)
    # Metrics: the terms', the step's, and the batch's.
    metrics.update(batch.figures())
    return Update(samples, metrics, baseline)


def project_update(policy: PolicyTrainer, samples: list[Sample], rewards: list[float]) -> dict[str, float]:
    """A project's own policy updated on that project's samples of a batch, with the advantages the batch's
    update gave them (the baseline is per project already). Not the weights that served them (the samples'
    ``same_weights`` speaks of the shared policy): their server logprobs stay the ratio's denominators."""
    metrics = policy.update([dataclasses.replace(s, same_weights=False) for s in samples])
    metrics.update(reward_mean=sum(rewards) / len(rewards))
    return metrics


def update_config(settings: Settings) -> UpdateConfig:
    return UpdateConfig(lr=settings.trainer_lr, warmup_updates=settings.trainer_warmup_updates,
                        clip_eps=settings.trainer_clip_eps, clip_ratio_c=settings.trainer_clip_ratio_c,
                        kl_coef=settings.trainer_kl_coef,
                        entropy_coef=settings.trainer_entropy_coef, max_grad_norm=settings.trainer_max_grad_norm,
                        micro_batch=settings.trainer_micro_batch, epochs=settings.trainer_epochs,
                        tis_cap=settings.trainer_tis_cap)


class MetricsLog:
    """Each update's metrics: a line of ``metrics.jsonl`` and TensorBoard scalars (``train/…``, a project's
    policy ``project/<id>/…``)."""

    def __init__(self, log_dir: Path):
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional: without it, metrics.jsonl only

            self.writer = SummaryWriter(str(log_dir / "tensorboard"))
        except ImportError:  # pragma: no cover - tensorboard is a dependency; the log file still gets everything
            log.warning("tensorboard is not installed: metrics go to metrics.jsonl only")
        self.file = open(log_dir / "metrics.jsonl", "a")

    def write(self, metrics: dict, *, step: int, version: int, project: str = "") -> None:
        row = {"step": step, "version": version, "time": time.time(), **metrics}
        self.file.write(json.dumps({**row, "project": project} if project else row) + "\n")
        self.file.flush()
        if self.writer is not None:
            prefix = f"project/{project}/" if project else "train/"
            for k, v in metrics.items():
                self.writer.add_scalar(f"{prefix}{k}", v, step)
            self.writer.flush()

    def scalar(self, name: str, value: float, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.file.close()
