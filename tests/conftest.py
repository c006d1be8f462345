"""Shared fixtures. The `kafka` fixture starts one real broker per test session on a free port."""

from __future__ import annotations

import os
import time

import pytest

from infra.kafka_broker import KafkaLaunchError, LocalKafka, free_port
from infra.settings import Settings, load_settings


TEST_PARTITIONS = 3

# A total time for the tests of one session, so that CI stays inside its time whatever a regression does
# (CI has 90 minutes; the drills' own timeouts alone add up to hours): the drills (`make drills`) get
# CI_DRILL_BUDGET_S, the other tests (`make test`) CI_TEST_BUDGET_S (no limit unless set). A test
# that starts with less than its own timeout left gets the rest as its timeout; once the budget is spent
# every test left of that kind fails at once, saying so. `.ci/run` sets both from its 75 minutes.
BUDGETS_S = {"drill": float(os.environ.get("CI_DRILL_BUDGET_S", 35 * 60)),
             "test": float(os.environ.get("CI_TEST_BUDGET_S", "inf"))}
BUDGET_VARS = {"drill": "CI_DRILL_BUDGET_S", "test": "CI_TEST_BUDGET_S"}
# A test started with less than this left could not do anything useful. Settable so that
# tests/test_ci_budget.py can spend a budget in seconds, not minutes.
BUDGET_FLOOR_S = float(os.environ.get("CI_BUDGET_FLOOR_S", 30))
# The line each session ends with, per kind that ran under a budget; `.ci/run` greps it (keep them in step).
NOT_RUN_PREFIX = "not run:"  # how a test left out for the budget fails
NOT_RUN_LINE = "ci: {n} tests not run for the time budget of the {kind}s ({var}={budget:.0f} s)"

_budget_started = pytest.StashKey[dict]()
_budget_spent = pytest.StashKey[tuple]()
_budget_not_run = pytest.StashKey[dict]()
_session_config = None  # for the report hook, which is given no config


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Runs before pytest-timeout reads the test's timeout (its own hookwrapper, which this one wraps)."""
    kind = "drill" if item.get_closest_marker("drill") is not None else "test"
    if BUDGETS_S[kind] != float("inf"):
        started = item.config.stash.setdefault(_budget_started, {}).setdefault(kind, time.monotonic())
        left = BUDGETS_S[kind] - (time.monotonic() - started)
        marker = item.get_closest_marker("timeout")
        own = (marker.args[0] if marker and marker.args else None) or item.config.getoption("timeout", None) \
            or item.config.getini("timeout")
        if left < BUDGET_FLOOR_S:
            item.stash[_budget_spent] = (kind, BUDGETS_S[kind] - left)
        elif not own or float(own) > left:
            item.add_marker(pytest.mark.timeout(int(left)), append=False)
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _budget_spent in item.stash:
        kind, used = item.stash[_budget_spent]
        pytest.fail(f"{NOT_RUN_PREFIX} the time budget of the {kind}s ({BUDGET_VARS[kind]}={BUDGETS_S[kind]:.0f} s) "
                    f"is spent ({used:.0f} s since the first started)", pytrace=False)


def pytest_configure(config):
    global _session_config
    _session_config = config


