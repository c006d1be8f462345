"""`tabloop up|status|down` as a user runs them: real processes, a real broker, the openai client.

The long run (its own broker, every component, crashes and restarts) is a drill; the component table,
the back-off and the status table are checked here by hand.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from tabloop import supervisor as sv
from infra.kafka_broker import free_port, pid_alive
from schemas.topics import EPISODES
from tests.conftest import TEST_PARTITIONS, make_settings
from tests.serving_helpers import find_events
from tests.system_helpers import cli as _cli
from tests.system_helpers import explain_system
from tests.system_helpers import processes_of as _processes_of
from tests.system_helpers import row as _row
from tests.system_helpers import status as _status
from tests.system_helpers import supervising
from tests.system_helpers import wait as _wait

ROOT = Path(__file__).resolve().parent.parent


def test_back_off_doubles_from_one_second_up_to_a_minute():
    assert [sv.restart_delay(n) for n in range(0, 9)] == [0, 1, 2, 4, 8, 16, 32, 60, 60]
    assert sv.restart_delay(3, base_s=0.5, max_s=1.5) == 1.5 and sv.restart_delay(2, base_s=0.5) == 1.0


def test_the_supervised_worker_keeps_one_static_member_id_across_restarts_and_another_system_has_another(tmp_path):
    # The same id at every restart is what lets a successor take a SIGKILLed worker's place at once; two
    # systems (state dirs) on one broker with one id would fence each other's workers.
    one = make_settings(tmp_path / "one", kafka_bootstrap="127.0.0.1:9092")
    again = make_settings(tmp_path / "one", kafka_bootstrap="127.0.0.1:9092")
    other = make_settings(tmp_path / "other", kafka_bootstrap="127.0.0.1:9092")
    assert sv.streams_instance_id(one) == sv.streams_instance_id(again)
    assert sv.streams_instance_id(one) != sv.streams_instance_id(other)
    assert re.fullmatch(r"tabloop-streams-[0-9a-f]{12}", sv.streams_instance_id(one))
    # and the setting accepts what it makes (the supervisor passes it as TABLOOP_STREAMS_INSTANCE_ID)
    assert make_settings(tmp_path, streams_instance_id=sv.streams_instance_id(one)).streams_instance_id


def test_the_table_runs_registered_commands_and_skips_the_rest(tmp_path):
    from tabloop.cli import COMMANDS

    assert {c.command[0] for c in sv.COMPONENTS} >= {"serve", "streams"}
    assert all(c.command[0] in COMMANDS for c in sv.COMPONENTS if c.name in ("serve", "streams"))
    ghost = sv.Component("ghost", ("no-such-command",), health="alive")
    sup = sv.Supervisor(make_settings(tmp_path), (sv.COMPONENTS[0], ghost), commands=COMMANDS)
    states = {c.component.name: c.state for c in sup.children}
    assert states == {"serve": "starting", "ghost": "not installed"}
    assert sup.all_healthy() is False  # serve has not started; the ghost does not count


def test_status_table_and_json_when_nothing_runs(tmp_path):
    settings = make_settings(tmp_path, kafka_bootstrap=f"127.0.0.1:{free_port()}")
    st = sv.live_status(settings)
    assert st["running"] is False and st["healthy"] is False
    assert [r["component"] for r in st["components"]] == ["kafka"] and st["components"][0]["healthy"] is False
    table = sv.format_table(st)
    assert table.splitlines()[0].split() == ["COMPONENT", "PID", "HEALTHY", "STATE", "RESTARTS", "POLICY", "LAG"]
    assert "the supervisor is not running" in table
    # Why a component is not healthy is printed under the table.
    st = {"running": True, "components": [
        {"component": "streams", "pid": 7, "healthy": False, "state": "unhealthy", "restarts": 0,
         "detail": "group tabloop-streams PREPARING_REBALANCING, 2 member(s), 1 joined since this start"},
        {"component": "serve", "pid": 8, "healthy": True, "state": "healthy", "restarts": 0, "detail": "answers"}]}
    assert sv.format_table(st).splitlines()[3:] == [
        "streams: group tabloop-streams PREPARING_REBALANCING, 2 member(s), 1 joined since this start"]
    proc = _cli(settings, "status", "--json")
    assert proc.returncode == 1 and json.loads(proc.stdout)["running"] is False


def test_a_dead_child_keeps_its_pid_until_the_tick_that_counts_its_exit(tmp_path):
    """A status snapshot is the supervisor's own bookkeeping at one moment: a child that died since the last
    tick still shows its pid, state and restart count; the tick that sees the exit changes all three."""
    settings = make_settings(tmp_path)
    sup = sv.Supervisor(settings, (sv.Component("quitter", ("kafka", "status"), health="alive", grace_s=30),),
                        out=io.StringIO())
    sup.run_dir.mkdir(parents=True)
    sup.log_dir.mkdir(parents=True)
    [child] = sup.children
    try:
        sup.tick()
        pid = child.proc.pid
        child.proc.wait(60)
        [row] = sup.snapshot()["components"]
        assert (row["pid"], row["restarts"], row["state"]) == (pid, 0, "starting")
        sup.tick()
        [row] = sup.snapshot()["components"]
        assert (row["pid"], row["restarts"], row["state"], row["healthy"]) == (None, 1, "backoff", False)
        assert re.fullmatch(r"exited \(code \d+\); restarting in 1s", row["detail"])
    finally:
        child.reader.join(10)
        sup.probes.close()


@pytest.mark.kafka
def test_children_are_logged_prefixed_restarted_with_back_off_and_stopped(kafka, tmp_path):
    """The real supervisor on real `tabloop` children: one that never stays up (`kafka status` exits at once),
    one that runs until killed (`events dump --follow`), SIGKILLed mid-run."""
    from infra.bus import ensure_topics

    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap)
    ensure_topics(settings)
    table = (sv.Component("quitter", ("kafka", "status"), health="alive", grace_s=30),
             sv.Component("follower", ("events", "dump", "tabloop.weights", "--follow"), health="alive",
                          grace_s=1))
    with supervising(settings, table) as (sup, out):
        quitter, follower = sup.children
        _wait(lambda: quitter.restarts >= 3, 30, "three restarts of the quitter")
        _wait(lambda: follower.healthy and follower.pid, 30, "the follower to be healthy")
        status = sv.read_status(settings)
        assert [r["component"] for r in status["components"]] == ["quitter", "follower"]
        assert status["supervisor_pid"] == os.getpid() and sv.supervisor_pid(settings) is None  # not a CLI
        old = follower.pid
        os.kill(old, signal.SIGKILL)
        _wait(lambda: follower.pid not in (None, old) and follower.restarts == 1, 30, "the follower restarted")
        _wait(lambda: follower.healthy and follower.pid, 30, "the restarted follower to be healthy")
        assert follower.last_exit == -signal.SIGKILL and quitter.healthy is False
        pids = [follower.pid]
    assert all(not pid_alive(p) for p in pids)
    assert {c.state for c in sup.children} == {"stopped"}
    log = out.getvalue()
    # Exits in a row wait 1 s, 2 s, 4 s …: the quitter never ran long enough to start over.
    delays = [int(d) for d in re.findall(r"quitter exited \(code \d+\) after [\d.]+s; restarting in (\d+)s", log)]
    assert delays[:3] == [1, 2, 4], log
    assert re.search(r"follower exited \(signal 9\) after [\d.]+s; restarting in 1s \(restart #1\)", log)
    assert re.search(r"^quitter   \| Kafka ", log, re.M)  # its output, prefixed with its name
    assert "Kafka " in (tmp_path / "logs" / "quitter.log").read_text()


@pytest.mark.kafka
def test_lag_does_not_count_commit_markers(kafka, tmp_path):
    """Episodes are written in transactions: each ends with a commit marker no reader gets. A reader that
    committed after its last record is caught up (lag 0), and records it has not read count one each."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from infra.bus import ensure_topics

    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap)
    ensure_topics(settings)
    group = f"lag-{os.getpid()}-{tmp_path.name}"
    writer = Producer({"bootstrap.servers": settings.kafka_bootstrap, "transactional.id": group})
    writer.init_transactions(30)

    def write_transaction(n: int) -> list[int]:
        """The offsets of its records, as delivered."""
        offsets: list[int] = []
        writer.begin_transaction()
        for i in range(n):
            writer.produce(EPISODES.name, value=f"{group}-{i}".encode(), partition=0,
                           on_delivery=lambda err, msg: offsets.append(msg.offset()))
        writer.commit_transaction(30)  # flushes: every delivery report is in
        return offsets

    first = write_transaction(3)
    reader = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": group,
                       "enable.auto.commit": False, "isolation.level": "read_committed"})
    probes = sv.Probes(settings)
    try:
        reader.assign([TopicPartition(EPISODES.name, 0, min(first))])  # the 3 records, then their marker
        got = [m for m in (reader.poll(10) for _ in range(3)) if m is not None and not m.error()]
        assert [m.value() for m in got] == [f"{group}-{i}".encode() for i in range(3)]
        reader.commit(message=got[-1], asynchronous=False)  # offset after the last record: the marker's

        def answered_lag():  # "unknown" (None) until the probe process is connected
            return _wait(lambda: [n for n in [probes.lag(group)] if n is not None], 30, "an answer")[0]

        assert answered_lag() == 0
        write_transaction(2)
        # The end a read_committed reader reaches moves once the broker has written the commit markers,
        # a moment after commit_transaction returns: until then the lag is still 0.
        _wait(lambda: probes.lag(group) == 2, 30, "a lag of 2")
        assert answered_lag() == 2
    finally:
        reader.close()
        probes.close()


