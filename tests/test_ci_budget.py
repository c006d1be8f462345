"""The time budget of a test session (tests/conftest.py): the line it ends with counts the tests left out
for the budget, also when there are none, and `.ci/run` fails on a count above 0.

The session's tests run an inner pytest session over the project's own conftest, in a subprocess of its own
so that the budget's environment variables are read afresh."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

pytest_plugins = ["pytester"]

# The first test spends the budget: with 10 s and a floor of 9 s, whatever ran 1.2 s leaves less than the
# floor, so the two after it are left out, however slow the machine. (The first runs under what is left as
# its timeout, 9 s: far from its 1.2 s.)
SPENDS_THE_BUDGET = """
import time

def test_spends_the_budget():
    time.sleep(1.2)

def test_left_out():
    pass

def test_left_out_too():
    pass
"""


def inner_session(pytester, monkeypatch, tests: str, *options: str, **environ: str):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the conftest imports infra.*
    for name in ("CI_TEST_BUDGET_S", "CI_DRILL_BUDGET_S", "CI_BUDGET_FLOOR_S"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(tests)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *options)


def test_the_tests_left_out_for_the_budget_are_counted(pytester, monkeypatch):
    result = inner_session(pytester, monkeypatch, SPENDS_THE_BUDGET, CI_TEST_BUDGET_S="10", CI_BUDGET_FLOOR_S="9")
    result.assert_outcomes(passed=1, errors=2)  # they fail at setup
    result.stdout.fnmatch_lines(["*not run: the time budget of the tests (CI_TEST_BUDGET_S=10 s) is spent*"])
    assert "ci: 2 tests not run for the time budget of the tests (CI_TEST_BUDGET_S=10 s)" in result.outlines


def test_the_tests_left_out_are_counted_across_xdist_workers(pytester, monkeypatch):
    """`make test` and `make drills` run under pytest-xdist: the tests run in worker processes and the count
    is printed by the one that gathers their reports. (loadfile: the file's three tests go to one worker, whose
    budget the first spends.)"""
    result = inner_session(pytester, monkeypatch, SPENDS_THE_BUDGET, "-n", "2", "--dist", "loadfile",
                           CI_TEST_BUDGET_S="10", CI_BUDGET_FLOOR_S="9")
    result.assert_outcomes(passed=1, errors=2)
    assert "ci: 2 tests not run for the time budget of the tests (CI_TEST_BUDGET_S=10 s)" in result.outlines


def test_the_count_is_printed_when_every_test_ran(pytester, monkeypatch):
    result = inner_session(pytester, monkeypatch, "def test_one():\n    pass\n\ndef test_two():\n    pass\n",
                           CI_TEST_BUDGET_S="3600")
    result.assert_outcomes(passed=2)
    assert "ci: 0 tests not run for the time budget of the tests (CI_TEST_BUDGET_S=3600 s)" in result.outlines


def test_no_count_without_a_budget(pytester, monkeypatch):
    """Outside CI (no CI_TEST_BUDGET_S) `make test` has no budget, so there is nothing to count."""
    result = inner_session(pytester, monkeypatch, "def test_one():\n    pass\n")
    result.assert_outcomes(passed=1)
    assert not [line for line in result.outlines if "not run for the time budget" in line]


def test_ci_run_fails_on_a_count_above_zero(tmp_path):
    """`.ci/run`'s phase, on a command that prints the count line: exit 1 and a line saying why, even when
    the command itself passed; on a count of 0, the command's own status."""
    script = (ROOT / ".ci" / "run").read_text()
    phase = script[script.index("phase() {"):script.index("\n}\n", script.index("phase() {")) + 3]
    line = "ci: {} tests not run for the time budget of the drills (CI_DRILL_BUDGET_S=60 s)"

    def run(count: int, status: int) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f"set -euo pipefail\n{phase}\n"
                               f"phase drills bash -c 'echo \"{line.format(count)}\"; exit {status}'"],
                              capture_output=True, text=True, cwd=tmp_path)

    left_out = run(3, 0)
    assert left_out.returncode == 1, left_out.stdout + left_out.stderr
    assert "ci: FAILED: drills left 3 tests not run for its time budget" in left_out.stdout
    for status in (0, 2):
        none_left_out = run(0, status)
        assert none_left_out.returncode == status, none_left_out.stdout + none_left_out.stderr
        assert "FAILED" not in none_left_out.stdout


def test_the_drills_are_dealt_longest_first_with_the_shortest_queued_behind_them():
    from tests.conftest import DRILL_SECONDS, drill_order

    names = list(DRILL_SECONDS) + ["a_drill_not_measured_yet"]
    order = drill_order(names, 4)
    assert sorted(order) == sorted(names)
    seconds = [DRILL_SECONDS.get(n, 60) for n in order]
    assert seconds[:4] == sorted(DRILL_SECONDS.values(), reverse=True)[:4]  # one long drill per worker
    assert max(seconds[4:8]) <= min(seconds[8:])  # queued behind them: the shortest
    assert seconds[8:] == sorted(seconds[8:], reverse=True)  # then longest first, dealt as workers free up