# Seconds each drill took in a CI run (setup included; 93cc040, `--durations`): the order the drills are
# dealt to pytest-xdist's workers. Its `load` scheduler deals the first two tests of every worker round
# robin and keeps one queued behind each running test, so in file order the fault drill (15 minutes) had
# the outage drill queued behind it and the phase took 21 minutes for 16 of work per worker. Dealt as
# the longest one per worker, then the shortest one per worker (what waits behind a long one), then the
# rest longest first, the same durations simulate 3-4 minutes shorter. A drill not listed counts as 60 s.
DRILL_SECONDS = {
    "test_faults_lose_nothing_acknowledged": 930,
    "test_ten_thousand_shuffled_events_give_exactly_the_expected_episodes": 612,
    "test_bench_loop_runs_the_whole_system_and_its_figures_come_from_its_records": 395,
    "test_up_serves_learns_restarts_and_down_leaves_nothing": 375,
    "test_sigkill_mid_stream_loses_nothing_and_doubles_nothing": 311,
    "test_bench_loop_team_runs_one_teams_users_with_lora_updates_and_no_gate": 310,
    "test_feedback_to_new_version_to_serving_rollback_and_canary": 206,
    "test_drill_300k_events_three_sigkills_counts_exact": 203,
    "test_undecodable_input_goes_to_the_dead_letter_topic": 82,
    "test_sigkill_between_and_during_updates": 50,
    "test_judge_and_tests_scores_reach_the_episodes": 44,
    "test_sigkill_between_storing_and_committing_then_restart_counts_stay_exact": 36,
    "test_the_share_check_refuses_what_a_fair_canary_would_not_serve": 20,
    # Issue 44's, from a clean clone's CI run (0126b49).
    "test_fuzzer_finds_no_violation_on_the_known_case_and_a_drawn_seed": 440,
    # With the every-partition-commits-again check of the burst-outage drill it took over (a35e4d4's CI).
    "test_kafka_stopped_thirty_seconds_under_steady_load_commits_no_episode_twice": 306,
    "test_workers_joining_and_leaving_under_steady_load_commit_no_episode_twice": 91,
    "test_a_worker_whose_transactions_are_fenced_mid_stream_exits_at_once_and_nothing_is_doubled": 133,  # 003606c CI
}


def drill_order(names: list[str], workers: int) -> list[str]:
    """``names`` in the order to deal them to ``workers`` (see ``DRILL_SECONDS``)."""
    by_length = sorted(names, key=lambda n: (-DRILL_SECONDS.get(n, 60), n))
    longest = by_length[:workers]
    shortest = by_length[workers:][::-1][:workers]
    return longest + shortest + [n for n in by_length[workers:] if n not in shortest]


@pytest.hookimpl(trylast=True)  # after `-m drill` has deselected the rest
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the drills in ``drill_order`` (every worker collects, and sorts alike; the
    scheduler deals them in the workers' order)."""
    workers = getattr(config, "workerinput", {}).get("workercount") or config.getoption("numprocesses", None)
    workers = workers if isinstance(workers, int) else 1
    drills = [item for item in items if item.get_closest_marker("drill") is not None]
    if workers < 2 or len(drills) != len(items):  # only a drills-only run is reordered
        return
    names = list(dict.fromkeys(item.originalname for item in items))  # a parametrized drill once
    rank = {name: i for i, name in enumerate(drill_order(names, workers))}
    items.sort(key=lambda item: (rank[item.originalname], item.nodeid))


def pytest_runtest_logreport(report):
    """Counted from the reports, not from the items: under pytest-xdist the tests run in worker processes,
    and only their reports reach the process that prints the summary."""
    kind = "drill" if "drill" in report.keywords else "test"
    if report.when != "setup" or BUDGETS_S[kind] == float("inf"):
        return
    counts = _session_config.stash.setdefault(_budget_not_run, {})
    counts[kind] = counts.get(kind, 0) + (report.failed and str(report.longrepr).startswith(NOT_RUN_PREFIX))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line per kind of test that ran under a budget, also when none was left out: the CI log always
    says how many were not run for the time, instead of leaving them among the failures."""
    for kind, n in config.stash.get(_budget_not_run, {}).items():
        terminalreporter.write_line(NOT_RUN_LINE.format(n=n, kind=kind, var=BUDGET_VARS[kind],
                                                        budget=BUDGETS_S[kind]))


def make_settings(tmp_path, **overrides) -> Settings:
    """Settings for a test: nothing from the developer's environment leaks in.

    Every test shares the session's broker, so all agree on the topics' partition count.
    """
    overrides.setdefault("topic_partitions", TEST_PARTITIONS)
    # The show-gate off unless a test asks for it: a trainer's learner would publish a shared gate on the
    # session's broker, and every later test's front door would start hiding completions.
    overrides.setdefault("show_gate", False)
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
    from policy.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny Llama with SmolLM2's special tokens and no FIM tokens: the default model's shape."""
    from policy.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0, arch="llama"))
