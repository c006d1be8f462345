"""What a correct program is allowed to be (issue 40): the ways tests are written in the wild — HumanEval's
`check(candidate)`, MBPP's bare asserts, unittest.main() with `from __main__ import`, pytest's test functions —
each passes a right program and fails a wrong one in the judge. And what the judge itself runs as: not root,
no network, its memory counted in the run's cgroup. Real sandbox runs, nothing patched."""

from __future__ import annotations

import os
import socket

import pytest

from rewards.sandbox import run_tests

RIGHT = "def solve(x):\n    return 3 * x\n"
WRONG = "def solve(x):\n    return 3 + x\n"

STYLES = {
    "humaneval": "def check(candidate):\n    assert candidate(2) == 6\n    assert candidate(0) == 0\n\ncheck(solve)\n",
    "mbpp": "assert solve(2) == 6\nassert solve(0) == 0\n",
    "unittest_main": ("import unittest\nfrom __main__ import solve\n\n"
                      "class TestSolve(unittest.TestCase):\n"
                      "    def test_two(self):\n        self.assertEqual(solve(2), 6)\n"
                      "    def test_zero(self):\n        self.assertEqual(solve(0), 0)\n\n"
                      "if __name__ == '__main__':\n    unittest.main()\n"),
    "unittest_no_main": ("import unittest\n\nclass TestSolve(unittest.TestCase):\n"
                         "    def test_two(self):\n        self.assertEqual(solve(2), 6)\n"),
    "pytest": "def test_two():\n    assert solve(2) == 6\n\ndef test_zero():\n    assert solve(0) == 0\n",
    "import_main_module": "import __main__\nassert __main__.solve(2) == 6\n",
}


@pytest.mark.parametrize("style", sorted(STYLES))
def test_a_right_program_passes_and_a_wrong_one_fails(style):
    right = run_tests(RIGHT, tests=STYLES[style])
    assert (right.passed, right.verdict) == (True, "trusted"), right.stderr
    wrong = run_tests(WRONG, tests=STYLES[style])
    assert (wrong.passed, wrong.outcome) == (False, "failed"), wrong


def test_the_program_imports_reach_the_tests_as_the_judges_own_modules():
    # HumanEval's find_zero: the file imports math and the tests use it without importing it.
    program = "import math\ndef solve(x):\n    return math.sqrt(x)\n"
    tests = "assert math.isclose(solve(9.0), 3.0)\n"
    assert run_tests(program, tests=tests).passed
    # A stand-in named like the module is not what the tests get: theirs is the standard one.
    fake = ("class _Anything:\n    def isclose(self, *args, **kwargs):\n        return True\n"
            "math = _Anything()\ndef solve(x):\n    return -1.0\n")
    assert not run_tests(fake, tests=tests).passed
    # A function named like a standard module, called by the tests, is the program's function.
    assert run_tests("def copy(x):\n    return [x, x]\n", tests="assert copy(1) == [1, 1]\n").passed


def test_a_function_that_changes_its_argument_is_tested_on_its_copy():
    tests = ("from tabloop_judge import call_with_copies\n"
             "xs = [3, 1, 2]\n"
             "value, (after,) = call_with_copies(sort_in_place, xs)\n"
             "assert value is None and after == [1, 2, 3]\n"
             "assert xs == [3, 1, 2]  # the tests' own list is as it was\n")
    assert run_tests("def sort_in_place(xs):\n    xs.sort()\n", tests=tests).passed
    assert not run_tests("def sort_in_place(xs):\n    xs.reverse()\n", tests=tests).passed


def test_the_judge_runs_with_the_least_it_needs():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        tests = (
            "import os, socket\n"
            "print('judge uid', os.geteuid())\n"
            "print('judge cgroup', open('/proc/self/cgroup').read().replace(chr(10), ' '))\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('judge network: connected')\n"
            "except OSError as e:\n"
            "    print('judge network:', type(e).__name__)\n"
            "assert solve(2) == 6\n")
        result = run_tests(RIGHT, tests=tests)
    finally:
        listener.close()
    assert result.passed, result.stderr
    assert "judge network: connected" not in result.stdout and "judge network:" in result.stdout, result.stdout
    if os.geteuid() == 0:
        judge_uid = int(result.stdout.split("judge uid ")[1].split()[0])
        assert judge_uid != 0 and judge_uid != result.uid, result.stdout
    if "cgroup" in result.isolation:  # its memory is the run's, capped with the program's
        assert "tabloop-sandbox-" in result.stdout.split("judge cgroup ")[1], result.stdout
