"""The online trainer's checkpoints: its policies' weights in the weight store (policy/weight_store.py), each
with a manifest that says which episodes are in it.

``Checkpoints`` loads a policy from a saved version (or the base model) and writes one; ``Progress`` is what
the next version's manifest will say about its episodes; the rest reads a manifest back (the averaged update
metrics, the reward baseline it saved).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from infra.settings import Settings
from policy.models import load_model
from policy.weight_store import Manifest, WeightStore
from trainer.learner import PolicyTrainer, UpdateConfig, describe_device
from trainer.losses import BaselineState
from trainer.update import update_config

log = logging.getLogger("tabloop.trainer")


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

    def drop(self, reason: str, episodes: int = 1) -> None:
        """Count ``episodes`` consumed and not trained on, for ``reason``."""
        self.dropped[reason] = self.dropped.get(reason, 0) + episodes


class Checkpoints:
    """Versions of the trainer's policies in ``store``: loaded from, and written with the episodes they hold."""

    def __init__(self, settings: Settings, store: WeightStore, *, topic: str, work_dir: Path):
        self.settings = settings
        self.store = store
        self.topic = topic
        self.work_dir = work_dir
        """Where a version is written before the store takes it."""

    def load(self, manifest: Manifest | None) -> PolicyTrainer:
        """A trainer starting from ``manifest``'s weights (None: the base model with fresh adapters)."""
        return load_policy(self.settings, self.store, manifest)

    def saved(self, version: int) -> Manifest | None:
        """``version``'s manifest if this store holds it (None: the base model, version 0, or one it has not)."""
        return self.store.manifest(version) if version in self.store.versions() else None

    def write(self, policy: PolicyTrainer, progress: Progress, consumed_before: int, fields: dict) -> Manifest:
        """Save ``policy``'s weights as the next version, its manifest saying the offsets ``progress`` reached
        (and ``consumed_before`` + its episodes consumed in all) besides ``fields``."""
        p = progress
        with tempfile.TemporaryDirectory(dir=self.work_dir) as tmp:
            policy.save(Path(tmp))
            return self.store.save(self.store.next_version(), Path(tmp), dict(
                kind=policy.kind, source_topic=self.topic, source_offsets_start=dict(p.offsets_start),
                source_offsets=dict(p.offsets), episodes_consumed_total=consumed_before + p.consumed, **fields))


def discard_unfinished_save_point(store: WeightStore) -> list[int]:
    """Remove the project versions written after the newest shared one: their save point never finished (the
    shared manifest is its commit record), so they are part of no saved state, and nothing announced them.
    Their numbers are used again, as a half-written directory's are (``WeightStore.next_version``): the
    versions announced stay one unbroken sequence. Returns the versions removed."""
    manifests = store.manifests()
    newest_shared = max((m.version for m in manifests if not m.project_id), default=0)
    orphans = [m for m in manifests if m.project_id and m.version > newest_shared]
    for manifest in reversed(orphans):  # newest first: a crash halfway leaves the rest after the newest
        log.warning("project %s: version %d was saved in a save point that never finished; removed, its "
                    "episodes are trained again", manifest.project_id, manifest.version)
        store.remove(manifest.version)
    return [m.version for m in orphans]


def unannounced(store: WeightStore, statuses: Mapping[int, object]) -> Iterator[Manifest]:
    """The saved versions no WeightVersion announced (``statuses``: those announced): a crash between the
    manifest and the WeightVersion."""
    for manifest in store.manifests():
        if manifest.version not in statuses:
            log.info("announcing version %d, saved before the last stop but never published", manifest.version)
            yield manifest


def load_policy(settings: Settings, store: WeightStore, manifest: Manifest | None, *,
                config: UpdateConfig | None = None, full: bool | None = None) -> PolicyTrainer:
    """A trainer starting from ``manifest``'s weights: a LoRA adapter over the base, or full weights; None: the
    base model (LoRA adapters, or every weight when ``full`` / ``trainer_full_finetune``).

    The KL reference is the base model whatever the trainer resumes from: a full fine-tune resumed from
    saved full weights loads the base a second time for it (a copy of the resumed weights would make the
    KL measure the distance from the last save, 0 after every restart).
    """
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


def averaged(update_metrics: list[dict]) -> dict[str, float]:
    """Each metric's mean over the updates that reported it in every update."""
    return {k: sum(m[k] for m in update_metrics) / len(update_metrics)
            for k in update_metrics[-1] if all(k in m for m in update_metrics)}


def baseline_metrics(baseline: BaselineState) -> dict[str, float]:
    """The per-project reward means and counts as manifest metrics (``baseline_from`` reads them back)."""
    out = {f"baseline_mean/{proj}": mean for proj, mean in baseline.means.items()}
    out.update({f"baseline_count/{proj}": float(n) for proj, n in baseline.counts.items()})
    return out


def baseline_from(manifest: Manifest) -> BaselineState:
    """The per-project reward means a manifest saved, so a restart does not start the baseline over."""
    means = {k.split("/", 1)[1]: v for k, v in manifest.metrics.items() if k.startswith("baseline_mean/")}
    counts = {k.split("/", 1)[1]: int(v) for k, v in manifest.metrics.items() if k.startswith("baseline_count/")}
    return BaselineState(means, counts)
