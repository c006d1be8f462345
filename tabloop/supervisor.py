"""The one-machine supervisor behind `tabloop up|down|status`.

One process runs every component as a child (`tabloop serve`, `tabloop streams`,
`tabloop train`, `tabloop history`), each in its own process group:

- its output goes to ``<state_dir>/logs/<name>.log`` and, prefixed with its
  name, to the supervisor's own output (``<state_dir>/logs/supervisor.log``
  when detached, the terminal with ``--foreground``);
- a child that exits is started again after an exponential back-off
  (``restart_delay``); the back-off resets once it has run ``STABLE_AFTER_S``;
- every couple of seconds each child's readiness is probed (the table below)
  and the whole picture is written to ``<state_dir>/run/status.json``, which
  `tabloop status` and `tabloop up` read (with the addresses its components answer on);
- the state dir, ``run/`` and ``logs/`` are 0700, the logs 0600, and every child runs with the umask
  0o077 (``infra/files.py`` says why).

The components are one table, ``COMPONENTS``. A component whose command is not
(yet) a registered `tabloop` command is reported as "not installed" and skipped.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Collection, TextIO

import httpx

from infra.bus import admin_client, broker_answers
from infra.files import PRIVATE_UMASK, log_tail, open_private, private_dir, write_private
from infra.kafka_broker import KafkaLaunchError, LocalKafka, pid_alive
from infra.local import endpoints
from infra.settings import Settings, to_environ
from infra.vllm_env import managed_urls, manages_replicas, warm_marker
from schemas.topics import CATALOG, TICK_KEY

BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 60.0
STABLE_AFTER_S = 60.0  # a child that ran this long starts its back-off from the beginning again
PROBE_EVERY_S = 2.0
STOP_TIMEOUT_S = 20.0
HUNG_RESTART_S = 120.0  # a component that was healthy and stays unhealthy this long is restarted
STATUS_FILE = "status.json"
PID_FILE = "supervisor.pid"


# -- the component table ----------------------------------------------------------------------


@dataclass(frozen=True)
class Component:
    name: str
    command: tuple[str, ...]
    """The `tabloop` subcommand (and its arguments) that runs it."""
    health: str
    """How readiness is probed: ``http`` (the front door's /readyz answers 200), ``group`` (its Kafka
    consumer group is Stable with at least one member), ``alive`` (running for ``grace_s``), ``vllm`` (a managed
    vLLM replica: its /health answers 200 and its wrapper marked it warm, ``infra.vllm_env.warm_marker``)."""
    group: str | None = None
    """Its Kafka consumer group: the lag `tabloop status` shows (and readiness when health is ``group``)."""
    grace_s: float = 15.0
    group_setting: str | None = None
    """A setting that names the group instead, when this tabloop has it (e.g. ``trainer_group``)."""
    waits_for: tuple[str, ...] = ()
    """Components that must be healthy before this one first starts (the front door waits for its replicas)."""
    replica: int | None = None
    """For ``vllm`` health: the managed replica's index (its port is ``vllm_port`` + it)."""

    def group_for(self, settings: Settings) -> str | None:
        if self.group_setting and getattr(settings, self.group_setting, None):
            return getattr(settings, self.group_setting)
        return self.group


COMPONENTS: tuple[Component, ...] = (
    Component("serve", ("serve",), health="http"),
    Component("streams", ("streams",), health="group", group="tabloop-streams"),
    # Alive for a grace period: the trainer may spend minutes loading a model before it joins its group.
    Component("trainer", ("train",), health="alive", group="tabloop-trainer", group_setting="trainer_group"),
    Component("history", ("history",), health="alive", group="tabloop-history"),
)


def components_for(settings: Settings) -> tuple[Component, ...]:
    """The components `tabloop up` supervises: with the vllm engine and no replicas named (``vllm_urls``), its
    vLLM replicas first, each ``tabloop vllm replica --index N``, and a front door that starts once they are
    warm; otherwise ``COMPONENTS``."""
    if not manages_replicas(settings):
        return COMPONENTS
    replicas = tuple(Component(f"vllm-{i}", ("vllm", "replica", "--index", str(i)), health="vllm", replica=i)
                     for i in range(settings.vllm_replicas))
    names = tuple(r.name for r in replicas)
    return replicas + tuple(replace(c, waits_for=names) if c.name == "serve" else c for c in COMPONENTS)


