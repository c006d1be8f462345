"""`tabloop bench codec|kafka|pipeline|serving|adapters` and `tabloop drill fuzz`."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import click

from infra.bus import broker_answers
from infra.errors import TabloopError
from infra.settings import settings_of
from tabloop import bench as benches
from tabloop.bench_vllm import bench_serving_vllm
from tabloop.fuzz import NAMED_SCHEDULES, fuzz



@click.command("codec")
@click.option("--events", "n", type=click.IntRange(min=100), default=20_000, show_default=True)
def bench_codec(n: int) -> None:
    """Encode/decode events/s per event type."""
    benches.bench_codec(n)


@click.command("kafka")
@click.option("--events", "n", type=click.IntRange(min=1000), default=200_000, show_default=True)
@click.option("--partitions", type=click.IntRange(min=1), default=6, show_default=True)
@click.pass_context
def bench_kafka(ctx: click.Context, n: int, partitions: int) -> None:
    """Produce/consume events/s of realistic CompletionServed events against the configured broker."""
    s = settings_of(ctx)
    if not broker_answers(s):
        raise TabloopError(f"no Kafka answers on {s.kafka_bootstrap}: run `tabloop kafka start` first")
    benches.bench_kafka(s, n, partitions)


@click.command("pipeline")
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
    benches.bench_pipeline(settings_of(ctx), n=n, rate=rate, seconds=seconds, guarantee=guarantee, workers=workers)


@click.command("serving")
@click.option("--clients", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--requests", "per_client", type=click.IntRange(min=1), default=12, show_default=True,
              help="Requests per client per round.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--engine", type=click.Choice(["transformers", "vllm"]), default="transformers", show_default=True,
              help="vllm: a real vLLM replica directly, the front door over it and over the transformers engine, "
                   "at one client and at --clients (needs `tabloop vllm install`)")
@click.option("--vllm-url", default=None, help="--engine vllm: a replica already running on TABLOOP_MODEL "
                                               "(default: one started here)")
@click.option("--transformers/--no-transformers", "with_transformers", default=True, show_default=True,
              help="--engine vllm: the front door over the transformers engine too")
@click.pass_context
def bench_serving(ctx: click.Context, clients: int, per_client: int, max_tokens: int, rounds: int, engine: str,
                  vllm_url: str | None, with_transformers: bool) -> None:
    """Streaming latency and TTFT through the front door vs the bare engine (TABLOOP_MODEL; for a quick run point it at `tabloop model tiny --out DIR`)."""
    if engine == "vllm":
        bench_serving_vllm(settings_of(ctx), clients=clients, requests_per_client=per_client, max_tokens=max_tokens,
                           rounds=rounds, vllm_url=vllm_url, with_transformers=with_transformers)
        return
    benches.bench_serving(settings_of(ctx), clients=clients, requests_per_client=per_client, max_tokens=max_tokens, rounds=rounds)


@click.command("adapters")
@click.option("--rows", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--adapters", type=click.IntRange(min=1), default=4, show_default=True,
              help="Adapters mixed in one batch (projects with versions of their own).")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--rank", type=click.IntRange(min=1), default=16, show_default=True)
@click.pass_context
def bench_adapters(ctx: click.Context, rows: int, adapters: int, rounds: int, rank: int) -> None:
    """Decode-step cost of per-project adapters vs a merged copy, and adapter load time (TABLOOP_MODEL)."""
    benches.bench_adapters(settings_of(ctx), rows=rows, adapters=adapters, rounds=rounds, rank=rank)


@click.command("fuzz")
@click.option("--seeds", type=click.IntRange(min=0), default=3, show_default=True,
              help="how many drawn schedules to run")
@click.option("--first-seed", type=int, default=0, show_default=True, help="the seed of the first schedule")
@click.option("--named", multiple=True,
              help=f"a named schedule to run first ({', '.join(NAMED_SCHEDULES)}); repeatable")
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
    workdir = workdir or Path(tempfile.mkdtemp(prefix="tabloop-fuzz-"))
    benches.stop_cleanly_on_sigterm()  # `kill`, a CI job's timeout: the system it brought up goes down too
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
