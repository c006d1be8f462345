"""Running the whole system as a user does, for system tests and drills: the `tabloop` CLI in a subprocess
on settings of a test's own (free ports, a tmp state dir), its status, and waiting on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def env(settings) -> dict:
    from infra.settings import to_environ

    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "PYTHONPATH": str(ROOT),
            **to_environ(settings)}


def cli(settings, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", *args], env=env(settings), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def status(settings) -> dict:
    return json.loads(cli(settings, "status", "--json").stdout)


def row(status: dict, name: str) -> dict:
    return next(r for r in status["components"] if r["component"] == name)


def wait(predicate, timeout_s: float, what: str, explain=None):
    """``predicate()`` once it is truthy; AssertionError after ``timeout_s``, with ``explain()`` appended
    (what a CI log needs to tell why: a status table, the ends of the logs)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}" + (f"\n{explain()}" if explain else ""))


def explain_system(settings, lines: int = 40) -> str:
    """The status table, the end of the supervisor's log and of every unhealthy component's log."""
    from infra.supervisor import format_table, log_dir, tail

    proc = cli(settings, "status", "--json")
    try:
        st = json.loads(proc.stdout)
    except json.JSONDecodeError:
        parts, unhealthy = [f"tabloop status --json (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"], []
    else:
        parts = [f"tabloop status:\n{format_table(st)}"]
        unhealthy = [r["component"] for r in st["components"]
                     if not r["healthy"] and r["state"] != "not installed" and r["component"] != "kafka"]
    for name in ["supervisor", *unhealthy]:
        parts.append(f"--- the end of {name}.log ---\n{tail(log_dir(settings) / f'{name}.log', lines)}")
    return "\n".join(parts)


def processes_of(state_dir: Path) -> list[int]:
    """Every process whose environment or command line names this state dir."""
    found = []
    needle = str(state_dir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes() or needle in (entry / "cmdline").read_bytes():
                if (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def group_positions(settings, group: str = "tabloop-streams") -> dict:
    """Every partition the group committed: (committed offset, the end a read_committed reader can reach)."""
    from confluent_kafka import ConsumerGroupTopicPartitions, IsolationLevel
    from confluent_kafka.admin import OffsetSpec

    from infra.bus import admin_client

    admin = admin_client(settings)
    committed = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)],
                                                  request_timeout=10)[group].result(timeout=15)
    parts = [tp for tp in committed.topic_partitions if tp.offset >= 0]
    ends = admin.list_offsets({tp: OffsetSpec.latest() for tp in parts},
                              isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=10)
    return {(k.topic, k.partition): (next(tp.offset for tp in parts if (tp.topic, tp.partition)
                                          == (k.topic, k.partition)), f.result(timeout=15).offset)
            for k, f in ends.items()}


def stalled_partitions(settings, settle_s: float = 20.0) -> dict:
    """The worker's input partitions whose committed offset did not move in ``settle_s`` although more
    was there to read: with no new input only the worker's ticks (one per partition per second) arrive,
    so every repartition partition must keep committing, and every event-log partition must be committed
    to its end."""
    first = group_positions(settings)
    time.sleep(settle_s)
    last = group_positions(settings)
    return {tp: (first.get(tp), pos) for tp, pos in last.items()
            if pos[0] < pos[1] and (tp not in first or first[tp][0] == pos[0] or not tp[0].startswith("tabloop-"))}