def streams_instance_id(settings: Settings) -> str:
    """The static group member id of the streams worker `tabloop up` supervises: the same for every restart
    of it (so a successor takes the killed worker's place at once), different for another tabloop's state
    dir on the same broker (two workers with one id would fence each other)."""
    digest = hashlib.sha256(f"{settings.state_dir.expanduser().resolve()}|{settings.kafka_bootstrap}".encode())
    return f"tabloop-streams-{digest.hexdigest()[:12]}"


def restart_delay(failures: int, base_s: float = BACKOFF_BASE_S, max_s: float = BACKOFF_MAX_S) -> float:
    """Seconds to wait before start number ``failures + 1`` after ``failures`` crashes in a row:
    1, 2, 4, 8 … capped at ``max_s``. No wait before the first start."""
    if failures <= 0:
        return 0.0
    return min(max_s, base_s * 2 ** (failures - 1))


# -- where things live ------------------------------------------------------------------------


def run_dir(settings: Settings) -> Path:
    return settings.state_dir / "run"


def log_dir(settings: Settings) -> Path:
    return settings.state_dir / "logs"


def supervisor_pid(settings: Settings) -> int | None:
    """The running supervisor's pid, or None (no pid file, or its process is gone or someone else)."""
    try:
        pid = int((run_dir(settings) / PID_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _is_tabloop(pid) else None


def read_status(settings: Settings) -> dict | None:
    try:
        return json.loads((run_dir(settings) / STATUS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _is_tabloop(pid: int) -> bool:
    """Alive and running tabloop's CLI (a recycled pid belongs to someone else)."""
    if not pid_alive(pid):
        return False
    try:
        return b"tabloop.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _write_json(path: Path, data: dict) -> None:
    write_private(path, json.dumps(data, indent=1, default=str))


def _private_dirs(settings: Settings) -> None:
    """The state dir, run/ and logs/ made (or tightened to) 0700 before anything is written there."""
    private_dir(settings.state_dir)
    private_dir(run_dir(settings))
    private_dir(log_dir(settings))


# -- probes ------------------------------------------------------------------------------------


class Probes:
    """Readiness and lag, read from the components' own surfaces and from Kafka.

    The Kafka questions (a group's members, its lag) are coordinator requests of librdkafka's admin
    client, and librdkafka aborts the whole process when the broker goes away in the middle of one
    (``rd_kafka_enq_once_del_source_return: Assertion `eonce->refcnt > 0' failed``, librdkafka
    #4605/#3663). In the supervisor that abort took every component down with it during a Kafka
    outage, so they are asked in a process of their own (``KafkaProbeProcess``); when it dies the
    answer is "unknown" and the next question starts a new one.
    """

    def __init__(self, settings: Settings):
        self.settings = settings
        self.kafka = KafkaProbeProcess(settings)

    @property
    def ready_url(self) -> str:
        return f"http://{self.settings.serve_host}:{self.settings.completions_port}/readyz"

    def front_door(self) -> dict | None:
        """The front door's /readyz body when it answers 200, else None."""
        try:
            resp = httpx.get(self.ready_url, timeout=2)
        except httpx.HTTPError:
            return None
        return resp.json() if resp.status_code == 200 else None

    def group_state(self, group: str) -> tuple[str, set[str]]:
        """(state, member ids) of a consumer group. The state as Kafka names it (``STABLE``,
        ``PREPARING_REBALANCING`` …), or ``unknown: <why>`` when Kafka or the probe process does not say."""
        answer = self.kafka.ask("group_state", group)
        return answer if answer is not None else ("unknown: no answer from the probe process", set())

    def group_ready(self, group: str, members_before: set[str]) -> tuple[bool | None, str]:
        """Stable, with a member that joined after ``members_before`` was taken: a restarted worker is ready
        once *it* has joined, not while the group still lists the member that died. None when Kafka does not
        say. With what was seen, in words (the status shows it)."""
        state, members = self.group_state(group)
        joined = members - members_before
        ready = None if state.startswith("unknown") else state == "STABLE" and bool(joined)
        return ready, f"group {group} {state}, {len(members)} member(s), {len(joined)} joined since this start"

    def lag(self, group: str, internal: bool = False) -> int | None:
        """Events of the event log (the catalog's topics; with ``internal``, the group's own topics too) the
        group has not committed yet; None when it has committed nothing there (or Kafka does not answer)."""
        return self.kafka.ask("lag", group, internal)

    def close(self) -> None:
        self.kafka.close()


class KafkaProbeProcess:
    """Admin requests to Kafka, answered by a child process (see ``Probes`` for why).

    ``ask`` returns None when the child died (it is started again at the next question) or did not
    answer within ``timeout_s``; the child exits when its pipe closes, so it never outlives us.

    After ``fresh_after`` failed requests in a row the child is replaced too: librdkafka's admin client
    can stay stuck after a broker restart, every request "Local: Timed out" minutes after the broker
    answers a new client. The Kafka-outage drill caught it: the streams worker, back in its group, looked
    unhealthy for good, so the supervisor restarted it, and its successor never looked healthy either.
    A new probe process every few failed questions is cheap next to that."""

    def __init__(self, settings: Settings, timeout_s: float = 15.0, fresh_after: int = 3):
        self.settings = settings
        self.timeout_s = timeout_s
        self.fresh_after = fresh_after
        self.restarts = 0
        self._started = False
        self._failed_in_a_row = 0
        self._proc = None
        self._conn = None
        self._lock = threading.Lock()

    def ask(self, question: str, *args):
        with self._lock:
            try:
                if self._proc is None or not self._proc.is_alive():
                    self._start()
                self._conn.send((question, args))
                if not self._conn.poll(self.timeout_s):
                    raise TimeoutError(f"no answer to {question} within {self.timeout_s:.0f}s")
                answer, failed = self._conn.recv()
            except (EOFError, OSError, TimeoutError):
                self._discard()
                return None
            self._failed_in_a_row = self._failed_in_a_row + 1 if failed else 0
            if self._failed_in_a_row >= self.fresh_after:
                self._discard()  # the next question starts a new one
            return answer

    def _start(self) -> None:
        import multiprocessing

        if self._started:  # counted whether the last one died between questions or during one
            self.restarts += 1
        self._started = True
        self._failed_in_a_row = 0
        self._discard()
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or locks copied
        ours, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_answer_kafka_probes, args=(theirs, self.settings), daemon=True,
                                 name="tabloop-kafka-probes")
        self._proc.start()
        theirs.close()
        self._conn = ours

    def _discard(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5)
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._discard()


def _answer_kafka_probes(conn, settings: Settings) -> None:
    """The probe process: answer questions until the pipe closes. Each answer goes with whether Kafka
    failed the request."""
    admin = admin_client(settings)
    questions = {"group_state": _group_state,
                 "lag": lambda admin, group, internal=False, detail=False:
                 _group_lag(admin, settings, group, internal, detail)}
    while True:
        try:
            question, args = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(questions[question](admin, *args))


def _group_state(admin, group: str) -> tuple[tuple[str, set[str]], bool]:
    try:
        desc = admin.describe_consumer_groups([group], request_timeout=3)[group].result(timeout=5)
    except Exception as exc:  # broker down, coordinator moving
        return (f"unknown: {exc}"[:200], set()), True
    return (desc.state.name, {m.member_id for m in desc.members}), False


def _group_lag(admin, settings: Settings, group: str, internal: bool = False,
               detail: bool = False) -> tuple[int | dict | None, bool]:
    """Records of the event log (the catalog's topics) the group has not committed yet; None when it has
    committed nothing there.

    A worker's internal topics (``{group}-…``: its repartitions) are left out, the worker's own business,
    unless ``internal``: then their records count too, its clock ticks excepted (``schemas.topics.TICK_KEY``:
    one a second into every partition, they never stand at 0) — a worker that read all its input may still
    hold records between its stages, and a test waiting for it to settle must see them. A partition written in
    transactions ends with a commit marker that no reader ever gets, and a reader commits the offset
    after the last record it processed, which is the marker's: so where a partition's end is only a
    few offsets past the commit, the records a read_committed reader would actually get there are
    counted (``_readable``) — an idle trainer shows 0, not one per partition. With ``detail``:
    ({topic: records behind, the topics at 0 left out}, total), for a test's message to say where."""
    from confluent_kafka import ConsumerGroupTopicPartitions, IsolationLevel
    from confluent_kafka.admin import OffsetSpec

    try:
        committed = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)],
                                                      request_timeout=3)[group].result(timeout=5)
        event_log = {t.name for t in CATALOG}
        parts = [tp for tp in committed.topic_partitions if tp.offset >= 0 and tp.topic in event_log]
        if not parts:
            return None, False
        if internal:
            parts += [tp for tp in committed.topic_partitions
                      if tp.offset >= 0 and tp.topic.startswith(f"{group}-") and not tp.topic.endswith("-changelog")]
        # read_committed: the end a transactional reader can reach (Faust writes in transactions).
        ends = admin.list_offsets({tp: OffsetSpec.latest() for tp in parts},
                                  isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=3)
        behind = {}
        for tp in parts:
            end = next(f for k, f in ends.items() if (k.topic, k.partition) == (tp.topic, tp.partition))
            behind[(tp.topic, tp.partition)] = (tp.offset, end.result(timeout=5).offset)
        near = {k: span for k, span in behind.items()
                if 0 < span[1] - span[0] <= (TICKS_SLACK if k[0] not in event_log else MARKER_SLACK)}
        counted = _readable(settings, near, timeout_s=10.0 if internal else 3.0) if near else {}
        by_topic: dict[str, int] = {}
        for k, (start, end) in behind.items():
            by_topic[k[0]] = by_topic.get(k[0], 0) + counted.get(k, max(0, end - start))
        total = sum(by_topic.values())
        return (({t: n for t, n in by_topic.items() if n}, total) if detail else total), False
    except Exception:
        return None, True


