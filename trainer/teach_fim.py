"""`tabloop model teach-fim`: teach a model without FIM tokens Qwen's fill-in-the-middle template, once.

SmolLM2 has no FIM tokens, so by default the front door shows it only the prefix (``policy.fim``: the
"prefix" prompt format) and the code after the cursor is lost to it. This adds Qwen's three FIM tokens to
the tokenizer (new embedding rows start at the mean of the old ones), fine-tunes LoRA adapters and those
three rows on FIM examples cut from the standard library's train split (``trainer.proof.tasks``, the same
cursors as evaluation, never a held-out file; a share of plain left-to-right examples so plain prompts
still work), merges the adapters and writes a model directory. The directory's tokenizer has Qwen's FIM
tokens, so ``policy.fim.prompt_format`` gives it Qwen's template everywhere — front door, evaluation,
training — with no setting to change: point ``TABLOOP_MODEL`` at it.

The training loop is the demo model's (``trainer.proof.demo_model.pretrain``: steps or a wall-clock cap,
whichever ends first, with a warm-up, stable, cool-down schedule that follows the further of the two).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from policy.fim import prompt_format
from policy.models import FIM_TOKENS, building_model_dir, load_model, lora_target_modules, write_model_marker
from trainer.proof.demo_model import fim_examples, pretrain, training_summary
from trainer.training_config import LoraTraining, Pretraining

TAUGHT_TOKENS = (FIM_TOKENS["prefix"], FIM_TOKENS["suffix"], FIM_TOKENS["middle"])


@dataclass(frozen=True)
class TeachFimConfig(Pretraining, LoraTraining):
    """The fine-tune: LoRA adapters (``LoraTraining``) and the three new token rows, on the demo model's
    pretraining schedule and examples (``Pretraining``) with a fine-tune's defaults."""

    what = "teach-fim"
    MIN_SEQ_LEN = 64

    steps: int = 150
    minutes: float = 20.0
    batch_size: int = 8
    lr: float = 5e-4
    warmup_steps: int = 10
    lora_rank: int = 16
    seq_len: int = 384
    per_file: int = 4


def teach_fim(base_dir: Path, out_dir: Path, config: TeachFimConfig = TeachFimConfig(), *,
              sources: Path | None = None, progress: bool = True,
              log: Callable[[str], None] | None = None) -> tuple[Path, dict]:
    """Write ``base_dir`` taught Qwen's FIM template to ``out_dir``; returns (out_dir, its marker).

    ValueError: the base model already has FIM tokens (it needs no teaching), or no train-split file."""
    from peft import LoraConfig, get_peft_model  # lazy: `tabloop model demo` and `tiny` beside it need no peft

    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    started = time.monotonic()
    out_dir = Path(out_dir)
    model, tokenizer = load_model(str(base_dir), dtype="float32")
    if prompt_format(tokenizer).kind != "prefix":
        raise ValueError(f"{base_dir} already has FIM tokens ({prompt_format(tokenizer).kind}'s template): "
                         "there is nothing to teach")
    vocab_before = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(TAUGHT_TOKENS)})
    model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    new_ids = tokenizer.convert_tokens_to_ids(list(TAUGHT_TOKENS))
    embeddings = model.get_input_embeddings()
    embedding_name = next(name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is embeddings)

    say("teach-fim: cutting FIM examples from the standard library's train split")
    examples = fim_examples(config, tokenizer, sources)

    peft_model = get_peft_model(model, LoraConfig(
        r=config.lora_rank, lora_alpha=2 * config.lora_rank, target_modules=lora_target_modules(model),
        trainable_token_indices={embedding_name: new_ids}))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    say(f"teach-fim: LoRA rank {config.lora_rank} and the {len(new_ids)} new token rows ({trainable / 1e6:.1f}M "
        f"trainable) on {len(examples)} examples, {config.steps} steps or {config.minutes:g} min")
    history, stopped_by = pretrain(peft_model, examples, config, pad_id=_pad_id(tokenizer), progress=progress)
    merged = peft_model.merge_and_unload()
    with building_model_dir(out_dir) as work:
        merged.save_pretrained(work, safe_serialization=True)
        tokenizer.save_pretrained(work)
        marker = {"kind": "fim-taught", "base": str(base_dir), "created_by": "tabloop model teach-fim",
                  "config": asdict(config), "vocab": [vocab_before, len(tokenizer)],
                  "tokens": dict(zip(TAUGHT_TOKENS, new_ids)),
                  **training_summary(history, stopped_by, len(examples), started)}
        write_model_marker(work, marker)
    say(f"teach-fim: {out_dir}: loss {marker['loss_first']} -> {marker['loss_last']} after {marker['steps_done']} "
        f"steps ({marker['seconds']:.0f} s, stopped by {stopped_by})")
    return out_dir, marker


def _pad_id(tokenizer) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)