@pytest.mark.kafka
def test_lag_with_internal_topics_counts_what_waits_between_stages_but_not_ticks(kafka, tmp_path):
    """A worker that committed all of its input may still hold records in its own topics between stages:
    ``tabloop status`` leaves those out, the tests' "settled" rule (``tests/system_helpers.Quiet``) counts
    them. The worker's clock ticks never stand still at 0, so they are not counted."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from infra.bus import ensure_topics
    from schemas.topics import COMPLETIONS, TICK_KEY, Topic

    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap)
    group = f"stages-{os.getpid()}-{tmp_path.name}"
    between = f"{group}-by-prompt"
    ensure_topics(settings, (COMPLETIONS, Topic(between, "(internal)", {})))
    writer = Producer({"bootstrap.servers": settings.kafka_bootstrap})
    delivered: dict[str, list[int]] = {}

    def write(topic, key, value):
        writer.produce(topic, value=value, key=key, partition=0,
                       on_delivery=lambda err, msg: delivered.setdefault(msg.topic(), []).append(msg.offset()))

    write(COMPLETIONS.name, b"k", b"input")
    for _ in range(250):  # a worker minutes behind on its ticks, as on a loaded machine: still only ticks
        write(between, TICK_KEY, b"{}")
    write(between, b"k", b"waiting between stages")
    write(between, TICK_KEY, b"{}")
    assert writer.flush(30) == 0
    reader = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": group, "enable.auto.commit": False})
    probes = sv.Probes(settings)
    try:
        # All of the input read; between the stages, nothing yet.
        reader.commit(offsets=[TopicPartition(COMPLETIONS.name, 0, max(delivered[COMPLETIONS.name]) + 1),
                               TopicPartition(between, 0, min(delivered[between]))], asynchronous=False)
        assert _wait(lambda: [n for n in [probes.lag(group)] if n is not None], 30, "an answer")[0] == 0
        assert probes.lag(group, internal=True) == 1  # the record, not the 251 ticks
        assert probes.kafka.ask("lag", group, True, True) == ({between: 1}, 1)  # where, for a test's message
        reader.commit(offsets=[TopicPartition(between, 0, max(delivered[between]) + 1)], asynchronous=False)
        assert probes.lag(group, internal=True) == 0
    finally:
        reader.close()
        probes.close()


@pytest.mark.kafka
def test_kafka_probes_run_in_a_process_whose_death_the_caller_survives(kafka, tmp_path):
    """librdkafka aborts the process when the broker goes away during a coordinator request; the supervisor
    asks in a child process instead, so an abort there (here: SIGABRT, and a child that hangs) costs one answer."""
    from confluent_kafka import Consumer

    from infra.bus import ensure_topics

    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap)
    ensure_topics(settings)
    group = f"probe-{os.getpid()}-{tmp_path.name}"
    consumer = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": group})
    consumer.subscribe([EPISODES.name])
    probes = sv.Probes(settings)
    try:
        _, members = _wait(lambda: (a := probes.group_state(group))[0] == "STABLE" and a, 60, "the group to be stable")
        assert len(members) == 1
        # Ready: Stable with a member that joined since; not while only the members seen before are there.
        seen = f"group {group} STABLE, 1 member(s), {{}} joined since this start"
        assert probes.group_ready(group, set()) == (True, seen.format(1))
        assert probes.group_ready(group, members) == (False, seen.format(0))
        first = probes.kafka._proc.pid
        os.kill(first, signal.SIGABRT)  # what the librdkafka assertion does
        _wait(lambda: not pid_alive(first), 10, "the probe process to die")
        # A new probe process answers (its first question may come before it is connected: "unknown").
        _wait(lambda: probes.group_state(group) == ("STABLE", members), 60, "a new probe process to answer")
        assert probes.kafka.restarts == 1 and probes.kafka._proc.pid != first
    finally:
        consumer.close()
        probes.close()
    # Nobody answers on this port: no answer in time is "unknown", and the hung child is ended.
    dead = sv.Probes(make_settings(tmp_path, kafka_bootstrap=f"127.0.0.1:{free_port()}"))
    dead.kafka.timeout_s = 1.0
    try:
        assert dead.lag("any") is None
        assert dead.group_state("any") == ("unknown: no answer from the probe process", set())
        assert dead.kafka._proc is None  # discarded, not left behind
    finally:
        dead.close()


@pytest.mark.kafka
def test_failed_kafka_questions_get_a_fresh_probe_process_and_no_hung_restart(kafka, tmp_path):
    """A probe process whose requests keep failing is replaced after ``fresh_after`` of them (a stuck
    librdkafka client); and a worker is restarted as hung only for what Kafka answered, not while it is
    silent (an outage is not the worker's fault)."""
    silent = make_settings(tmp_path / "silent", kafka_bootstrap=f"127.0.0.1:{free_port()}")
    probes = sv.Probes(silent)
    try:
        for _ in range(3):  # Kafka's own failure, answered by the child: not "no answer from the probe process"
            state, members = probes.group_state("any")
            assert state.startswith("unknown: ") and "probe process" not in state and members == set()
        assert probes.kafka._proc is None and probes.kafka.restarts == 0  # discarded after the third
        probes.group_state("any")
        assert probes.kafka.restarts == 1 and probes.kafka._proc is not None
    finally:
        probes.close()

    # A worker unhealthy for longer than HUNG_RESTART_S, its group empty: restarted when Kafka says so.
    answering = make_settings(tmp_path / "up", kafka_bootstrap=kafka.settings.kafka_bootstrap)
    for settings, restarted in ((silent, False), (answering, True)):
        worker = sv.Component("worker", ("streams",), health="group", group=f"absent-{os.getpid()}-{tmp_path.name}")
        sup = sv.Supervisor(settings, (worker,), out=io.StringIO())
        [child] = sup.children
        child.proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
        now = child.started_at = time.monotonic()
        child.ready_since, child.unready_since, child.state = now - 1000, now - sv.HUNG_RESTART_S - 1, "unhealthy"
        try:
            sup._probe(now)
            assert child.state == "unhealthy" and child.detail.startswith(f"group {worker.group} ")
            if restarted:
                assert child.proc.wait(10) == -signal.SIGKILL
            else:  # not killed, and the clock starts again: HUNG_RESTART_S of Kafka's answers are needed
                assert child.proc.poll() is None and child.unready_since == now
        finally:
            child.proc.kill()
            child.proc.wait()
            sup.probes.close()


@pytest.mark.kafka
def test_children_end_when_the_supervisor_itself_is_sigkilled(kafka, tmp_path):
    """A supervisor killed outright (SIGKILL, the OOM killer) runs no cleanup; its children still end
    (PR_SET_PDEATHSIG: the kernel sends each SIGTERM), so no component outlives it holding ports or groups."""
    import sys

    from infra.bus import ensure_topics
    from infra.settings import to_environ

    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap)
    ensure_topics(settings)
    program = ("from infra.settings import load_settings; from tabloop import supervisor as sv; "
               "sv.Supervisor(load_settings(), (sv.Component('follower', ('events', 'dump', 'tabloop.weights', "
               "'--follow'), health='alive', grace_s=1),)).run()")
    supervisor = subprocess.Popen([sys.executable, "-c", program], cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env={**os.environ, **to_environ(settings)},
                                  start_new_session=True)
    child = None
    try:
        def running_child():
            st = sv.read_status(settings)
            return st and st["supervisor_pid"] == supervisor.pid and st["components"][0]["healthy"] \
                and st["components"][0]["pid"]

        child = _wait(running_child, 60, "the supervisor's child to run")
        assert pid_alive(child)
        supervisor.kill()
        assert supervisor.wait(10) == -signal.SIGKILL
        _wait(lambda: not pid_alive(child), 30, f"the orphaned child {child} to end")
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
        if child and pid_alive(child):
            os.killpg(child, signal.SIGKILL)


