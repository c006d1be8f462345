"""Shared fixtures. The `kafka` fixture starts one real broker per test session on a free port."""

from __future__ import annotations

import pytest

from infra.kafka_broker import LocalKafka, free_port
from infra.settings import Settings, load_settings


TEST_PARTITIONS = 3


def make_settings(tmp_path, **overrides) -> Settings:
    """Settings for a test: nothing from the developer's environment leaks in.

    Every test shares the session's broker, so all agree on the topics' partition count.
    """
    overrides.setdefault("topic_partitions", TEST_PARTITIONS)
    return load_settings(environ={}, state_dir=str(tmp_path), **overrides)


@pytest.fixture(scope="session")
def kafka(tmp_path_factory) -> LocalKafka:
    state = tmp_path_factory.mktemp("kafka-state")
    settings = make_settings(state, kafka_bootstrap=f"127.0.0.1:{free_port()}")
    broker = LocalKafka(settings)
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def own_kafka(tmp_path_factory) -> LocalKafka:
    """A fresh broker for one test: for workers that read their topics from the start, which must not
    see the session broker's events of other tests."""
    settings = make_settings(tmp_path_factory.mktemp("own-kafka"), kafka_bootstrap=f"127.0.0.1:{free_port()}")
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
