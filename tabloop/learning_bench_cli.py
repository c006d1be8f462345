"""`tabloop bench teams|gate-replay`: offline learning benches on the policy (torch at the top: only these pay it)."""

from __future__ import annotations

from pathlib import Path

import click

from infra.errors import TabloopError
from infra.settings import settings_of
from policy.models import use_torch_threads
from tabloop.bench import _emit
from tabloop.loop_bench import resolve_model
from trainer.build_models import build_named_model
from trainer.proof.gate_replay import RULES, run_gate_replay, write_result
from trainer.proof.teams import TeamsConfig, run_teams_bench



@click.command("teams")
@click.option("--model", default=None,
              help="demo, smollm2, a model directory or a hub id (default: TABLOOP_MODEL).")
@click.option("--updates", type=click.IntRange(min=1), default=16, show_default=True,
              help="RLOO updates of each policy (the shared one and each team's).")
@click.option("--prompts-per-update", type=click.IntRange(min=2), default=4, show_default=True)
@click.option("--group-size", type=click.IntRange(min=2), default=6, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Sampling temperature of the training samples (the held-out completions are greedy).")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=5e-4, show_default=True)
@click.option("--lora-rank", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--threshold", type=click.FloatRange(0, 1), default=0.3, show_default=True,
              help="A team's user takes a suggestion this close to its line (and in its quotes).")
@click.option("--train-limit", type=click.IntRange(min=1), default=None, help="At most this many train tasks.")
@click.option("--heldout", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--ignored-reward", type=click.FloatRange(-0.25, 0.75), default=0.0, show_default=True,
              help="Reward of showing nothing (rejected -0.25, accepted 0.75).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench-teams", show_default=True)
@click.pass_context
def bench_teams(ctx: click.Context, model: str | None, updates: int, prompts_per_update: int, group_size: int,
                max_new_tokens: int, temperature: float, lr: float, lora_rank: int, threshold: float,
                train_limit: int | None, heldout: int, ignored_reward: float, seed: int, out_dir: str) -> None:
    """Two simulated teams with different quoting conventions: each team's held-out accept rate under a shared
    policy and under its own (trainer/proof/teams.py)."""
    settings = settings_of(ctx)
    use_torch_threads(settings.torch_threads)
    try:
        config = TeamsConfig(updates=updates, prompts_per_update=prompts_per_update, group_size=group_size,
                             max_new_tokens=max_new_tokens, temperature=temperature, lr=lr, lora_rank=lora_rank,
                             threshold=threshold, train_limit=train_limit, heldout=heldout,
                             max_prompt_tokens=settings.max_prompt_tokens,
                             seed=seed, ignored_reward=ignored_reward)
    except ValueError as exc:
        raise TabloopError(str(exc)) from None
    model_spec = resolve_model(settings, model) if model else build_named_model(settings)
    result = run_teams_bench(model_spec, config, Path(out_dir))
    _emit({k: result[k] for k in ("bench", "model", "train_tasks", "heldout_tasks", "comparison", "wall_s")})


@click.command("gate-replay")
@click.option("--model", default=None, help="demo, smollm2, a model directory or a hub id (default: TABLOOP_MODEL).")
@click.option("--traffic", type=click.IntRange(min=1), default=800, show_default=True,
              help="Train tasks whose draws arrive as the users' traffic the learner fits on.")
@click.option("--judging", type=click.IntRange(min=1), default=400, show_default=True,
              help="Other train tasks the promoted gates are judged on.")
@click.option("--draws", type=click.IntRange(min=1), default=2, show_default=True, help="Draws per judging task.")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=0.7, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--rule", type=click.Choice(["exact", "similarity"]), default="similarity", show_default=True)
@click.option("--threshold", type=click.FloatRange(0, 1), default=0.5, show_default=True)
@click.option("--keep", "keeps", type=(click.Choice(["expected", "realised"]), click.FloatRange(0, 1, min_open=True)),
              multiple=True, help="A threshold rule to replay, e.g. --keep expected 0.99 (repeatable; default: "
              "expected 0.95, the default, and realised 0.99).")
@click.option("--min-decided", "min_decided", type=click.IntRange(min=10), multiple=True,
              help="Decided lines before the first fit, each rule replayed at each (repeatable; default: "
              "TABLOOP_GATE_MIN_DECIDED).")
@click.option("--orders", type=click.IntRange(min=1), default=1, show_default=True,
              help="Arrival orders of the same traffic replayed (the sampled one and seeded shuffles): how much "
              "of when the first gate comes, and what it hides, is which lines came first.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench-gate-replay", show_default=True)
@click.pass_context
def bench_gate_replay(ctx: click.Context, model: str | None, traffic: int, judging: int, draws: int,
                      temperature: float, max_tokens: int, rule: str, threshold: float,
                      keeps: tuple[tuple[str, float], ...], min_decided: tuple[int, ...], orders: int, seed: int,
                      out_dir: str) -> None:
    """The show-gate's learner replayed on draws of train tasks under each threshold rule, its promoted gates
    judged on other train tasks (trainer/proof/gate_replay.py): where the gate's rule is chosen."""
    settings = settings_of(ctx)
    use_torch_threads(settings.torch_threads)
    model_spec = resolve_model(settings, model) if model else build_named_model(settings)
    try:
        result = run_gate_replay(settings, model_spec, traffic=traffic, judging=judging, draws=draws,
                                 temperature=temperature, max_tokens=max_tokens, rule=rule, threshold=threshold,
                                 rules=keeps or RULES, min_decided=min_decided, orders=orders, seed=seed,
                                 say=lambda m: click.echo(m, err=True))
    except ValueError as exc:
        raise TabloopError(str(exc)) from None
    write_result(result, Path(out_dir))
    _emit({"bench": "gate-replay", "always_show": result["always_show"],
           "rules": [{k: r[k] for k in ("kept_by", "keep", "min_decided", "promoted")} | {"fits": len(r["fits"])}
                     | {"last": r["gates"][-1] if r["gates"] else None} for r in result["rules"]],
           "wall_s": result["wall_s"]})
