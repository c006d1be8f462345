"""Running a real `tabloop serve` (in a thread of the test process, or as a subprocess) for tests."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx

from infra.bus import read_topic


class ThreadServer:
    """serving.server.Server on free ports, in its own event loop thread."""

    def __init__(self, settings):
        from serving.server import Server

        self.server = Server(settings)
        self.completions_url = f"http://127.0.0.1:{self.server.ports[0]}"
        self.feedback_url = f"http://127.0.0.1:{self.server.ports[1]}"
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.completions_url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the server did not become ready")

    def stop(self) -> None:
        self.server.stop()
        self._thread.join(30)


def find_events(settings, topic: str, predicate, want: int = 1, timeout_s: float = 30.0) -> list:
    """Events on ``topic`` matching ``predicate``, polling until ``want`` are there (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [r.event for r in read_topic(settings, topic) if r.event is not None and predicate(r.event)]
        if len(found) >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.3)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"
