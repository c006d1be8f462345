"""CLI commands of the proof of learning: `tabloop tasks`, `tabloop simulate`, `tabloop eval`.

Registered in ``tabloop/cli.py`` with one ``main.add_command`` line each.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from infra.auth import KeyStore
from infra.errors import TabloopError
from infra.settings import settings_of
from rewards.judge import JudgeConfig
from trainer.metrics import markdown_table
from trainer.proof.simulate import SimConfig, UserModel, calls_jsonl, records_jsonl, summary_rate
from trainer.proof.simulate import simulate as run_simulation
from trainer.proof.tasks import TaskFormatError, resolve_dataset, save_tasks

DATASET_HELP = ("humaneval (humaneval:train: problems 0-99; humaneval:heldout: the rest), stdlib:train, "
                "stdlib:heldout, source:DIR[:split], or a JSONL file "
                "(the recipe's {prompt, solutions} or {prefix, suffix, middle})")



def _error(message: str) -> click.ClickException:
    return TabloopError(message)


def _tasks(spec: str, *, seed: int = 0, limit: int | None = None):
    try:
        return resolve_dataset(spec, seed=seed, limit=limit)
    except (TaskFormatError, FileNotFoundError, ValueError) as exc:
        raise _error(str(exc)) from None


# -- tasks ------------------------------------------------------------------------------------


@click.group()
def tasks() -> None:
    """FIM task sets: HumanEval infilling, the standard library's train and held-out splits, JSONL files."""


@tasks.command("build")
@click.argument("dataset")
@click.option("--out", "out_file", required=True, type=click.Path(dir_okay=False), help="JSONL file to write.")
@click.option("--limit", type=click.IntRange(min=1), default=None)
@click.option("--seed", type=int, default=0, show_default=True)
def tasks_build(dataset: str, out_file: str, limit: int | None, seed: int) -> None:
    """Write DATASET's tasks as prefix/suffix/middle JSONL."""
    n = save_tasks(_tasks(dataset, seed=seed, limit=limit), out_file)
    click.echo(json.dumps({"dataset": dataset, "tasks": n, "out": out_file}))


tasks_build.help = f"Write DATASET's tasks as prefix/suffix/middle JSONL. DATASET: {DATASET_HELP}."


# -- simulate ------------------------------------------------------------------------------------


@click.command()
@click.argument("dataset", default="stdlib:train")
@click.option("--users", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--requests", "n_requests", type=click.IntRange(min=1), default=200, show_default=True,
              help="Completed requests over all users (abandoned ones come on top).")
@click.option("--duration", "duration_s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop after this many seconds (and at --requests, whichever is first).")
@click.option("--rule", type=click.Choice(["exact", "similarity", "tests"]), default="exact", show_default=True,
              help="When a user accepts: the first line is the rest of the true line; edit similarity above "
                   "--threshold; the task's tests pass.")
@click.option("--threshold", type=click.FloatRange(0, 1), default=0.8, show_default=True)
@click.option("--routes", default="fork,data,api", show_default=True,
              help="Feedback routes, assigned to users in turn: fork (/api/training/submit), data (stock "
                   "Continue's data: events), api (/v1/feedback).")
@click.option("--context-share", type=click.FloatRange(0, 1), default=0.3, show_default=True,
              help="Share of prompts with repo/file context.")
@click.option("--abandon-share", type=click.FloatRange(0, 1), default=0.15, show_default=True,
              help="Share of requests preceded by one the user typed past.")
@click.option("--debounce-ms", type=click.IntRange(min=0), default=150, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--temperature", type=click.FloatRange(0, 2), default=0.01, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--completions-url", default=None, help="Default: the configured front door's completions port.")
@click.option("--feedback-url", default=None, help="Default: the configured front door's feedback port.")
@click.option("--api-key", "api_keys", multiple=True,
              help="API key(s), cycled over users. Default: one new key per user in this state dir's key store "
                   "(project --project), or none when TABLOOP_AUTH=open.")