MARKER_SLACK = 10  # spans this short are read to count their records exactly (commit markers are not records)
TICKS_SLACK = 20_000
"""On internal topics: spans up to this are read to leave the ticks out. A worker on a loaded machine runs
minutes behind on its ticks (twelve partitions, one a second each) and must still read as settled: a CI
drill waited 143 s on a lag of 341 with no feedback left waiting when this was 200."""


def _readable(settings: Settings, spans: dict[tuple[str, int], tuple[int, int]],
              timeout_s: float = 3.0) -> dict[tuple[str, int], int]:
    """For each (topic, partition): how many records a read_committed reader gets in [start, end), the
    streams worker's clock ticks left out."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    reader = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": "tabloop-lag-probe",
                       "enable.auto.commit": False, "isolation.level": "read_committed",
                       "enable.partition.eof": True})
    try:
        reader.assign([TopicPartition(t, p, start) for (t, p), (start, _) in spans.items()])
        counts, reading = dict.fromkeys(spans, 0), set(spans)
        deadline = time.monotonic() + timeout_s
        while reading and time.monotonic() < deadline:
            m = reader.poll(0.2)
            if m is None:
                continue
            key = (m.topic(), m.partition())
            if key not in reading:
                continue
            if m.error():
                if m.error().code() == KafkaError._PARTITION_EOF:
                    reading.discard(key)
                continue
            end = spans[key][1]
            counts[key] += m.offset() < end and m.key() != TICK_KEY
            if m.offset() + 1 >= end:
                reading.discard(key)
        for key in reading:  # no answer in time: count the whole span, as without this check
            counts[key] = spans[key][1] - spans[key][0]
        return counts
    finally:
        reader.close()


# -- the supervisor ------------------------------------------------------------------------------


@dataclass
class Child:
    component: Component
    state: str = "starting"  # starting | healthy | unhealthy | backoff | stopped | not installed
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_since: float | None = None
    unready_since: float | None = None
    failures: int = 0
    restarts: int = 0
    next_start: float = 0.0
    last_exit: int | None = None
    members_before: set[str] = field(default_factory=set)
    detail: str = ""
    """What the last readiness probe saw, in words."""
    reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The process of this run until ``tick`` has seen it exit. Not ``poll()``ed here: a child that died
        between the tick and a status snapshot would otherwise show no pid beside its old state and restart
        count (a "healthy", never-restarted row with a pid other than the one killed, as a drill read it)."""
        return self.proc.pid if self.proc is not None else None

    @property
    def healthy(self) -> bool:
        return self.state == "healthy"


