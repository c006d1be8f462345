"""The ``--offline`` half of ``tabloop train``: its options and the command body (the loop is trainer/proof/offline.py).

``trainer/cli.py``'s ``train`` takes these options with one decorator
(``@offline_options``) and hands over with ``if offline_requested(...)``, so the
online command stays as it is.
"""

from __future__ import annotations

import functools
import json

import click

from infra.errors import TabloopError
from policy.weight_store import WeightStoreError
from rewards.judge import JudgeConfig
from trainer.proof.cli import DATASET_HELP, user_from_options
from trainer.proof.tasks import TaskFormatError

_OPTIONS = [
    click.argument("dataset", required=False),
    click.option("--offline", is_flag=True,
                 help=f"GRPO/RLOO on DATASET's tasks instead of PPO on tabloop.episodes. DATASET: {DATASET_HELP}."),
    click.option("--algo", type=click.Choice(["grpo", "rloo"]), default="grpo", show_default=True,
                 help="(offline) Group advantages: GRPO (mean/std of the group) or RLOO (leave-one-out mean)."),
    click.option("--group-size", type=click.IntRange(min=2), default=8, show_default=True,
                 help="(offline) Completions sampled per prompt (K)."),
    click.option("--scorer", type=click.Choice(["exact", "tests", "judge", "user"]), default="exact",
                 show_default=True,
                 help="(offline) Reward: exact match with a solution, the task's tests pass, the LLM judge's score/10, "
                      "or a simulated user's decision under the reward spec (+0.75 accepted, -0.25 rejected, "
                      "0 nothing shown: what the online trainer gets)."),
    click.option("--rule", type=click.Choice(["exact", "similarity", "tests"]), default="exact", show_default=True,
                 help="(offline, --scorer user) When the user accepts: the first line is the rest of the true line; "
                      "edit similarity at least --threshold; the task's tests pass."),
    click.option("--threshold", type=click.FloatRange(0, 1), default=0.8, show_default=True,
                 help="(offline, --scorer user --rule similarity)"),
    click.option("--prompts-per-update", type=click.IntRange(min=1), default=4, show_default=True,
                 help="(offline) Prompts per policy update; an update trains on up to prompts × K samples."),
    click.option("--updates", type=click.IntRange(min=1), default=None,
                 help="(offline) Policy updates (default: one pass over the dataset)."),
    click.option("--save-every", type=click.IntRange(min=1), default=None,
                 help="(offline) Updates per weight version (default: one version at the end)."),
    click.option("--max-new-tokens", type=click.IntRange(min=1), default=48, show_default=True),
    click.option("--temperature", type=click.FloatRange(min=0, min_open=True, max=2), default=1.0, show_default=True,
                 help="(offline) Sampling temperature; 1 samples from the policy being trained."),
    click.option("--limit", type=click.IntRange(min=1), default=None, help="(offline) Use at most this many tasks."),
    click.option("--seed", type=int, default=0, show_default=True, help="(offline) Task order and sampling seed."),
    click.option("--eval-dataset", default=None,
                 help="(offline) Held-out tasks evaluated (greedy, with --scorer) before and after training."),
    click.option("--eval-limit", type=click.IntRange(min=1), default=None),
    click.option("--publish/--no-publish", default=None,
                 help="(offline) Announce versions on tabloop.weights (default: when a broker answers)."),
    click.option("--promote", is_flag=True, help="(offline) Publish versions as PROMOTED (default CANDIDATE)."),
    click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="(offline) Learning rate (default: TABLOOP_TRAINER_LR)."),
    click.option("--full/--lora", default=None,
                 help="(offline) Full fine-tuning or LoRA (default: TABLOOP_TRAINER_FULL_FINETUNE)."),
    click.option("--judge-url", default=None, help="(offline) Judge base URL (default: TABLOOP_JUDGE_API_URL)."),
    click.option("--judge-model", default=None, help="(offline) Judge model (default: TABLOOP_JUDGE_MODEL)."),
    click.option("--judge-api-key", envvar="JUDGE_API_KEY", default=None, show_envvar=True,
                 help="(offline) Default: TABLOOP_JUDGE_API_KEY."),
]

