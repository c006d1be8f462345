"""`tabloop serve`: one process, two ports, one engine, one publisher, the weight watcher."""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from infra.bus import make_codec
from infra.http_server import bind, guarded_protocol
from infra.settings import Settings
from serving.app import FrontDoor
from serving.engines import Engine, make_engine
from serving.gates import GateWatcher
from serving.publisher import EventPublisher
from serving.weights import WeightWatcher

log = logging.getLogger("tabloop.serve")


class Server:
    """Both apps on their sockets in one event loop. ``ports`` is known once bound (port 0 = any free)."""

    def __init__(self, settings: Settings, engine: Engine | None = None, publisher: EventPublisher | None = None):
        self.settings = settings
        self.engine = engine or make_engine(settings)
        self.publisher = publisher or EventPublisher(settings, make_codec(settings))
        self.gates = GateWatcher(settings) if settings.show_gate else None
        self.front_door = FrontDoor(settings, self.engine, self.publisher, gates=self.gates)
        self.sockets = (bind(settings.serve_host, settings.completions_port),
                        bind(settings.serve_host, settings.feedback_port))
        self.ports = tuple(s.getsockname()[1] for s in self.sockets)
        self._servers: list[uvicorn.Server] = []
        self.watcher = None

    async def serve(self) -> None:
        await self.engine.start()
        self.watcher = WeightWatcher(self.settings, self.engine)
        self.watcher.start()
        if self.gates is not None:
            self.gates.start()
        apps = (self.front_door.completions_app(), self.front_door.feedback_app())
        for app in apps:
            # ws="none": no route takes a WebSocket, and an upgraded connection would leave the guard.
            config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=5, http=guarded_protocol(self.settings), ws="none")
            self._servers.append(uvicorn.Server(config))
        log.info("completions on http://%s:%d/v1, feedback on http://%s:%d", self.settings.serve_host,
                 self.ports[0], self.settings.serve_host, self.ports[1])
        try:
            await asyncio.gather(*(srv.serve(sockets=[sock]) for srv, sock in zip(self._servers, self.sockets)))
        finally:
            await self.watcher.stop()
            if self.gates is not None:
                await asyncio.to_thread(self.gates.stop)
            await self.engine.close()
            await asyncio.to_thread(self.publisher.close)
            self.publisher.codec.close()  # the registry client, if any

    def stop(self) -> None:
        for srv in self._servers:
            srv.should_exit = True
