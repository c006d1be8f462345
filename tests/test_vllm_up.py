"""`tabloop up --engine vllm` (issue 43): the replicas tabloop supervises itself, without a real vLLM (the drill
in tests/test_vllm_drill.py runs one): which components, in which order, where the front door finds them,
when a replica counts as ready, and the errors a user sees."""

from __future__ import annotations

import http.server
import io
import subprocess
import sys
import threading

import pytest

from infra.kafka_broker import free_port
from infra.settings import to_environ
from infra.vllm_env import MANAGED_SERVED_NAME, managed_urls, manages_replicas, replica_command, warm_marker
from tabloop import supervisor as sv
from tests.conftest import make_settings
from tests.system_helpers import ROOT


def test_the_vllm_engine_with_no_replicas_named_gets_replicas_of_its_own_first(tmp_path):
    assert sv.components_for(make_settings(tmp_path)) == sv.COMPONENTS
    named = make_settings(tmp_path, engine="vllm", vllm_urls="http://gpu-box:8000")
    assert not manages_replicas(named) and sv.components_for(named) == sv.COMPONENTS

    managed = make_settings(tmp_path, engine="vllm", vllm_replicas=2, vllm_port=9100)
    components = sv.components_for(managed)
    assert [c.name for c in components] == ["vllm-0", "vllm-1", "serve", "streams", "trainer", "history"]
    assert components[1].command == ("vllm", "replica", "--index", "1") and components[1].health == "vllm"
    assert components[2].waits_for == ("vllm-0", "vllm-1")  # the front door starts once both are warm
    assert all(c.waits_for == () for c in components if c.name != "serve")
    assert managed_urls(managed) == ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]


def test_the_front_door_the_supervisor_starts_is_told_where_the_replicas_are(tmp_path):
    settings = make_settings(tmp_path, engine="vllm", vllm_port=9200)
    sup = sv.Supervisor(settings, out=io.StringIO())
    try:
        assert to_environ(sup.settings)["TABLOOP_VLLM_URLS"] == "http://127.0.0.1:9200"
        assert [c.component.name for c in sup.children][:2] == ["vllm-0", "serve"]
    finally:
        sup.probes.close()


def test_the_front_door_waits_for_its_replicas_only_before_its_first_start(tmp_path):
    settings = make_settings(tmp_path, engine="vllm")
    sup = sv.Supervisor(settings, out=io.StringIO())
    try:
        replica, serve = sup.children[0], sup.children[1]
        assert not sup._may_start(serve) and serve.detail == "waiting for vllm-0"
        assert sup._may_start(replica) and sup._may_start(sup.children[2])  # the others do not wait
        replica.state = "healthy"
        assert sup._may_start(serve)
        replica.state, serve.restarts = "unhealthy", 1  # a replica restarting does not hold a door's restart
        assert sup._may_start(serve)
    finally:
        sup.probes.close()


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 - the standard library's name
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_replica_is_ready_once_warm_and_answering(tmp_path):
    port = free_port()
    settings = make_settings(tmp_path, engine="vllm", vllm_port=port)
    run = tmp_path / "run"
    run.mkdir()
    ready, detail = sv.replica_ready(settings, run, 0)
    assert not ready and "warming up" in detail  # answering or not, no marker: not warm yet
    warm_marker(run, 0).write_text("123\n")
    ready, detail = sv.replica_ready(settings, run, 0)
    assert not ready and f"127.0.0.1:{port}/health" in detail  # nothing listens there
    server = http.server.HTTPServer(("127.0.0.1", port), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert sv.replica_ready(settings, run, 0) == (True, f"http://127.0.0.1:{port}/health answers 200")
        _Health.status = 503
        assert sv.replica_ready(settings, run, 0) == (False, f"http://127.0.0.1:{port}/health answered 503")
    finally:
        _Health.status = 200
        server.shutdown()


def test_a_managed_replica_runs_with_the_flags_the_engine_depends_on(tmp_path):
    cmd = replica_command(tmp_path / "python", "/models/tiny", port=9300, served_name=MANAGED_SERVED_NAME)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert value("--model") == "/models/tiny" and value("--port") == "9300" and value("--dtype") == "float32"
    assert value("--served-model-name") == MANAGED_SERVED_NAME
    assert value("--logprobs-mode") == "processed_logprobs" and "--enable-lora" in cmd


def _tabloop(settings, *args):
    return subprocess.run([sys.executable, "-m", "tabloop.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(settings.state_dir),
                                           **to_environ(settings)})


def test_a_replica_without_the_vllm_environment_says_how_to_make_it(tmp_path):
    settings = make_settings(tmp_path, engine="vllm", cache_dir=str(tmp_path / "cache"), model="unused")
    done = _tabloop(settings, "vllm", "replica", "--index", "0")
    assert done.returncode != 0
    assert "no vLLM environment in" in done.stderr and "tabloop vllm install" in done.stderr
    done = _tabloop(settings, "vllm", "replica", "--index", "3")
    assert done.returncode != 0 and "replica 3 of 1 (TABLOOP_VLLM_REPLICAS)" in done.stderr


@pytest.mark.parametrize("dtype", ["fp8", ""])
def test_a_replica_dtype_vllm_does_not_know_is_refused(tmp_path, dtype):
    with pytest.raises(Exception, match="vllm_dtype"):
        make_settings(tmp_path, vllm_dtype=dtype)
