"""Running a real `tabloop serve` (in a thread of the test process, or as a subprocess) for tests."""

from __future__ import annotations

import asyncio
import threading
import uuid


from infra.bus import read_topic
from infra.local import wait_ready


class ThreadServer:
    """serving.server.Server on free ports, in its own event loop thread."""

    def __init__(self, settings):
        from serving.server import Server

        self.server = Server(settings)
        self.completions_url = f"http://127.0.0.1:{self.server.ports[0]}"
        self.feedback_url = f"http://127.0.0.1:{self.server.ports[1]}"
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self._thread.start()
        if not wait_ready(f"{self.completions_url}/readyz", 60):
            raise RuntimeError("the server did not become ready")

    def stop(self) -> None:
        self.server.stop()
        self._thread.join(30)


def find_events(settings, topic: str, predicate, want: int = 1, timeout_s: float = 30.0) -> list:
    """Events on ``topic`` matching ``predicate``, polling until ``want`` are there (or the time is up)."""
    from tests.system_helpers import poll

    return poll(lambda: [r.event for r in read_topic(settings, topic) if r.event is not None and predicate(r.event)],
                lambda found: len(found) >= want, timeout_s, 0.3)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def start_door(kafka, model: str, tmp_path, **settings_overrides) -> ThreadServer:
    """A front door in this process on the session's broker: open auth, free ports, ``model``; the settings on
    ``.settings``."""
    from infra.bus import ensure_topics
    from tests.conftest import make_settings

    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap, model=model,
                             completions_port=0, feedback_port=0, auth="open", **settings_overrides)
    ensure_topics(settings)
    server = ThreadServer(settings)
    server.settings = settings
    return server


class ProcessServer:
    """`tabloop serve` as its own process, configured through TABLOOP_* variables like a user would."""

    def __init__(self, settings, **env_overrides):
        import os
        import subprocess
        import sys

        from infra.kafka_broker import free_port

        self.ports = (free_port(), free_port())
        from infra.settings import to_environ

        settings = settings.model_copy(update={"completions_port": self.ports[0], "feedback_port": self.ports[1]})
        env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **to_environ(settings),
               **env_overrides}
        self.completions_url = f"http://127.0.0.1:{self.ports[0]}"
        self.feedback_url = f"http://127.0.0.1:{self.ports[1]}"
        self.log = open(settings.state_dir / "serve.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "tabloop.cli", "serve"], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        if not wait_ready(f"{self.completions_url}/readyz", 120, self.proc):
            self.stop()
            raise RuntimeError(f"tabloop serve not ready: {(settings.state_dir / 'serve.log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except Exception:
                self.proc.kill()
        self.log.close()
