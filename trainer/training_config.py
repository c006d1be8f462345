"""The training knobs the benches and the offline model builders share, each said and checked once.

Every run here that trains a policy or a model is given a learning rate and a seed (``TrainingConfig``); one
that trains LoRA adapters on a frozen base, their rank too (``LoraTraining``: ``tabloop bench teams``,
``tabloop bench loop``, ``tabloop model teach-fim``); one that runs next-token training on FIM examples, its
schedule and examples (``Pretraining``: ``tabloop model demo`` and ``tabloop model teach-fim``, both through
``trainer.proof.demo_model.pretrain``). Each command's config extends these and keeps its own defaults (its
options state them again), so ``DemoConfig(seed=…, steps=…)`` and ``TeamsConfig(lr=…, lora_rank=…)`` read
as before. The offline RL update's own config (group size, prompts per update, sampler) is
``trainer.proof.offline.OfflineConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class TrainingConfig:
    """A learning rate and a seed: what every training run of a bench or a model builder is given."""

    what: ClassVar[str] = "training"
    """The config's name in its error messages."""

    lr: float = 1e-4
    """Peak learning rate of the optimizer (AdamW), after any warm-up."""
    seed: int = 0
    """Seeds the task order, the sampling and any new weights: a run that ends by its steps, not by a clock,
    is reproducible from it."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"{self.what} lr must be positive, got {self.lr}")


@dataclass(frozen=True)
class LoraTraining(TrainingConfig):
    """Training LoRA adapters on a frozen base model (alpha twice the rank, as ``trainer.learner.PolicyTrainer``
    and ``trainer.teach_fim`` build them)."""

    lora_rank: int = 8
    """Rank of the LoRA adapters."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lora_rank <= 0:
            raise ValueError(f"{self.what} lora_rank must be positive, got {self.lora_rank}")


@dataclass(frozen=True)
class Pretraining(TrainingConfig):
    """Next-token training on FIM examples cut from the standard library's train split: what
    ``trainer.proof.demo_model.pretrain`` runs (``steps`` or ``minutes``, whichever ends first, with a warm-up,
    stable, cool-down schedule that follows the further of the two) and what ``fim_examples`` cuts.

    The defaults are the demo model's: a Qwen2 of a few million parameters from scratch on two CPU cores."""

    MIN_SEQ_LEN: ClassVar[int] = 32
    """The shortest ``seq_len`` an example can be cut to (room for a FIM template, prefix and middle)."""

    lr: float = 2e-3
    steps: int = 600
    """Optimizer steps; about 8 minutes on two CPU cores at the defaults."""
    minutes: float = 8.0
    """Wall-clock cap on the training (loading, the data and saving come on top)."""
    batch_size: int = 16
    """Examples per optimizer step."""
    warmup_steps: int = 30
    """Steps of linear learning-rate warm-up."""
    seq_len: int = 256
    """Tokens per example at most."""
    per_file: int = 32
    """FIM examples cut from each train-split file."""
    plain_share: float = 0.1
    """Share of examples that are plain left-to-right text (no FIM), so plain prompts work too."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("steps", "batch_size", "seq_len", "per_file"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{self.what} {name} must be positive, got {getattr(self, name)}")
        if self.minutes <= 0:
            raise ValueError(f"{self.what} minutes must be positive, got {self.minutes}")
        if not 0 <= self.plain_share < 1:
            raise ValueError(f"{self.what} plain_share must be in [0, 1), got {self.plain_share}")
        if self.seq_len < self.MIN_SEQ_LEN:
            raise ValueError(f"{self.what} seq_len must be at least {self.MIN_SEQ_LEN}, got {self.seq_len}")