@click.option("--project", default="sim", show_default=True)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Use at most this many tasks.")
@click.option("--records", "records_file", type=click.Path(dir_okay=False), default=None,
              help="Write one JSON line per request here.")
@click.option("--calls", "calls_file", type=click.Path(dir_okay=False), default=None,
              help="Write one JSON line per HTTP call here (kind, start/end time, status), abandoned and "
                   "feedback calls included.")
@click.pass_context
def simulate(ctx: click.Context, dataset: str, users: int, n_requests: int, duration_s: float | None, rule: str,
             threshold: float, routes: str, context_share: float, abandon_share: float, debounce_ms: int,
             max_tokens: int, temperature: float, seed: int, completions_url: str | None,
             feedback_url: str | None, api_keys: tuple[str, ...], project: str, limit: int | None,
             records_file: str | None, calls_file: str | None) -> None:
    """Many simulated Continue users against the front door; last line: a JSON summary.

    DATASET (default stdlib:train): """
    s = settings_of(ctx)
    task_list = _tasks(dataset, seed=seed, limit=limit)
    keys = list(api_keys)
    if not keys and s.auth == "keys":
        store = KeyStore(s.keys_file)
        keys = [store.add(project, f"sim-{i}") for i in range(users)]
        click.echo(f"simulate: made {users} API keys for project {project!r} in {s.keys_file}", err=True)
    try:
        config = SimConfig(
            completions_url=completions_url or f"http://{s.serve_host}:{s.completions_port}",
            feedback_url=feedback_url or f"http://{s.serve_host}:{s.feedback_port}",
            users=users, requests=n_requests, duration_s=duration_s, rule=rule, threshold=threshold,
            routes=tuple(r.strip() for r in routes.split(",") if r.strip()), context_share=context_share,
            abandon_share=abandon_share, debounce_s=debounce_ms / 1000, max_tokens=max_tokens,
            temperature=temperature, seed=seed, api_keys=keys, project=project)
        report = run_simulation(task_list, config)
    except ValueError as exc:
        raise _error(str(exc)) from None
    summary = report.summary()
    summary["by_version"] = {str(v): part for v, part in report.by_version().items()}
    if records_file:
        Path(records_file).write_text(records_jsonl(report))
    if calls_file:
        Path(calls_file).write_text(calls_jsonl(report))
    click.echo(summary_rate(summary), err=True)
    click.echo(json.dumps(summary))


simulate.help = (simulate.help or "") + DATASET_HELP + "."


def user_from_options(ctx: click.Context, scorer: str, rule: str, threshold: float):
    """The simulated user of ``--rule``/``--threshold``; a usage error when they are given without
    ``--scorer user``, which alone reads them (``tabloop eval``, ``tabloop train --offline``)."""
    given = [n for n in ("rule", "threshold") if ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE]
    if given and scorer != "user":
        raise click.UsageError("--rule and --threshold only apply with --scorer user")
    return UserModel(rule, threshold)


# -- eval ----------------------------------------------------------------------------------------------


@click.command("eval")
@click.argument("dataset")
@click.option("--scorer", type=click.Choice(["exact", "tests", "judge", "user"]), default="exact", show_default=True,
              help="user: also what a simulated user makes of the suggestions (accept rate among shown, share "
                   "shown, accepted characters per request, mean reward), per --rule and --threshold.")
@click.option("--rule", type=click.Choice(["exact", "similarity", "tests"]), default="exact", show_default=True,
              help="(--scorer user) When the user accepts: the first line is the rest of the true line; edit "
                   "similarity at least --threshold; the task's tests pass.")
@click.option("--threshold", type=click.FloatRange(0, 1), default=0.8, show_default=True)
@click.option("--policy", default=None,
              help="A policy version on tabloop.weights, or a weights directory (default: the base model).")
