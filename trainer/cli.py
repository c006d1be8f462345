"""The trainer's commands: `tabloop train`, `tabloop weights list|promote|rollback|evaluate`,
`tabloop gates list|rollback`, `tabloop bench trainer`.

Registered in tabloop/cli.py's ``COMMANDS`` / ``BENCHES``, one line each.
"""

from __future__ import annotations

import json
import signal
from datetime import datetime, timedelta, timezone

import click

from infra.bus import EventProducer, broker_answers, ensure_topics, read_topic
from infra.settings import settings_of
from infra.stall_guard import StallGuard
from policy.show_gate import latest_statuses, serving_gate_record
from policy.weight_store import (WeightStore, WeightStoreError, base_version_event, fold_statuses,
                                 promoted_version, read_weight_records, version_event)
from rewards.spec import RewardSpecs
from schemas.topics import EPISODES, GATES
from trainer.proof.offline_cli import offline_options, offline_requested, train_offline
from trainer.show_gate_learner import restated



def _error(message: str) -> click.ClickException:
    return click.ClickException(message)


@click.command()
@click.option("--topic", default="tabloop.episodes", show_default=True,
              help="Episode topic to train on (e.g. a replayed copy).")
@click.option("--max-versions", type=click.IntRange(min=1), default=None,
              help="Stop after publishing this many new versions (default: never stop).")
@offline_options
@click.pass_context
def train(ctx: click.Context, topic: str, max_versions: int | None, **offline) -> None:
    """Continuous PPO on tabloop.episodes; publishes weight versions to the weight store and tabloop.weights.

    With --offline: GRPO/RLOO on DATASET's tasks (trainer/proof/offline.py)."""
    if offline_requested(ctx, offline):
        return train_offline(ctx, max_versions=max_versions, **offline)
    # Lazy here and below: the model code imports torch (seconds), which `weights list` and `gates` must not pay.
    from policy.models import ModelLoadError
    from trainer.online import OnlineTrainer

    settings = settings_of(ctx)
    if not broker_answers(settings):
        raise _error(f"no Kafka answers on {settings.kafka_bootstrap}: run `tabloop kafka start` first")
    try:
        trainer = OnlineTrainer(settings, topic=topic)
    except ModelLoadError as exc:
        raise _error(str(exc)) from None
    signal.signal(signal.SIGTERM, lambda *_: trainer.stop())
    trainer.guard = StallGuard("tabloop train", settings.stall_limit_s).start()
    click.echo(f"tabloop train: {trainer.base_model} on {trainer.device}, from version {trainer.version}; "
               f"weights in {settings.effective_weight_store}, logs in {settings.trainer_dir}")
    try:
        trainer.run(max_versions=max_versions)
    except KeyboardInterrupt:
        pass
    finally:
        trainer.close()


# -- weights ------------------------------------------------------------------------


@click.group()
def weights() -> None:
    """Weight versions: list them, promote one, roll back. Serving follows the promoted version."""


def _store_and_records(settings):
    from trainer.build_models import build_named_model  # lazy: torch, only for a named model's directory

    base = build_named_model(settings)
    return base, WeightStore(settings.effective_weight_store, base), read_weight_records(settings)


def _publish(settings, *events) -> None:
    ensure_topics(settings)
    with EventProducer(settings, client_id="tabloop-weights-cli") as producer:
        for event in events:
            producer.publish(event)


