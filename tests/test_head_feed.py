"""The trainer's head reader (trainer/head_feed.py) when the broker is down: it waits, it does not crash the trainer."""

from __future__ import annotations

from infra.kafka_broker import free_port
from tests.conftest import make_settings
from trainer import head_feed
from trainer.head_feed import HeadFeed


def test_a_seek_with_the_broker_down_is_retried_later_not_raised(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(head_feed, "RETRY_S", 3600.0)
    settings = make_settings(tmp_path, kafka_bootstrap=f"127.0.0.1:{free_port()}")  # nothing listens there
    feed = HeadFeed(settings, "tabloop.episodes", "g")
    try:
        feed.follow(1_000, at_head=True)
        assert feed.covered_from_ms is None and feed.poll() == []
        assert "cannot seek tabloop.episodes" in caplog.text
        caplog.clear()
        feed.follow(1_000, at_head=True)  # within the retry interval: no second try (each costs seconds)
        assert "cannot seek" not in caplog.text
    finally:
        feed.close()