OFFLINE_PARAMS = ("dataset", "offline", "algo", "group_size", "scorer", "rule", "threshold", "prompts_per_update",
                  "updates", "save_every", "max_new_tokens", "temperature", "limit", "seed", "eval_dataset",
                  "eval_limit", "publish", "promote", "lr", "full", "judge_url", "judge_model", "judge_api_key")


def offline_options(command):
    """Add the offline options (and the optional DATASET argument) to a click command."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def offline_requested(ctx: click.Context, params: dict) -> bool:
    """True with --offline; an offline-only option or DATASET without it is a usage error, not silently ignored."""
    if params.get("offline"):
        return True
    given = [name for name in OFFLINE_PARAMS
             if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
    if given:
        shown = ["DATASET" if n == "dataset" else "--" + n.replace("_", "-") for n in given]
        raise click.UsageError(f"{', '.join(shown)} only apply with --offline")
    return False


def train_offline(ctx: click.Context, *, max_versions: int | None, **params) -> None:
    """``tabloop train --offline …``: progress on stderr, the run's summary as the last stdout line (JSON)."""
    # Lazy: the model code loads torch (seconds); trainer/cli.py imports this module for `train`'s options, and
    # `tabloop weights list` and `tabloop gates` beside it must not pay for it.
    from policy.models import ModelLoadError
    from trainer.proof.offline import OfflineConfig, OfflineRun, run_offline

    settings = ctx.find_root().obj
    if not params["dataset"]:
        raise click.UsageError("train --offline needs a DATASET: " + DATASET_HELP)
    if max_versions is not None:
        raise click.UsageError("--max-versions is for continuous training; an offline run stops after --updates")
    judge_config = None
    if params["scorer"] == "judge":
        url = params["judge_url"] or settings.judge_api_url
        model = params["judge_model"] or settings.judge_model
        if not url or not model:
            raise TabloopError("--scorer judge needs --judge-url and --judge-model (or TABLOOP_JUDGE_API_URL and "
                               "TABLOOP_JUDGE_MODEL) and a key (JUDGE_API_KEY or TABLOOP_JUDGE_API_KEY)")
        try:
            judge_config = JudgeConfig(api_url=url, api_key=params["judge_api_key"] or settings.judge_api_key,
                                       model=model, timeout_s=settings.judge_timeout_s,
                                       max_concurrency=settings.judge_max_concurrency)
        except ValueError as exc:
            raise TabloopError(str(exc)) from None
    user_model = user_from_options(ctx, params["scorer"], params["rule"], params["threshold"])
    try:
        config = OfflineConfig(algo=params["algo"], group_size=params["group_size"],
                               prompts_per_update=params["prompts_per_update"],
                               max_new_tokens=params["max_new_tokens"], temperature=params["temperature"],
                               max_prompt_tokens=settings.max_prompt_tokens)
        run = OfflineRun(dataset=params["dataset"], scorer=params["scorer"], config=config, updates=params["updates"],
                         save_every=params["save_every"], seed=params["seed"], limit=params["limit"],
                         eval_dataset=params["eval_dataset"], eval_limit=params["eval_limit"],
                         eval_max_new_tokens=params["max_new_tokens"], publish=params["publish"],
                         promote=params["promote"], judge_config=judge_config, user_model=user_model,
                         lr=params["lr"], full=params["full"])
        summary = run_offline(settings, run, log=functools.partial(click.echo, err=True))
    except (TaskFormatError, FileNotFoundError, ModelLoadError, WeightStoreError, ValueError) as exc:
        raise TabloopError(str(exc)) from None
    click.echo(json.dumps(summary))