@pytest.mark.kafka
def test_a_front_door_that_stops_answering_is_restarted(kafka, tiny_model, tmp_path, monkeypatch):
    """The supervisor's liveness probe: a front door that was healthy and then stops answering /readyz (here
    SIGSTOPped: alive, its port open, nothing answered) is killed after HUNG_RESTART_S and started again."""
    from infra.bus import ensure_topics

    monkeypatch.setattr(sv, "HUNG_RESTART_S", 4.0)  # the rule under test; 120 s in production
    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap, model=tiny_model,
                             completions_port=free_port(), feedback_port=free_port(), auth="open")
    ensure_topics(settings)
    serve = next(c for c in sv.COMPONENTS if c.name == "serve")
    stopped = None
    try:
        with supervising(settings, (serve,)) as (sup, out):
            [door] = sup.children
            _wait(lambda: door.healthy and door.pid, 180, "the front door to be healthy",
                  explain=lambda: out.getvalue()[-3000:])
            stopped = door.pid
            os.kill(stopped, signal.SIGSTOP)
            _wait(lambda: door.restarts == 1 and door.pid not in (None, stopped), 60, "the hung front door restarted",
                  explain=lambda: out.getvalue()[-3000:])
            assert door.last_exit == -signal.SIGKILL and not pid_alive(stopped)
            assert re.search(r"serve has been unhealthy for 4s \(no 200 from http://[\d.]+:\d+/readyz\); restarting it",
                             out.getvalue()), out.getvalue()[-3000:]
            _wait(lambda: door.healthy, 180, "the restarted front door to be healthy",
                  explain=lambda: out.getvalue()[-3000:])
            assert httpx.get(sup.probes.ready_url, timeout=10).status_code == 200
    finally:
        if stopped and pid_alive(stopped):
            os.kill(stopped, signal.SIGKILL)


