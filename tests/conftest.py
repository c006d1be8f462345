"""Shared fixtures. The `kafka` fixture starts one real broker per test session on a free port."""

from __future__ import annotations

import pytest

from infra.kafka_broker import LocalKafka, free_port
from infra.settings import Settings, load_settings


def make_settings(tmp_path, **overrides) -> Settings:
    """Settings for a test: nothing from the developer's environment leaks in."""
    return load_settings(environ={}, state_dir=str(tmp_path), **overrides)


@pytest.fixture(scope="session")
def kafka(tmp_path_factory) -> LocalKafka:
    state = tmp_path_factory.mktemp("kafka-state")
    settings = make_settings(state, kafka_bootstrap=f"127.0.0.1:{free_port()}", topic_partitions=3)
    broker = LocalKafka(settings)
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def kafka_settings(kafka) -> Settings:
    return kafka.settings


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from trainer.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0))
