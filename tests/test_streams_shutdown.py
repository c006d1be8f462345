"""`tabloop streams` stops on SIGTERM even when Kafka went away first (issue 14): a supervisor, systemd or
Kubernetes sends SIGTERM and kills after a grace period; a worker that hangs there is killed mid-write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from infra.bus import ensure_topics
from infra.settings import to_environ
from tests.conftest import make_settings

pytestmark = pytest.mark.kafka

GRACE_S = 45  # what the issue measured against: Kubernetes' default is 30, the supervisor's is less


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


@pytest.mark.timeout(300)
def test_streams_exits_on_sigterm_after_kafka_stopped(own_kafka, tmp_path):
    settings = make_settings(tmp_path, kafka_bootstrap=own_kafka.settings.kafka_bootstrap)
    ensure_topics(settings)
    log_path = tmp_path / "streams.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tabloop.cli", "streams"], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **to_environ(settings)})
    try:
        # Faust's worker logs "Ready" once it has joined the group and its agents run.
        _wait_for(lambda: b"Ready" in log_path.read_bytes() or proc.poll() is not None, 150, "the worker to start")
        assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
        own_kafka.stop()
        time.sleep(3)  # the worker notices: its connections fail and its clients start retrying
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if "rdkafka" not in ln]
            pytest.fail(f"still running {GRACE_S}s after SIGTERM with Kafka stopped:\n" + "\n".join(lines[-40:]))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