# -- the whole system, as `make up` runs it -------------------------------------------------------


@pytest.mark.drill
def test_up_serves_learns_restarts_and_down_leaves_nothing(tiny_model, tmp_path):
    """The whole system with the tiny model: up, a second `up` from another environment reports the first,
    a completion and its feedback become an episode, crashed components come back, down leaves nothing. (One
    system for all of it: each start of the whole system costs the drills' budget minutes.)"""
    # The tiny model: with none configured `up` first pretrains the demo model for 8 minutes, which ate this
    # test's whole 600 s (the README's fresh-clone `make up` is where that path was checked).
    from infra.auth import KeyStore
    from tests.test_file_modes import loose

    state = tmp_path / "state"
    settings = make_settings(state, kafka_bootstrap=f"127.0.0.1:{free_port()}", completions_port=free_port(),
                             feedback_port=free_port(), history_port=free_port(), topic_partitions=TEST_PARTITIONS,
                             model=tiny_model)  # no default port: a developer's `tabloop up` may hold it
    caller = settings.model_copy(update={"serve_host": "0.0.0.0", "auth": "open", "completions_port": free_port()})
    try:
        up = _cli(settings, "up", timeout=300)  # inside the test's 600 s, with time left for the rest
        assert up.returncode == 0, up.stdout + up.stderr
        key = re.search(r"apiKey: (tlk_\S+)", up.stdout).group(1)
        assert f"apiBase: http://127.0.0.1:{settings.completions_port}/v1" in up.stdout
        assert f"completionTrackingUrl: http://127.0.0.1:{settings.feedback_port}/api/training/submit" in up.stdout
        assert f"destination: http://127.0.0.1:{settings.feedback_port}/api/continue/events" in up.stdout
        token = (state / "history.token").read_text().strip()
        assert f"dashboard http://127.0.0.1:{settings.history_port}/#token={token}" in up.stdout

        # A second `up`, from an environment that names other addresses: it reports the running system's own
        # addresses (from its supervisor's status) and makes no second key.
        again = _cli(caller, "up", timeout=120)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "tabloop is already running" in again.stdout
        assert f"apiBase: http://127.0.0.1:{settings.completions_port}/v1" in again.stdout
        assert "0.0.0.0" not in again.stdout and "unused-in-open-mode" not in again.stdout
        assert re.search(r"tlk_", again.stdout) is None and len(KeyStore(settings.keys_file).list()) == 1

        status = _status(settings)
        assert status["healthy"] and status["running"]
        for name in ("kafka", "serve", "streams"):
            assert _row(status, name)["healthy"] and _row(status, name)["pid"], status
        assert _row(status, "serve")["policy_version"] == 0
        table = _cli(settings, "status")
        assert table.returncode == 0 and re.search(r"^serve\s+\d+\s+yes\s+healthy", table.stdout, re.M)

        # A streamed completion with the printed key, then feedback on it becomes an episode.
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{settings.completions_port}/v1", api_key=key,
                               max_retries=0)
        chunks = list(client.completions.create(model="tabloop", prompt="def add(a, b):\n", max_tokens=6,
                                                stream=True))
        assert len(chunks) >= 2 and len({c.id for c in chunks}) == 1
        completion_id = chunks[0].id
        fb = httpx.post(f"http://127.0.0.1:{settings.feedback_port}/v1/feedback",
                        headers={"Authorization": f"Bearer {key}"},
                        json={"completion_id": completion_id, "accepted": True})
        assert fb.status_code == 202, fb.text
        [episode] = find_events(settings, EPISODES.name, lambda e: e.record["completion_id"] == completion_id,
                                timeout_s=90)
        assert episode.record["outcome"] == "ACCEPTED" and episode.record["matched"] is True
        _wait(lambda: _row(_status(settings), "streams")["lag"] == 0, 60, "the streams worker's lag to be 0")

        # SIGKILL the streams worker, then the front door twice: each comes back, with a growing back-off.
        old = _row(status, "streams")["pid"]
        os.kill(old, signal.SIGKILL)
        row = _wait(lambda: (r := _row(_status(settings), "streams"))["healthy"] and r["pid"] not in (None, old) and r,
                    120, "streams to be restarted and healthy", explain=lambda: explain_system(settings))
        assert row["restarts"] == 1 and row["last_exit"] == -signal.SIGKILL
        for expected_delay in (1, 2):
            old = _row(_status(settings), "serve")["pid"]
            os.kill(old, signal.SIGKILL)
            row = _wait(lambda: (r := _row(_status(settings), "serve"))["healthy"]
                        and r["pid"] not in (None, old) and r, 120, "serve to be restarted and healthy",
                        explain=lambda: explain_system(settings))
        assert row["restarts"] == 2
        log = (state / "logs" / "supervisor.log").read_text()
        assert re.search(r"serve exited \(signal 9\) after [\d.]+s; restarting in 1s \(restart #1\)", log)
        assert re.search(r"serve exited \(signal 9\) after [\d.]+s; restarting in 2s \(restart #2\)", log)
        assert re.search(r"^streams\s+\| ", log, re.M) and re.search(r"^serve\s+\| ", log, re.M)  # prefixed
        assert (state / "logs" / "serve.log").stat().st_size > 0
        # The restarted front door serves with the same key.
        again = client.completions.create(model="tabloop", prompt="x = ", max_tokens=3)
        assert again.id.startswith("cmpl-") and again.id != completion_id

        pids = [_row(_status(settings), n)["pid"] for n in ("kafka", "serve", "streams")]
        assert all(pids) and _processes_of(state)
        # Secrets stay secret on the whole running system: nothing under the state dir is open to others, and
        # no log holds the dashboard token.
        assert loose(state) == {}
        for log_file in (state / "logs").glob("*.log"):
            assert token not in log_file.read_text(errors="replace"), log_file
    finally:
        down = _cli(settings, "down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped" in down.stdout and "Kafka stopped" in down.stdout
    assert _processes_of(state) == []
    assert _cli(settings, "status").returncode == 1


def test_up_refuses_ports_in_use_before_starting_anything(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = make_settings(tmp_path / "state", kafka_bootstrap=f"127.0.0.1:{free_port()}",
                                 completions_port=port, feedback_port=free_port())
        up = _cli(settings, "up")
    assert up.returncode == 1 and f"port(s) {port} on 127.0.0.1 are in use" in up.stderr
    assert not (tmp_path / "state" / "kafka").exists() and not (tmp_path / "state" / "run").exists()


def test_model_processes_split_the_cores_when_front_door_and_trainer_share_them(tmp_path):
    settings = make_settings(tmp_path)
    both = ["serve", "streams", "trainer", "history"]
    assert sv.torch_threads_each(settings, both, cpus=2) == 1
    assert sv.torch_threads_each(settings, both, cpus=16) == 8
    assert sv.torch_threads_each(settings, both, cpus=1) == 1
    assert sv.torch_threads_each(settings, ["serve", "streams"], cpus=16) == 0  # alone: torch's default
    assert sv.torch_threads_each(settings.model_copy(update={"engine": "vllm"}), both, cpus=16) == 0
    assert sv.torch_threads_each(settings.model_copy(update={"torch_threads": 3}), both, cpus=16) == 3

    from infra.settings import to_environ

    supervisor = sv.Supervisor(settings, out=io.StringIO())
    each = max(1, sv.usable_cpus() // 2)
    assert supervisor.settings.torch_threads == each
    assert to_environ(supervisor.settings)["TABLOOP_TORCH_THREADS"] == str(each)  # what every child is given
    no_trainer = sv.Supervisor(settings, out=io.StringIO(), commands={"serve", "streams", "history"})
    assert no_trainer.settings.torch_threads == 0


def test_the_front_door_engine_takes_its_thread_share(tmp_path, tiny_model):
    import torch

    from serving.engines import make_engine

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        make_engine(make_settings(tmp_path, model=tiny_model, device="cpu", torch_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
