"""The trainer's head reader (trainer/head_feed.py) when the broker is down: it waits, it does not crash the trainer,
and it seeks again once the broker answers."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from confluent_kafka import Producer

from infra.bus import ensure_topics
from infra.kafka_broker import free_port
from schemas.topics import EPISODES
from tests.conftest import make_settings
from trainer import head_feed
from trainer.head_feed import HeadFeed

pytestmark = pytest.mark.kafka
RETRY_S = 2.0  # the retry interval here (10 s in production): the rule is the same, the wait shorter


class LateDoor:
    """A port on which nothing answers until ``open()``; then it forwards every connection to the session's
    broker (the bootstrap a client starts from: the broker's metadata then names the broker itself)."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.port = free_port()
        self.sock: socket.socket | None = None

    def open(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def test_a_seek_with_the_broker_down_is_retried_later_not_raised(kafka, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(head_feed, "RETRY_S", RETRY_S)
    ensure_topics(kafka.settings)
    door = LateDoor(kafka.settings.kafka_bootstrap)
    settings = make_settings(tmp_path, kafka_bootstrap=f"127.0.0.1:{door.port}")  # nothing listens there yet
    feed = HeadFeed(settings, EPISODES.name, f"g-{tmp_path.name}")
    try:
        feed.follow(None, at_head=True)
        failed_at = time.monotonic()
        assert feed.covered_from_ms is None and feed.poll() == []
        assert "cannot seek tabloop.episodes" in caplog.text
        caplog.clear()
        feed.follow(None, at_head=True)  # within the retry interval: no second try (each costs seconds)
        assert "cannot seek" not in caplog.text and feed.covered_from_ms is None

        door.open()  # the broker is back
        time.sleep(max(0.0, failed_at + RETRY_S - time.monotonic()))
        deadline = time.monotonic() + 60
        while feed.covered_from_ms is None and time.monotonic() < deadline:
            feed.follow(None, at_head=True)  # the trainer's loop calls it every round
            time.sleep(0.2)
        assert feed.covered_from_ms is not None, f"no seek after the broker came back:\n{caplog.text[-2000:]}"

        # Reading from the head: an episode published now arrives.
        marker = f"head-feed-{tmp_path.name}".encode()
        producer = Producer({"bootstrap.servers": kafka.settings.kafka_bootstrap})
        producer.produce(EPISODES.name, key=marker, value=marker)
        assert producer.flush(10) == 0
        seen, deadline = [], time.monotonic() + 30
        while marker not in seen and time.monotonic() < deadline:
            seen += [m.key() for m in feed.poll()]
            time.sleep(0.1)
        assert marker in seen
    finally:
        feed.close()
        door.close()
