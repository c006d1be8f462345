"""Shared fixtures. The `kafka` fixture starts one real broker per test session on a free port."""

from __future__ import annotations

import os
import time

import pytest

from infra.kafka_broker import KafkaLaunchError, LocalKafka, free_port
from infra.settings import Settings, load_settings


TEST_PARTITIONS = 3

# The drills' total time (`make drills`): CI has 90 minutes and must stay under 60 whatever a regression
# does, while the drills' own timeouts add up to hours. Once the budget is spent every drill left fails at
# once, saying so; a drill that starts with less than its own timeout left gets the rest as its timeout.
# `.ci/run` sets it to what its 60 minutes leave after `make test`.
DRILL_BUDGET_S = float(os.environ.get("TABLOOP_DRILL_BUDGET_S", 35 * 60))
DRILL_FLOOR_S = 30  # a drill started with less than this left could not do anything useful


_drills_started = pytest.StashKey[float]()
_budget_spent = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Runs before pytest-timeout reads the test's timeout (its own hookwrapper, which this one wraps)."""
    if item.get_closest_marker("drill") is not None:
        started = item.config.stash.setdefault(_drills_started, time.monotonic())
        left = DRILL_BUDGET_S - (time.monotonic() - started)
        marker = item.get_closest_marker("timeout")
        own = (marker.args[0] if marker and marker.args else None) or item.config.getoption("timeout", None) \
            or item.config.getini("timeout")
        if left < DRILL_FLOOR_S:
            item.stash[_budget_spent] = DRILL_BUDGET_S - left
        elif not own or float(own) > left:
            item.add_marker(pytest.mark.timeout(int(left)), append=False)
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _budget_spent in item.stash:
        pytest.fail(f"not run: the drills' time budget (TABLOOP_DRILL_BUDGET_S={DRILL_BUDGET_S:.0f} s) is spent "
                    f"({item.stash[_budget_spent]:.0f} s since the first drill started)", pytrace=False)


def make_settings(tmp_path, **overrides) -> Settings:
    """Settings for a test: nothing from the developer's environment leaks in.

    Every test shares the session's broker, so all agree on the topics' partition count.
    """
    overrides.setdefault("topic_partitions", TEST_PARTITIONS)
    return load_settings(environ={}, state_dir=str(tmp_path), **overrides)


def start_broker(tmp_path_factory, name: str, attempts: int = 3) -> LocalKafka:
    """A broker started on a free port. ``free_port`` hands on a port nothing holds, which something else
    could still bind before the broker does: then the start says the port is in use, and we try another."""
    for attempt in range(1, attempts + 1):
        settings = make_settings(tmp_path_factory.mktemp(name), kafka_bootstrap=f"127.0.0.1:{free_port()}")
        broker = LocalKafka(settings)
        try:
            broker.start()
            return broker
        except KafkaLaunchError as exc:
            if "already in use" not in str(exc) or attempt == attempts:
                raise


@pytest.fixture(scope="session")
def kafka(tmp_path_factory) -> LocalKafka:
    broker = start_broker(tmp_path_factory, "kafka-state")
    yield broker
    broker.stop()


@pytest.fixture
def own_kafka(tmp_path_factory) -> LocalKafka:
    """A fresh broker for one test: for workers that read their topics from the start, which must not
    see the session broker's events of other tests."""
    broker = start_broker(tmp_path_factory, "own-kafka")
    yield broker
    broker.stop()


@pytest.fixture
def kafka_settings(kafka) -> Settings:
    return kafka.settings


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from trainer.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0))