@weights.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per version.")
@click.pass_context
def weights_list(ctx: click.Context, as_json: bool) -> None:
    """Every version in the weight store with its status on tabloop.weights; * marks the ones serving follows
    (the shared policy's, and each project's own)."""
    settings = settings_of(ctx)
    base, store, records = _store_and_records(settings)
    statuses = fold_statuses(records, base)
    manifests = store.manifests()
    serving = {p: promoted_version(records, base, p) for p in {"", *(m.project_id for m in manifests)}}
    rows = [{"version": 0, "project": "", "status": "PROMOTED" if serving[""] == 0 else "BASE", "kind": "-",
             "parent": None, "episodes": 0, "created": "-", "uri": base, "serving": serving[""] == 0}]
    for m in manifests:
        s = statuses.get(m.version)
        rows.append({"version": m.version, "project": m.project_id, "status": s.status if s else "UNPUBLISHED",
                     "kind": m.kind, "parent": m.parent_version, "episodes": m.episodes_consumed,
                     "created": datetime.fromtimestamp(m.created_at_ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
                     "uri": m.uri, "serving": m.version == serving[m.project_id],
                     "reward_mean": round(m.metrics.get("reward_mean", float("nan")), 4)})
    echo_rows(rows, WEIGHT_COLUMNS, as_json)


Column = tuple[str, str, str, str]
"""(header, the row's key, its format spec, the separator before it) of a table ``echo_rows`` prints."""
WEIGHT_COLUMNS: tuple[Column, ...] = (
    ("version", "version", ">7", " "), ("project", "project", "<", " "), ("status", "status", "<12", " "),
    ("kind", "kind", "<5", " "), ("parent", "parent", ">6", " "), ("episodes", "episodes", ">8", " "),
    ("created", "created", "<19", "  "), ("uri", "uri", "", "  "))
GATE_COLUMNS: tuple[Column, ...] = (
    ("version", "version", ">7", " "), ("project", "project", "<", " "), ("status", "status", "<11", " "),
    ("policy", "policy_version", ">6", " "), ("thresh", "threshold", ">6.3f", " "), ("lines", "episodes", ">5", " "),
    ("auc", "auc", ">5", " "), ("keep", "keep_chars", ">5", " "), ("shown", "shown_share", ">5", " "),
    ("accept", "accept_rate_shown", ">6", " "), ("created", "created", "<19", "  "), ("reason", "reason", "", "  "))


def echo_rows(rows: list[dict], columns: tuple[Column, ...], as_json: bool) -> None:
    """The rows as JSON lines, or as a table: ``*`` before the row serving follows, the project column as wide
    as its longest name ("(shared)" for the shared policy), a missing value blank."""
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    width = max([8] + [len(r["project"]) for r in rows])

    def spec(fmt: str) -> str:
        return f"<{width}" if fmt == "<" else fmt

    click.echo("  " + "".join(f"{sep if i else ''}{head:{spec(fmt).split('.')[0]}}"  # a header has no precision
                              for i, (head, _, fmt, sep) in enumerate(columns)))
    for r in rows:
        cells = [(r["project"] or "(shared)") if key == "project" else ("" if r[key] is None else r[key])
                 for _, key, _, _ in columns]
        click.echo(("*" if r["serving"] else " ") + " " + "".join(
            f"{sep if i else ''}{cell:{spec(fmt)}}" for i, (cell, (_, _, fmt, sep)) in enumerate(zip(cells, columns))))


def _whose(project: str) -> str:
    return f"project {project}" if project else "the shared policy"


@weights.command("promote")
@click.argument("version", type=click.IntRange(min=0))
@click.pass_context
def weights_promote(ctx: click.Context, version: int) -> None:
    """Promote VERSION: every serving replica loads it (0 = the base model) for the project it was trained for
    (the shared policy's versions: for every project without a version of its own)."""
    settings = settings_of(ctx)
    base, store, _ = _store_and_records(settings)
    try:
        event = base_version_event(base) if version == 0 else version_event(store.manifest(version), "PROMOTED")
    except WeightStoreError as exc:
        raise _error(str(exc)) from None
    _publish(settings, event)
    click.echo(f"version {version} of {base} promoted for {_whose(event.record['project_id'])}")


def rollback_target(records: list[dict], base_model: str, current: int, project: str = "") -> int:
    """Pure: the version a rollback of ``current`` returns to.

    The most recent version of the same project ("" the shared policy) promoted before ``current`` that has
    not been rolled back since; 0 if there is none (the base model, or for a project the shared policy).
    """
    rolled_back: set[int] = set()
    history: list[int] = []
    for r in records:
        if r["base_model"] != base_model or (r.get("project_id") or "") != project:
            continue
        if r["status"] == "PROMOTED":
            history.append(r["version"])
            rolled_back.discard(r["version"])
        elif r["status"] == "ROLLED_BACK":
            rolled_back.add(r["version"])
    for v in reversed(history):
        if v != current and v not in rolled_back:
            return v
    return 0


@weights.command("rollback")
@click.argument("version", type=click.IntRange(min=0), required=False)
@click.option("--project", default="", help="Roll back this project's own version (default: the shared policy's); "
              "with nothing of its own before it, the project goes back to the shared policy.")
@click.pass_context
def weights_rollback(ctx: click.Context, version: int | None, project: str) -> None:
    """Roll back the promoted version; serving goes to VERSION (default: the one promoted before it, else 0)."""
    settings = settings_of(ctx)
    base, store, records = _store_and_records(settings)
    current = promoted_version(records, base, project)
    if current == 0:
        serving = "the base model (version 0)" if not project else "the shared policy (no version of its own)"
        raise _error(f"nothing to roll back: {_whose(project)} of {base} is serving {serving}")
    target = rollback_target(records, base, current, project) if version is None else version
    if target == current:
        raise _error(f"version {current} is the one being rolled back; name another version to go back to")
    try:
        events = [version_event(store.manifest(current), "ROLLED_BACK")]
        if target:
            manifest = store.manifest(target)
            if manifest.project_id != project:
                raise _error(f"version {target} is {_whose(manifest.project_id)}'s, not {_whose(project)}'s")
            events.append(version_event(manifest, "PROMOTED"))
        elif not project:
            events.append(base_version_event(base))
    except WeightStoreError as exc:
        raise _error(str(exc)) from None
    _publish(settings, *events)
    goes_to = f"version {target}" if target or not project else "the shared policy"
    click.echo(f"version {current} of {_whose(project)} rolled back; serving goes to {goes_to}")


# -- show-gate versions -------------------------------------------------------------------


@click.group()
def gates() -> None:
    """Show-gate versions (trainer/show_gate_learner.py): list them, roll one back. The front door follows, per project,
    its newest PROMOTED gate not rolled back, else the shared one."""


def read_gate_records(settings) -> list[dict]:
    """Every GateVersion record on tabloop.gates, in order (empty when the topic does not exist yet)."""
    if not broker_answers(settings):
        raise _error(f"no Kafka answers on {settings.kafka_bootstrap}: run `tabloop kafka start` first")
    try:
        return [r.event.record for r in read_topic(settings, GATES.name) if r.event is not None]
    except ValueError:  # the topic does not exist yet
        return []


def _gate_of(project: str) -> str:
    return f"project {project}'s gate" if project else "the shared gate"


@gates.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per version.")
@click.pass_context
def gates_list(ctx: click.Context, as_json: bool) -> None:
    """Every gate version with its latest status; * marks the one serving its project."""
    records = read_gate_records(settings_of(ctx))
    rows = []
    for project in dict.fromkeys(r.get("project_id") or "" for r in records):
        serving = serving_gate_record(records, project)
        for version, r in sorted(latest_statuses(records, project).items()):
            m = r["metrics"]
            rows.append({"version": version, "project": project, "status": r["status"],
                         "serving": serving is not None and serving["version"] == version,
                         "parent": r.get("parent_version"), "policy_version": r["policy_version"],
                         "threshold": round(r["threshold"], 4), "exploration": r["exploration"],
                         "episodes": r["episodes_used"], "auc": round(m.get("auc_cross_fitted", float("nan")), 3),
                         "keep_chars": round(m.get("keep_chars", float("nan")), 3),
                         "shown_share": round(m.get("gate_shown_share", float("nan")), 3),
                         "accept_rate_shown": round(m.get("gate_accept_rate_shown", float("nan")), 3),
                         "created": r["created_at"].strftime("%Y-%m-%d %H:%M:%S"), "reason": r.get("reason") or ""})
    if not rows and not as_json:
        click.echo("no gate versions on tabloop.gates yet (the trainer publishes one after "
                   f"{settings_of(ctx).gate_min_decided} decided episodes)")
        return
    echo_rows(rows, GATE_COLUMNS, as_json)


@gates.command("rollback")
@click.option("--version", "version", type=click.IntRange(min=1), required=True, help="The gate version to roll back.")
@click.option("--project", default="", help="Whose gate (default: the shared one).")
@click.pass_context
def gates_rollback(ctx: click.Context, version: int, project: str) -> None:
    """Publish VERSION as ROLLED_BACK: the door goes back to the project's gate promoted before it, else the
    shared gate, else shows everything."""
    settings = settings_of(ctx)
    records = read_gate_records(settings)
    record = latest_statuses(records, project).get(version)
    if record is None:
        raise _error(f"no version {version} of {_gate_of(project)} on tabloop.gates")
    if record["status"] == "ROLLED_BACK":
        raise _error(f"gate version {version} is rolled back already")
    event = restated(record, "ROLLED_BACK", "rolled back by `tabloop gates rollback`")
    _publish(settings, event)
    after = serving_gate_record([*records, event.record], project)
    goes_to = (f"gate version {after['version']}" if after is not None
               else "the shared gate" if project else "no gate (everything shown)")
    click.echo(f"version {version} of {_gate_of(project)} rolled back; "
               f"the door goes to {goes_to}")


SINCE_UNITS = {"m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: datetime) -> datetime:
    """Pure: ``--since`` as an ISO time (UTC unless it says otherwise) or an age: 30m, 6h, 7d."""
    value = text.strip()
    if value[-1:] in SINCE_UNITS and value[:-1].replace(".", "", 1).isdigit():
        return now - timedelta(seconds=float(value[:-1]) * SINCE_UNITS[value[-1]])
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"--since: expected an ISO time (2026-12-01T08:00) or an age (30m, 6h, 7d), "
                         f"got {text!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


@weights.command("evaluate")
@click.argument("version")
@click.option("--project", default=None, help="Only this project's episodes (default: every project's).")
@click.option("--since", default=None, help="Only episodes joined since: an ISO time or an age (30m, 6h, 7d).")
@click.option("--limit", type=click.IntRange(min=1), default=2000, show_default=True,
              help="At most the newest this many episodes.")
@click.option("--clip", type=click.FloatRange(min=1.0), default=10.0, show_default=True,
              help="Importance weights above this are clipped.")
@click.option("--level", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.9, show_default=True,
              help="Confidence level of the intervals.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON result.")
@click.pass_context
def weights_evaluate(ctx: click.Context, version: str, project: str | None, since: str | None, limit: int,
                     clip: float, level: float, as_json: bool) -> None:
    """Estimate VERSION's accept rate among shown, share shown and mean reward on logged episodes.

    Off-policy: each logged episode is weighed by VERSION's probability of the served tokens over the
    probability of the policy that served them (clipped, self-normalised), so VERSION is judged before any
    user sees it. VERSION: a version number (0 = the base model) or a weights directory."""
    from trainer.ope_episodes import evaluate_logged, select_episodes  # lazy: torch (see `train`)
    from trainer.proof.evaluate import load_policy

    settings = settings_of(ctx)
    try:
        since_at = parse_since(since, datetime.now(timezone.utc)) if since else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--since") from None
    if not broker_answers(settings):
        raise _error(f"no Kafka answers on {settings.kafka_bootstrap}: run `tabloop kafka start` first")
    try:
        model, tokenizer, label = load_policy(settings, version)
    except ValueError as exc:
        raise _error(str(exc)) from None
    episodes = (r.event.record for r in read_topic(settings, EPISODES.name) if r.event is not None)
    logged = select_episodes(episodes, tokenizer, project=project, since=since_at, limit=limit,
                             max_prompt_tokens=settings.max_prompt_tokens)
    spec = RewardSpecs.from_settings(settings)
    ignored = (spec.for_project(project) if project else spec.default).ignored

    def progress(done: int, total: int) -> None:
        if not as_json and (done == total or done % 200 < 8):
            click.echo(f"  scored {done}/{total} episodes under {label}", err=True)

    try:
        result = evaluate_logged(model, tokenizer, logged, clip=clip, level=level, ignored_reward=ignored,
                                 progress=progress)
    except ValueError as exc:
        raise _error(str(exc)) from None
    result = {"version": version, "project": project, "since": since_at.isoformat() if since_at else None, **result}
    if not as_json:
        click.echo(f"{label} on {result['episodes']} logged episodes"
                   f"{f' of {project}' if project else ''}: effective sample size "
                   f"{result['effective_sample_size']:.1f}, {result['clipped_share']:.1%} of weights clipped at {clip:g}")
        click.echo(f"{'figure':<22} {'estimate':>9} {f'{level:.0%} interval':>18} {'logged':>8}")
        for name in ("accept_rate_shown", "shown_share", "reward_mean", "reward_mean_dr"):
            got = result[name]
            logged_value = result["logged"].get(name.removesuffix("_dr"))
            if got:
                interval = f"[{got['low']:.4f}, {got['high']:.4f}]"
                cells = f"{got['value']:>9.4f} {interval:>18}"
            else:
                cells = f"{'-':>9} {'-':>18}"
            click.echo(f"{name:<22} {cells} {'-' if logged_value is None else f'{logged_value:.4f}':>8}")
        if result["skipped"]:
            click.echo("left out: " + ", ".join(f"{n} {why}" for why, n in result["skipped"].items()))
    click.echo(json.dumps(result))


# -- bench ------------------------------------------------------------------------------


@click.command("trainer")
@click.option("--model-shape", type=click.Choice(["tiny", "qwen2.5-coder-1.5b"]), default="tiny", show_default=True,
              help="tiny: the offline test model; qwen2.5-coder-1.5b: that architecture with random weights (GPU).")
@click.option("--mode", type=click.Choice(["lora", "full", "both"]), default="both", show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=16, show_default=True, help="Episodes per update.")
@click.option("--micro-batch", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--completion-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--updates", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--peak-tflops", type=float, default=None,
              help="Accelerator peak (bf16 dense) for model FLOPs utilisation; default: known GPUs, else none.")
@click.pass_context
def bench_trainer(ctx: click.Context, model_shape: str, mode: str, batch: int, micro_batch: int, prompt_tokens: int,
                  completion_tokens: int, updates: int, device: str, peak_tflops: float | None) -> None:
    """Policy updates per second and tokens/s on synthetic episodes (no Kafka)."""
    from trainer.bench import bench_trainer as run  # lazy: torch (see `train`)

    run(settings_of(ctx), model_shape=model_shape, modes=["lora", "full"] if mode == "both" else [mode], batch=batch,
        micro_batch=micro_batch, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, updates=updates,
        device=device, peak_tflops=peak_tflops)
