"""`tabloop up` on a system that is already up: it says so and prints the running system's own addresses
(from its supervisor's status), not ones built from the caller's environment, and makes no key unless asked."""

from __future__ import annotations

import io
import os
import re
import threading

import httpx
import pytest
from click.testing import CliRunner

from tabloop import supervisor as sv
from infra.kafka_broker import free_port
from infra.local import KEY_PLACEHOLDER, client_host, endpoints
from infra.settings import to_environ
from infra.auth import KeyStore
from tests.conftest import make_settings
from tests.system_helpers import cli as _cli
from tests.system_helpers import processes_of as _processes_of
from tests.system_helpers import wait as _wait


def test_client_host_turns_wildcards_into_loopback():
    assert [client_host(h) for h in ("0.0.0.0", "::", "[::]", "127.0.0.1", "example.org", "::1", "")] == [
        "127.0.0.1", "[::1]", "[::1]", "127.0.0.1", "example.org", "[::1]", "127.0.0.1"]


def test_the_status_holds_the_addresses_the_supervisor_runs_with(tmp_path):
    settings = make_settings(tmp_path, serve_host="0.0.0.0", completions_port=18081, feedback_port=18082,
                             history_port=18084)
    snap = sv.Supervisor(settings, (), out=io.StringIO()).snapshot()
    assert snap["addresses"] == {
        "completions": "http://127.0.0.1:18081/v1", "feedback": "http://127.0.0.1:18082",
        "history": "http://127.0.0.1:18084", "auth": "keys", "kafka_bootstrap": settings.kafka_bootstrap,
        "state_dir": str(tmp_path.resolve())}


@pytest.fixture
def running(tmp_path, monkeypatch):
    """A real supervisor (no components: nothing to wait for) writing its status from settings of its own,
    and a caller whose environment says other ports, another host and open auth. The supervisor runs in
    this test's process, which is not a `tabloop` CLI: the check that the pid file's process is one is the
    only thing told otherwise."""
    state = tmp_path / "state"
    running = make_settings(state, serve_host="127.0.0.1", completions_port=free_port(),
                            feedback_port=free_port(), history_port=free_port(), auth="keys",
                            kafka_bootstrap=f"127.0.0.1:{free_port()}")
    caller = make_settings(state, serve_host="0.0.0.0", completions_port=free_port(), feedback_port=free_port(),
                           auth="open", kafka_bootstrap=running.kafka_bootstrap)
    sup = sv.Supervisor(running, (), out=io.StringIO())
    thread = threading.Thread(target=sup.run)
    thread.start()
    try:
        _wait(lambda: sv.read_status(running), 30, "the supervisor's first status")
        monkeypatch.setattr(sv, "_is_tabloop", lambda pid: pid == os.getpid())
        yield running, caller
    finally:
        sup.stop()
        thread.join(30)


def _up(settings, *args):
    """`tabloop up ARGS` in this process, with ``settings`` as its whole TABLOOP_* environment."""
    from tabloop.cli import main

    env = {k: None for k in os.environ if k.startswith("TABLOOP_")} | to_environ(settings)
    return CliRunner().invoke(main, ["up", *args], env=env, catch_exceptions=False)


def test_up_on_a_running_system_prints_its_addresses_and_makes_no_key(running):
    settings, caller = running
    result = _up(caller)
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"tabloop is already running (supervisor pid {os.getpid()}" in out and "nothing was started" in out
    real = endpoints(settings)
    assert f"apiBase: {real['completions']}" in out
    assert f"destination: {real['feedback']}/api/continue/events" in out
    assert f"completionTrackingUrl: {real['feedback']}/api/training/submit" in out
    # Nothing from the caller's environment: not its host, ports or auth mode.
    assert "0.0.0.0" not in out and "unused-in-open-mode" not in out
    assert str(caller.completions_port) not in out and str(caller.feedback_port) not in out
    assert f"apiKey: {KEY_PLACEHOLDER}" in out and "tabloop up --new-key" in out
    assert KeyStore(settings.keys_file).list() == []


def test_up_new_key_on_a_running_system_makes_one_key_for_it(running):
    settings, caller = running
    result = _up(caller, "--new-key")
    assert result.exit_code == 0, result.output
    key = re.search(r"apiKey: (tlk_\S+)", result.output).group(1)
    assert f"API key (project 'local'; shown once, only its hash is kept): {key}" in result.output
    [principal] = KeyStore(settings.keys_file).list()
    assert principal.project_id == "local"
    assert KeyStore(settings.keys_file).verify(key).key_id == principal.key_id


def test_up_in_the_foreground_uses_a_running_broker_and_leaves_it_running(kafka, tiny_model, tmp_path):
    """`tabloop up --foreground` next to a broker someone else runs: it uses that broker, serves, and on
    SIGTERM stops everything it started and nothing else; `tabloop down` then leaves the broker alone too."""
    import signal
    import subprocess
    import sys

    from infra.bus import broker_answers
    from tests.system_helpers import ROOT
    from tests.system_helpers import env as _env

    state = tmp_path / "state"
    settings = make_settings(state, kafka_bootstrap=kafka.settings.kafka_bootstrap, completions_port=free_port(),
                             feedback_port=free_port(), history_port=free_port(), model=tiny_model)
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tabloop.cli", "up", "--foreground"], env=_env(settings),
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: "apiBase:" in log.read_text(errors="replace") or proc.poll() is not None, 300,
              "the foreground system to be healthy", explain=lambda: log.read_text(errors="replace")[-3000:])
        printed = log.read_text(errors="replace")
        assert proc.poll() is None, printed[-3000:]
        assert f"Kafka answers on {settings.kafka_bootstrap}" in printed
        key = re.search(r"apiKey: (tlk_\S+)", printed).group(1)
        resp = httpx.post(f"http://127.0.0.1:{settings.completions_port}/v1/completions",
                          headers={"Authorization": f"Bearer {key}"}, json={"prompt": "x = ", "max_tokens": 2},
                          timeout=60)
        assert resp.status_code == 200, resp.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    said = log.read_text(errors="replace")
    assert "Kafka stopped" not in said and ("none of ours was running" in said or "is not ours" in said), said[-2000:]
    # Everything of its state dir ends with it (a component's helpers may take a moment after their leader).
    _wait(lambda: _processes_of(state) == [], 30, "no process of the state dir left",
          explain=lambda: "\n".join(f"{pid}: {_cmdline(pid)}" for pid in _processes_of(state)))
    assert broker_answers(kafka.settings)
    down = _cli(settings, "down", timeout=120)
    assert down.returncode == 0 and "Kafka stopped" not in down.stdout, down.stdout + down.stderr
    assert broker_answers(kafka.settings)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"
