"""The demo model: a small Qwen2 pretrained here, offline, with the fill-in-the-middle objective.

``tabloop model tiny`` is random noise in the right shape (for tests);
this is the model a newcomer gets from ``make up`` when no model is
configured: completions that look like Python, and plenty of room for the
online trainer to make them better.

What it is: the byte-level BPE tokenizer of ``policy.models`` (Qwen2.5-Coder's
special and FIM tokens) and a Qwen2 of a couple of million parameters, trained
on FIM tasks from the train split of the standard library
(``trainer.proof.tasks.build_source_tasks``) — the same kind of cursor, inside a real
line, that simulated users and evaluation use, but never on a held-out file.

Training runs ``steps`` optimizer steps or ``minutes`` of wall clock,
whichever ends first, and its learning-rate schedule follows whichever is
further along, so it cools down before the end either way (see
``pretrain``). The marker file records the steps done and why it stopped:
a run that did all its steps (``stopped_by: "steps"``) is reproducible from
its seed; one the clock stopped (``"budget"``) depends on the machine's pace.
The result is cached: a directory whose marker records the same config is
reused, not rebuilt.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from policy.models import FIM_TOKENS, MODEL_MARKER, build_tokenizer, building_model_dir, write_model_marker
from trainer.proof.tasks import FimTask, build_source_tasks, source_files, split_of
from trainer.training_config import Pretraining

IGNORE_INDEX = -100


@dataclass(frozen=True)
class DemoConfig(Pretraining):
    """The demo model: its shape, and its pretraining (``Pretraining``, whose defaults are this model's)."""

    what = "demo model"

    vocab_size: int = 4096
    hidden_size: int = 192
    layers: int = 4
    heads: int = 6
    kv_heads: int = 2
    intermediate_size: int = 512
    max_files: int | None = None
    """Cut examples from at most this many train-split files (None: all)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("vocab_size", "hidden_size", "layers", "heads", "kv_heads", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"demo model {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of heads ({self.heads}), "
                             f"and heads of kv_heads ({self.kv_heads})")

    def identity(self) -> dict:
        """What decides the weights (the clock cap does not, unless it cut the run short)."""
        d = asdict(self)
        d.pop("minutes")
        return d


def demo_marker(out_dir: Path) -> dict | None:
    try:
        marker = json.loads((Path(out_dir) / MODEL_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("kind") == "demo" else None


def build_demo_model(out_dir: Path, config: DemoConfig = DemoConfig(), *, sources: Path | None = None,
                     progress: bool = True, log: Callable[[str], None] | None = None) -> tuple[Path, dict]:
    """Build (or reuse) the demo model in ``out_dir``; returns (out_dir, its marker).

    ``sources`` is a directory of Python files to learn from (default: the
    standard library's train split). A directory whose marker has the same
    config is returned as it is.
    """
    out_dir = Path(out_dir)
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    wanted = {**config.identity(), "sources": str(sources) if sources else "stdlib:train"}
    existing = demo_marker(out_dir)
    if existing is not None and existing.get("config") == wanted:
        return out_dir, existing

    started = time.monotonic()
    with building_model_dir(out_dir) as work:
        say(f"demo model: training a {config.vocab_size}-token BPE tokenizer on Python source")
        # Only train-split files, so not even the vocabulary has seen a held-out file.
        train_files = [p for rel, p in source_files(sources) if split_of(rel) == "train"]
        tokenizer = build_tokenizer(work, vocab_size=config.vocab_size, sources=train_files)
        # What it was trained on: longer prompts are out of its depth, so evaluation (and a front
        # door that honours it) trims them to this many tokens.
        tokenizer.model_max_length = config.seq_len
        tokenizer.save_pretrained(work)

        say("demo model: cutting FIM examples from the train split")
        examples = fim_examples(config, tokenizer, sources, max_files=config.max_files)

        model = new_model(config, tokenizer)
        say(f"demo model: pretraining {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on "
            f"{len(examples)} examples, {config.steps} steps or {config.minutes:g} min")
        history, stopped_by = pretrain(model, examples, config, pad_id=tokenizer.pad_token_id, progress=progress)

        model.eval()
        model.save_pretrained(work, safe_serialization=True)
        marker = {"kind": "demo", "seed": config.seed, "created_by": "tabloop model demo", "config": wanted,
                  **training_summary(history, stopped_by, len(examples), started)}
        write_model_marker(work, marker)
    say(f"demo model in {out_dir}: loss {marker['loss_first']} → {marker['loss_last']} after "
        f"{marker['steps_done']} steps ({marker['seconds']:.0f} s)")
    return out_dir, marker


def new_model(config: DemoConfig, tokenizer) -> Qwen2ForCausalLM:
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    qconfig = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.layers, num_attention_heads=config.heads, num_key_value_heads=config.kv_heads,
        max_position_embeddings=max(4096, config.seq_len), tie_word_embeddings=True,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=pad,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = Qwen2ForCausalLM(qconfig)
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    return model


def fim_sequence(prefix_ids: Sequence[int], suffix_ids: Sequence[int], middle_ids: Sequence[int], *,
                 special: dict[str, int], eos_id: int, seq_len: int) -> list[int]:
    """``<|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>M<|endoftext|>`` in at most ``seq_len`` tokens.

    What gives way, as at serving time: the top of the prefix first, then the
    far end of the suffix; the middle is cut last (and then loses its end).
    """
    middle = list(middle_ids)[:seq_len // 2] + [eos_id]
    room = seq_len - 3 - len(middle)
    suffix = list(suffix_ids)[:max(0, min(len(suffix_ids), room // 4))]
    room -= len(suffix)
    prefix = list(prefix_ids)[-room:] if room > 0 else []
    return ([special["prefix"], *prefix, special["suffix"], *suffix, special["middle"], *middle])[:seq_len]


def encode_examples(tasks: Sequence[FimTask], tokenizer, seq_len: int, *, seed: int = 0,
                    plain_share: float = 0.1) -> list[list[int]]:
    """Token id sequences for pretraining: FIM-formatted tasks, and some plain text, shuffled by ``seed``."""
    vocab = tokenizer.get_vocab()
    special = {k: vocab[FIM_TOKENS[k]] for k in ("prefix", "suffix", "middle")}  # the template, not <|fim_pad|>
    eos = tokenizer.eos_token_id
    rng = random.Random(seed)
    # Text is cut before tokenizing: a prefix needs at most ~4 characters per token of room.
    chars = seq_len * 6

    def enc(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    prefixes = enc([t.prefix[-chars:] for t in tasks])
    suffixes = enc([t.suffix[:chars // 2] for t in tasks])
    middles = enc([t.middle for t in tasks])
    out = []
    for p, s, m, t in zip(prefixes, suffixes, middles, tasks):
        if rng.random() < plain_share:
            out.append((enc([t.prefix[-chars:] + t.middle + t.suffix])[0])[:seq_len])
        else:
            out.append(fim_sequence(p, s, m, special=special, eos_id=eos, seq_len=seq_len))
    rng.shuffle(out)
    return out


def fim_examples(config: Pretraining, tokenizer, sources: Path | None = None, *,
                 max_files: int | None = None) -> list[list[int]]:
    """``config.per_file`` FIM tasks cut from each train-split file under ``sources`` (default: the standard
    library), the cursor inside a real line as in evaluation, encoded for ``pretrain`` (``encode_examples``).

    ValueError: no train-split file with code lines."""
    tasks = build_source_tasks(sources, split="train", per_file=config.per_file, seed=config.seed,
                               max_files=max_files, prefix_lines=30, suffix_lines=8)
    if not tasks:
        raise ValueError(f"no train-split Python files with code lines under {sources or 'the standard library'}")
    return encode_examples(tasks, tokenizer, config.seq_len, seed=config.seed, plain_share=config.plain_share)


def collate(batch: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels); padding is masked out of the loss."""
    width = max(len(x) for x in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, :len(x)] = torch.tensor(x, dtype=torch.long)
        mask[i, :len(x)] = 1
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    return ids, mask, labels


def training_progress(step: int, steps: int, elapsed_s: float, budget_s: float) -> float:
    """How far along the run is, 0…1: by steps, or by the clock when the clock runs out first.

    The learning-rate schedule follows it, so a run on a busy machine still
    cools down before its budget ends instead of being cut off at full
    strength. When the steps run out first (a machine fast enough), progress
    is a function of the step alone and the run is reproducible from its seed.
    """
    return max(step / steps, elapsed_s / budget_s if budget_s > 0 else 1.0)


COOLDOWN_SHARE = 0.2


def lr_at_progress(step: int, progress: float, *, base: float, warmup: int) -> float:
    """Warm-up, stable, decay: linear warm-up over the first ``warmup`` steps, ``base`` until the last
    ``COOLDOWN_SHARE`` of the run, then linearly down to a tenth of ``base`` at progress 1.

    A short run on a busy machine is far from converged: it learns most at full
    strength and needs only a short cool-down, not a cosine that spends half
    the run at a low rate.
    """
    if step < warmup:
        return base * (step + 1) / warmup
    p = min(1.0, max(0.0, progress))
    start = 1.0 - COOLDOWN_SHARE
    if p <= start:
        return base
    return base * (1.0 - 0.9 * (p - start) / COOLDOWN_SHARE)


def pretrain(model: torch.nn.Module, examples: Sequence[Sequence[int]], config: Pretraining, *, pad_id: int,
             progress: bool = True) -> tuple[list[float], str]:
    """Next-token training on ``examples``; returns (loss per step, "steps" | "budget").

    It runs ``config.steps`` steps or until ``config.minutes`` are up, with the
    schedule following ``training_progress``: "steps" runs are reproducible
    from the seed; "budget" runs depend on the machine's pace.
    """
    if not examples:
        raise ValueError("no examples to pretrain on")
    model.train()
    # Only what trains: a peft model (trainer.teach_fim) holds frozen base weights too.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                  betas=(0.9, 0.95), weight_decay=0.1)
    started = time.monotonic()
    budget_s = config.minutes * 60
    history: list[float] = []
    order = list(range(len(examples)))
    rng = random.Random(config.seed)
    cursor = len(order)
    stopped_by = "steps"
    bar = _Progress(config.steps, enabled=progress, budget_s=budget_s)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        for step in range(config.steps):
            elapsed = time.monotonic() - started
            if elapsed >= budget_s:
                stopped_by = "budget"
                break
            where = training_progress(step, config.steps, elapsed, budget_s)
            if cursor + config.batch_size > len(order):
                rng.shuffle(order)
                cursor = 0
            batch = [examples[i] for i in order[cursor:cursor + config.batch_size]]
            cursor += config.batch_size
            ids, mask, labels = collate(batch, pad_id)
            for group in optimizer.param_groups:
                group["lr"] = lr_at_progress(step, where, base=config.lr, warmup=config.warmup_steps)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            history.append(loss.item())
            bar.update(step + 1, f"loss {_mean(history[-20:]):.3f} ({100 * where:.0f}% of the run)")
    bar.close()
    model.eval()
    return history, stopped_by


def training_summary(history: Sequence[float], stopped_by: str, examples: int, started: float) -> dict:
    """What a model directory's marker says of the run that trained it (``pretrain``'s results)."""
    return {"steps_done": len(history), "stopped_by": stopped_by, "loss_first": round(_mean(history[:10]), 4),
            "loss_last": round(_mean(history[-10:]), 4), "examples": examples,
            "seconds": round(time.monotonic() - started, 1)}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


class _Progress:
    """A one-line progress bar on stderr (stdout stays for results)."""

    def __init__(self, total: int, enabled: bool = True, budget_s: float | None = None):
        self.total, self.enabled, self.budget_s = total, enabled, budget_s
        self.started = time.monotonic()
        self._last = 0.0

    def update(self, done: int, note: str = "") -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.5 and done < self.total):
            return
        self._last = now
        width = 30
        filled = int(width * done / max(1, self.total))
        elapsed = now - self.started
        eta = elapsed / done * (self.total - done) if done else 0
        if self.budget_s is not None:
            eta = min(eta, max(0.0, self.budget_s - elapsed))  # the clock may end the run first
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {note} "
                         f"{elapsed:.0f}s elapsed, ~{eta:.0f}s left ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