@click.option("--model", "model_spec", default=None, help="Base model (default: TABLOOP_MODEL).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Evaluate at most this many tasks.")
@click.option("--samples", type=click.IntRange(min=1), default=1, show_default=True,
              help="Completions per task (pass@1 is their mean pass rate).")
@click.option("--temperature", type=click.FloatRange(0, 2), default=0.0, show_default=True,
              help="0: greedy, as Continue's default 0.01 nearly is.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-prompt-tokens", type=click.IntRange(min=16), default=None,
              help="Prompt budget (default: TABLOOP_MAX_PROMPT_TOKENS, at most the tokenizer's length).")
@click.option("--context/--no-context", default=False, help="Prompts with repo/file context where tasks have it.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--judge-url", default=None,
              help="OpenAI-compatible base URL of the judge (default: TABLOOP_JUDGE_API_URL / LLMASJUDGE_API_URL).")
@click.option("--judge-model", default=None, help="Default: TABLOOP_JUDGE_MODEL / LLMASJUDGE_MODEL.")
@click.option("--out", "out_file", type=click.Path(dir_okay=False), default=None,
              help="Also write the summary and every scored completion here (JSON).")
@click.pass_context
def eval_command(ctx: click.Context, dataset: str, scorer: str, rule: str, threshold: float, policy: str | None,
                 model_spec: str | None, limit: int | None, samples: int, temperature: float, max_new_tokens: int,
                 batch_size: int, max_prompt_tokens: int | None, context: bool, seed: int, judge_url: str | None,
                 judge_model: str | None, out_file: str | None) -> None:
    """Score a policy's completions of DATASET: exact match, line match, edit similarity, pass@1 (tests),
    judge score, share of empty suggestions; with --scorer user, a simulated user's accept rate among shown
    suggestions, share shown, accepted characters per request and mean reward. Prints a markdown table, then
    the JSON summary as the last line."""
    # Lazy: the model code loads torch (seconds), which `tabloop simulate` and `tabloop tasks` here must not pay.
    from policy.models import ModelLoadError
    from trainer.proof.evaluate import evaluate, load_policy, scorer_reward_spec

    s = settings_of(ctx)
    judge_config = None
    user_model = user_from_options(ctx, scorer, rule, threshold)
    try:
        reward_spec = scorer_reward_spec(s, scorer)
    except ValueError as exc:
        raise _error(str(exc)) from None
    if scorer == "judge":
        judge_url, judge_model = judge_url or s.judge_api_url, judge_model or s.judge_model
        if not judge_url or not judge_model:
            raise _error("--scorer judge needs a judge: --judge-url and --judge-model, or TABLOOP_JUDGE_API_URL "
                         "and TABLOOP_JUDGE_MODEL (the key in TABLOOP_JUDGE_API_KEY)")
        try:
            judge_config = JudgeConfig(api_url=judge_url, api_key=s.judge_api_key, model=judge_model,
                                       timeout_s=s.judge_timeout_s, max_concurrency=s.judge_max_concurrency)
        except ValueError as exc:
            raise _error(str(exc)) from None
    task_list = _tasks(dataset, seed=seed, limit=limit)
    try:
        model, tokenizer, label = load_policy(s, policy, model_spec=model_spec)
        summary, scored = evaluate(model, tokenizer, task_list, scorer=scorer, samples=samples,
                                   judge_config=judge_config, user_model=user_model, reward_spec=reward_spec,
                                   temperature=temperature, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                   max_prompt_tokens=max_prompt_tokens or s.max_prompt_tokens,
                                   with_context=context, seed=seed)
    except (ModelLoadError, ValueError) as exc:
        raise _error(str(exc)) from None
    result = {"dataset": dataset, "scorer": scorer, "policy": policy or "base", "label": label, **summary}
    if out_file:
        Path(out_file).write_text(json.dumps({**result, "completions": [asdict(x) for x in scored]}, indent=1))
    click.echo(markdown_table([(f"{dataset} · {label}", summary)]))
    click.echo(json.dumps(result))