def replica_ready(settings: Settings, run: Path, index: int) -> tuple[bool, str]:
    """(ready, in words) of managed vLLM replica ``index``: warm (its wrapper's marker) and answering /health."""
    url = managed_urls(settings)[index]
    if not warm_marker(run, index).exists():
        return False, f"{url}: starting or warming up (the first completion compiles)"
    try:
        status = httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError as exc:
        return False, f"{url}/health: {exc!r}"
    return (True, f"{url}/health answers 200") if status == 200 else (False, f"{url}/health answered {status}")


def _die_with_parent() -> None:
    """In the child, before exec: its own process group, and SIGTERM when the supervisor dies
    (even by SIGKILL), so no component outlives the supervisor."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


TORCH_COMPONENTS = ("serve", "trainer")
"""The components that run a model in torch on this machine (the front door only with the transformers engine)."""


def torch_threads_each(settings: Settings, components: Collection[str], cpus: int) -> int:
    """Pure: the torch threads each model-running child gets; 0 leaves torch's default.

    Two torch processes with a thread per core each thrash the cores between them (``use_torch_threads``
    in policy/models.py has the figures), so when the front door (transformers engine) and the trainer
    both run here, each gets its share of the cores. An operator's TABLOOP_TORCH_THREADS wins.
    """
    if settings.torch_threads > 0:
        return settings.torch_threads
    running = [c for c in components if c in TORCH_COMPONENTS and (c != "serve" or settings.engine == "transformers")]
    return max(1, cpus // len(running)) if len(running) > 1 else 0


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Supervisor:
    def __init__(self, settings: Settings, components: tuple[Component, ...] | None = None, *,
                 out: TextIO | None = None, on_all_healthy: Callable[[], None] | None = None,
                 commands: Collection[str] | None = None):
        """``components``: what to supervise (default ``components_for(settings)``). ``commands``: the
        subcommands this installation has (``tabloop up`` passes its own); a component whose command is not among
        them is "not installed" and never started. None: all of them are."""
        if components is None:
            components = components_for(settings)
        if manages_replicas(settings):  # every child (the front door) learns where the replicas are
            settings = settings.model_copy(update={"vllm_urls": ",".join(managed_urls(settings))})
        installed = [c.name for c in components if commands is None or c.command[0] in commands]
        threads = torch_threads_each(settings, installed, usable_cpus())
        if threads != settings.torch_threads:
            settings = settings.model_copy(update={"torch_threads": threads})
        self.settings = settings
        self.out = out or sys.stdout
        self.on_all_healthy = on_all_healthy
        self.probes = Probes(settings)
        self.run_dir = run_dir(settings)
        self.log_dir = log_dir(settings)
        self._out_lock = threading.Lock()
        self._stopping = threading.Event()
        self._last_probe = 0.0
        self._announced = False
        self.policy_version: int | None = None
        self.children = [Child(c) for c in components]
        for child in self.children:
            if commands is not None and child.component.command[0] not in commands:
                child.state = "not installed"

    # -- output ----------------------------------------------------------------

    def say(self, name: str, line: str) -> None:
        with self._out_lock:
            self.out.write(f"{name:<10}| {line}\n")
            self.out.flush()

    def note(self, line: str) -> None:
        """A line of the supervisor's own, with the wall-clock time (its children's lines carry their own)."""
        self.say("supervisor", f"{time.strftime('%H:%M:%S')} {line}")

    def _pump(self, child: Child, proc: subprocess.Popen) -> None:
        """Copy a child's output to its log file and, prefixed, to ours."""
        name = child.component.name
        with open_private(self.log_dir / f"{name}.log") as log:
            for raw in iter(proc.stdout.readline, b""):
                log.write(raw)
                log.flush()
                self.say(name, raw.decode(errors="replace").rstrip("\n"))
        proc.stdout.close()

    # -- lifecycle ---------------------------------------------------------------

    def run(self) -> None:
        """Start everything and keep it running until SIGTERM/SIGINT (or ``stop()``)."""
        _private_dirs(self.settings)
        write_private(self.run_dir / PID_FILE, f"{os.getpid()}\n")
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self._stopping.set())
        for child in self.children:
            if child.state == "not installed":
                self.note(f"{child.component.name}: `tabloop {child.component.command[0]}` is not "
                          "installed in this tabloop; skipped")
        if self.settings.torch_threads:
            self.note(f"torch threads per model process: {self.settings.torch_threads} "
                      f"({usable_cpus()} cores here; TABLOOP_TORCH_THREADS)")
        try:
            while not self._stopping.is_set():
                self.tick()
                self._stopping.wait(0.25)
        finally:
            self.note("stopping")
            for child in reversed(self.children):
                self._stop_child(child)
            self._write_status()
            self.probes.close()
            (self.run_dir / PID_FILE).unlink(missing_ok=True)
            self.note("stopped")

    def stop(self) -> None:
        self._stopping.set()

    def tick(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.state in ("not installed", "stopped"):
                continue
            if child.proc is not None and child.proc.poll() is not None:
                self._on_exit(child, now)
            if child.proc is None and now >= child.next_start and self._may_start(child):
                self._start(child)
        if now - self._last_probe >= PROBE_EVERY_S:
            self._last_probe = now
            self._probe(now)
            self._write_status()

    def _may_start(self, child: Child) -> bool:
        """A component whose ``waits_for`` are not all healthy yet does not start for the first time."""
        if child.restarts or child.started_at or not child.component.waits_for:
            return True
        waiting = [c for c in self.children if c.component.name in child.component.waits_for and not c.healthy]
        child.detail = f"waiting for {', '.join(c.component.name for c in waiting)}" if waiting else ""
        return not waiting

    def _start(self, child: Child) -> None:
        c = child.component
        if c.health == "group":
            child.members_before = self.probes.group_state(c.group_for(self.settings))[1]
        env = {**os.environ, **to_environ(self.settings)}
        env["PYTHONUNBUFFERED"] = "1"
        if c.name == "streams" and not self.settings.streams_instance_id:
            env["TABLOOP_STREAMS_INSTANCE_ID"] = streams_instance_id(self.settings)
        # The private umask: whatever a component writes (trainer logs, spool, ClickHouse parts) is 0600.
        child.proc = subprocess.Popen([sys.executable, "-m", "tabloop.cli", *c.command], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      preexec_fn=_die_with_parent, umask=PRIVATE_UMASK)
        child.started_at = time.monotonic()
        child.ready_since = child.unready_since = None
        child.state = "starting"
        child.reader = threading.Thread(target=self._pump, args=(child, child.proc), daemon=True,
                                        name=f"pump-{c.name}")
        child.reader.start()
        self.note(f"started {c.name} (pid {child.proc.pid}): tabloop {' '.join(c.command)}")

    def _on_exit(self, child: Child, now: float) -> None:
        code = child.proc.returncode
        ran = now - child.started_at
        child.last_exit = code
        child.proc = None
        child.ready_since = None
        # A run long enough to count as stable starts the back-off over.
        child.failures = 1 if ran >= STABLE_AFTER_S else child.failures + 1
        delay = restart_delay(child.failures)
        child.next_start = now + delay
        child.restarts += 1
        child.state = "backoff"
        why = f"signal {-code}" if code < 0 else f"code {code}"
        child.detail = f"exited ({why}); restarting in {delay:.0f}s"
        self.note(f"{child.component.name} exited ({why}) after {ran:.1f}s; "
                  f"restarting in {delay:.0f}s (restart #{child.restarts})")

    def _probe(self, now: float) -> None:
        for child in self.children:
            if child.proc is None:
                continue
            c = child.component
            kafka_said = True
            if c.health == "http":
                body = self.probes.front_door()
                ready = body is not None
                if ready:
                    self.policy_version = body.get("policy_version")
                detail = f"{self.probes.ready_url} answers 200" if ready else f"no 200 from {self.probes.ready_url}"
            elif c.health == "group":
                ready, detail = self.probes.group_ready(c.group_for(self.settings), child.members_before)
                kafka_said, ready = ready is not None, bool(ready)
            elif c.health == "vllm":
                ready, detail = replica_ready(self.settings, self.run_dir, c.replica)
            else:
                ran = now - child.started_at
                ready = ran >= c.grace_s
                detail = f"running {ran:.0f}s (healthy after {c.grace_s:.0f}s)"
            was, said = child.state, child.detail
            child.detail = detail
            if ready:
                child.ready_since = child.ready_since or now
                child.unready_since = None
                child.state = "healthy"
            else:
                # The clock towards a hung restart runs only while Kafka answers: an outage is not the
                # worker's fault, and a worker started while Kafka is away could not join either.
                child.unready_since = (child.unready_since or now) if kafka_said else now
                child.state = "starting" if child.ready_since is None else "unhealthy"
                # Alive but not doing its job: the front door not answering, or a worker that left its
                # consumer group and never came back (seen after a Kafka outage).
                if (c.health in ("http", "group", "vllm") and child.ready_since is not None
                        and now - child.unready_since >= HUNG_RESTART_S):
                    self.note(f"{c.name} has been unhealthy for {HUNG_RESTART_S:.0f}s ({detail}); restarting it")
                    self._kill(child)
            if child.state != was and child.state in ("healthy", "unhealthy"):
                self.note(f"{c.name} is {child.state}: {detail}")
            elif not ready and c.health != "alive" and detail != said:  # why it is not healthy yet, as that changes
                self.note(f"{c.name} is {child.state}: {detail}")
        if not self._announced and self.all_healthy():
            self._announced = True
            self.note("all components healthy")
            if self.on_all_healthy:
                self.on_all_healthy()

    def all_healthy(self) -> bool:
        return all(c.healthy for c in self.children if c.state != "not installed")

    def _kill(self, child: Child, sig: int = signal.SIGKILL) -> None:
        if child.proc is not None and child.proc.poll() is None:
            try:
                os.killpg(child.proc.pid, sig)
            except ProcessLookupError:
                pass

    @staticmethod
    def _end_group(pgid: int, grace_s: float = 5.0) -> None:
        """Wait up to ``grace_s`` for process group ``pgid`` (its leader already reaped) to empty, then
        SIGKILL what is left."""
        deadline = time.monotonic() + grace_s
        while True:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return  # empty
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _stop_child(self, child: Child) -> None:
        if child.proc is None:
            if child.state != "not installed":
                child.state = "stopped"
            return
        if child.proc.poll() is None:
            self._kill(child, signal.SIGTERM)
            try:
                child.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.note(f"{child.component.name} did not stop in {STOP_TIMEOUT_S:.0f}s; killing it")
                self._kill(child, signal.SIGKILL)
                child.proc.wait()
        # The rest of its process group (a worker's helpers got the SIGTERM too) may still be exiting when
        # the leader is gone: a moment's grace, then SIGKILL, so nothing of it outlives the supervisor.
        self._end_group(child.proc.pid)
        if child.reader is not None:
            child.reader.join(5)
        child.last_exit = child.proc.returncode
        child.proc = None
        child.state = "stopped"

    # -- status ------------------------------------------------------------------

    def snapshot(self) -> dict:
        now = time.monotonic()
        return {
            "supervisor_pid": os.getpid(),
            "updated_at": time.time(),
            "policy_version": self.policy_version,
            # Where this supervisor's components answer: `tabloop up` on a running system prints these, not
            # what its caller's environment would say.
            "addresses": endpoints(self.settings),
            "components": [{
                "component": ch.component.name,
                "command": "tabloop " + " ".join(ch.component.command),
                "state": ch.state,
                "pid": ch.pid,
                "healthy": ch.healthy,
                "restarts": ch.restarts,
                "last_exit": ch.last_exit,
                "detail": ch.detail,
                "uptime_s": round(now - ch.started_at, 1) if ch.pid else None,
                "group": ch.component.group_for(self.settings),
                "log": str((self.log_dir / f"{ch.component.name}.log").resolve()),
            } for ch in self.children],
        }

    def _write_status(self) -> None:
        _write_json(self.run_dir / STATUS_FILE, self.snapshot())


# -- what `tabloop up|down|status` do around it ---------------------------------------------------


class UpError(RuntimeError):
    pass


def spawn_detached(settings: Settings) -> subprocess.Popen:
    """Start `tabloop supervise` in its own session, its output in logs/supervisor.log."""
    _private_dirs(settings)
    (run_dir(settings) / STATUS_FILE).unlink(missing_ok=True)
    env = {**os.environ, **to_environ(settings), "PYTHONUNBUFFERED": "1"}
    with open_private(log_dir(settings) / "supervisor.log") as log:
        return subprocess.Popen([sys.executable, "-m", "tabloop.cli", "supervise"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                umask=PRIVATE_UMASK)


def wait_all_healthy(settings: Settings, proc: subprocess.Popen, timeout_s: float,
                     max_restarts: int = 3) -> dict:
    """Poll status.json until every installed component is healthy; UpError when the supervisor dies,
    a component keeps crashing before it ever got healthy, or the time is up."""
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UpError(f"the supervisor exited with code {proc.returncode}:\n"
                          f"{log_tail(log_dir(settings) / 'supervisor.log')}")
        status = read_status(settings)
        if status:
            rows = [r for r in status["components"] if r["state"] != "not installed"]
            if rows and all(r["healthy"] for r in rows):
                return status
            for r in rows:
                if r["restarts"] >= max_restarts and not r["healthy"]:
                    raise UpError(f"{r['component']} crashed {r['restarts']} times before becoming healthy "
                                  f"(last exit {r['last_exit']}); the end of {r['log']}:\n{log_tail(Path(r['log']))}")
        time.sleep(0.5)
    waiting = [r["component"] for r in (status or {}).get("components", [])
               if r["state"] not in ("not installed", "healthy")]
    raise UpError(f"not healthy within {timeout_s:.0f}s: {', '.join(waiting) or 'the supervisor'}; "
                  f"see {log_dir(settings)}")


def stop_supervisor(settings: Settings, timeout_s: float = 60.0) -> list[str]:
    """Stop the supervisor (it stops its children) and anything it left behind. Lines saying what stopped."""
    said = []
    pid = supervisor_pid(settings)
    status = read_status(settings) or {}
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
            said.append(f"supervisor (pid {pid}) did not stop in {timeout_s:.0f}s: killed")
        else:
            said.append(f"supervisor (pid {pid}) stopped")
    # Children of a supervisor that was SIGKILLed get SIGTERM from the kernel; make sure.
    for row in status.get("components", []):
        child = row.get("pid")
        if child and _is_tabloop(child):
            try:
                os.killpg(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
            said.append(f"{row['component']} (pid {child}) was left running: killed")
    (run_dir(settings) / PID_FILE).unlink(missing_ok=True)
    return said


def live_status(settings: Settings) -> dict:
    """What `tabloop status` shows: Kafka, then each component with its policy version and lag."""
    answering = broker_answers(settings)
    try:
        broker_pid = LocalKafka(settings).status().pid
    except KafkaLaunchError:  # not a local bootstrap: someone else's brokers
        broker_pid = None
    rows = [{"component": "kafka", "state": "healthy" if answering else "down", "pid": broker_pid,
             "healthy": answering, "restarts": None, "policy_version": None, "lag": None,
             "bootstrap": settings.kafka_bootstrap}]
    pid = supervisor_pid(settings)
    status = read_status(settings) if pid else None
    probes = Probes(settings)
    try:
        for row in (status or {}).get("components", []):
            row = dict(row)
            row["policy_version"] = None
            if row["component"] == "serve" and row["pid"]:
                body = probes.front_door()
                row["policy_version"] = body.get("policy_version") if body else None
            row["lag"] = probes.lag(row["group"]) if row.get("group") and answering and row["pid"] else None
            rows.append(row)
    finally:
        probes.close()
    healthy = answering and status is not None and all(
        r["healthy"] for r in rows if r["state"] != "not installed")
    return {"supervisor_pid": pid, "running": pid is not None, "healthy": healthy,
            "updated_at": (status or {}).get("updated_at"), "addresses": (status or {}).get("addresses"),
            "components": rows}


def format_table(status: dict) -> str:
    header = ("COMPONENT", "PID", "HEALTHY", "STATE", "RESTARTS", "POLICY", "LAG")
    rows = [header]
    for r in status["components"]:
        def show(v):
            return "-" if v is None else str(v)

        rows.append((r["component"], show(r["pid"]),
                     "-" if r["state"] == "not installed" else ("yes" if r["healthy"] else "no"), r["state"],
                     show(r.get("restarts")), show(r.get("policy_version")), show(r.get("lag"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"{r['component']}: {r['detail']}" for r in status["components"]
              if r.get("detail") and not r["healthy"] and r["state"] != "not installed"]
    if not status["running"]:
        lines.append("the supervisor is not running (`tabloop up` starts it)")
    return "\n".join(lines)
