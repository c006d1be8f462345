"""Running the whole system as a user does, for system tests and drills: the `tabloop` CLI in a subprocess
on settings of a test's own (free ports, a tmp state dir), its status, and waiting on it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def env(settings) -> dict:
    from infra.settings import to_environ

    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "PYTHONPATH": str(ROOT),
            **to_environ(settings)}


def cli(settings, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tabloop.cli", *args], env=env(settings), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def status(settings) -> dict:
    return json.loads(cli(settings, "status", "--json").stdout)


def row(status: dict, name: str) -> dict:
    return next(r for r in status["components"] if r["component"] == name)


def poll(probe, done=bool, timeout_s: float = 30.0, poll_s: float = 0.5):
    """``probe()`` again every ``poll_s`` until ``done`` of its value or ``timeout_s``; the last value either
    way, for a caller that asserts on it itself (or that expects nothing to come). The suite's one polling
    loop: a test waits on the condition it needs, never on a sleep."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(poll_s)


def wait(predicate, timeout_s: float, what: str, explain=None, poll_s: float = 0.5):
    """``predicate()`` once it is truthy; AssertionError after ``timeout_s``, with ``explain()`` appended
    (what a CI log needs to tell why: a status table, the ends of the logs)."""
    value = poll(predicate, bool, timeout_s, poll_s)
    if value:
        return value
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}"
                         + (f"\n{explain()}" if explain else ""))


def worker_lag(settings, group: str = "tabloop-streams", probes=None, internal: bool = True,
               detail: bool = False) -> int | tuple[dict, int] | None:
    """Records ``group`` has not committed yet: of the event log, as ``tabloop status`` counts them, and
    (``internal``) of its own topics between its stages, clock ticks left out (None: nothing committed yet,
    or the broker did not answer). Asked of a child process, as the supervisor asks
    (``KafkaProbeProcess``): librdkafka's admin client can segfault in ListConsumerGroupOffsets
    (rd_kafka_cgrp_op, seen here against a broker just started), which in-process would end the test run.
    With ``detail``: ({topic: records behind}, total), for a failure's message."""
    from tabloop.supervisor import KafkaProbeProcess

    own = probes is None
    probes = probes or KafkaProbeProcess(settings)
    try:
        return probes.ask("lag", group, internal, detail)
    finally:
        if own:
            probes.close()


class Quiet:
    """A predicate for ``wait`` that also ends once waiting longer cannot help: ``count()``, the worker's lag
    and its group have all stood still, at lag 0 in a stable group for ``grace_s`` (it read all its input and
    published what it had) or otherwise for ``stall_s`` (it is stuck; longer, as a worker (re)joining its
    group stands still a while too) — or the worker exited. ``wait`` then returns ``"settled"``, ``"stalled"`` or ``"exited"``
    and the caller's own assertion says what is missing, rather than at the end of a long timeout.
    ``grace_s`` must cover what the worker holds back after reading (open windows)."""

    def __init__(self, settings, count, want: int, grace_s: float, proc=None, group: str = "tabloop-streams",
                 stall_s: float = 300.0):
        self.settings, self.count, self.want, self.grace_s, self.proc, self.group = \
            settings, count, want, grace_s, proc, group
        self.stall_s = max(stall_s, grace_s)
        self.last, self.since = None, time.monotonic()
        from tabloop.supervisor import KafkaProbeProcess

        self.probes = KafkaProbeProcess(settings)

    def close(self) -> None:
        self.probes.close()

    def __call__(self):
        n = self.count()
        if n >= self.want:
            return "done"
        if self.proc is not None and self.proc.poll() is not None:
            return "exited"
        lag = worker_lag(self.settings, self.group, self.probes)
        # A restarted worker waits for its group (the dead member's session to end), then restores its
        # state, with lag 0 and nothing new meanwhile: the grace counts from when its group is stable with
        # the members it has now (a sigkill drill saw a minute of that and ended its wait too early).
        group = self.probes.ask("group_state", self.group)  # (state, member ids), None when Kafka did not say
        stable = group is not None and group[0] == "STABLE" and bool(group[1])
        key = (n, lag, None if group is None else (group[0], frozenset(group[1])))
        if key != self.last:
            self.last, self.since = key, time.monotonic()
            return None
        still = time.monotonic() - self.since
        if lag == 0 and stable and still > self.grace_s:
            return "settled"
        if still > self.stall_s:
            return "stalled"
        return None


def explain_system(settings, lines: int = 40) -> str:
    """The status table, the end of the supervisor's log and of every unhealthy component's log."""
    from infra.files import log_tail
    from tabloop.supervisor import format_table, log_dir

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
        parts.append(f"--- the end of {name}.log ---\n{log_tail(log_dir(settings) / f'{name}.log', lines)}")
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


def feedback_waiting(settings, app_id: str = "tabloop-streams", timeout_s: float = 30.0) -> int:
    """Feedback the streams worker holds in its tables, still waiting for a completion (``waiting`` in a
    prompt's state, ``early`` in a completion's; the join's one table, and the two tables of a worker from
    before issue 32): what could still become an episode by time alone (an unmatched one, once its lateness
    has passed). Read from the tables' changelogs as a restarted worker restores them: read_committed, the
    last value of each key.

    A drill that has its episodes waits for this to reach 0 (and the worker's lag, internal topics included)
    before it reads the topic for the last time, instead of sleeping out the lateness and the idle close."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    reader = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": "tabloop-tests-state",
                       "enable.auto.commit": False, "isolation.level": "read_committed",
                       "enable.partition.eof": True})
    try:
        topics = {f"{app_id}-prompt-state-changelog": "waiting", f"{app_id}-completion-state-changelog": "early",
                  f"{app_id}-join-state-changelog": None}
        metadata = reader.list_topics(timeout=10).topics
        parts = [TopicPartition(t, p, 0) for t in topics if t in metadata for p in metadata[t].partitions]
        reader.assign(parts)
        latest, reading = {}, {(tp.topic, tp.partition) for tp in parts}
        deadline = time.monotonic() + timeout_s
        while reading:
            if time.monotonic() > deadline:
                raise AssertionError(f"the worker's changelogs not read to their end in {timeout_s:.0f} s")
            m = reader.poll(0.5)
            if m is None:
                continue
            if m.error():
                if m.error().code() == KafkaError._PARTITION_EOF:
                    reading.discard((m.topic(), m.partition()))
                continue
            latest[(m.topic(), m.key())] = m.value()
        def waits(topic, key, value) -> bool:
            field = topics[topic] or ("waiting" if key.startswith(b"p\x1f") else "early")
            return bool(value and json.loads(value).get(field))

        return sum(1 for (topic, key), value in latest.items() if waits(topic, key, value))
    finally:
        reader.close()


@contextmanager
def supervising(settings, components):
    """A ``tabloop.supervisor.Supervisor`` running ``components`` in a thread of the test: yields it and its
    output; stopped on the way out, and the thread must be gone within 60 s."""
    from tabloop import supervisor as sv

    out = io.StringIO()
    sup = sv.Supervisor(settings, tuple(components), out=out)
    thread = threading.Thread(target=sup.run)
    thread.start()
    try:
        yield sup, out
    finally:
        sup.stop()
        thread.join(60)
    assert not thread.is_alive(), "the supervisor did not stop within 60 s"
