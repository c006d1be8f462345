"""A tests reward nothing can forge (issue 29): each program here fails its tests and tries to be scored as
passing anyway. Each made the previous sandbox (a secret token in the program's own address space) say "passed",
through ``run_tests`` and through the streams worker; now the tests run in a process of their own and decide.
Real parts only: the sandbox's processes, and a worker on a broker of its own."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone

import pytest

from infra.bus import EventProducer, ensure_topics, read_topic
from policy.fim import build_fim_prompt
from schemas.events import new_event
from rewards.sandbox import run_tests
from tests.conftest import make_settings
from tests.system_helpers import wait
from tests.test_streams import IDLE_S, start_worker, stop

# Issue 29's forge: _ctypes loaded without an import event, memory read through a Union of an integer and a
# pointer, every 32-hex string found written to every fd the frame above holds, then exit 0.
CTYPES_MEMORY = """\
import _imp, importlib.util, os, re, sys
try:
    _c = _imp.create_dynamic(importlib.util.find_spec('_ctypes'))
    class c_size_t(_c._SimpleCData):
        _type_ = 'L'
    class c_char(_c._SimpleCData):
        _type_ = 'c'
    def read(address, size):
        class View(_c.Union):
            _fields_ = [('i', c_size_t), ('p', _c.POINTER(c_char * size))]
        view = View()
        view.i = address
        return view.p.contents.raw
except RuntimeError as e:  # the audit hook saw the load: read the memory through /proc/self/mem instead
    print('forge: ctypes refused:', e, flush=True)
    mem = open('/proc/self/mem', 'rb', 0)
    def read(address, size):
        mem.seek(address)
        return mem.read(size)
found = []
for line in open('/proc/self/maps'):
    span, perms = line.split()[:2]
    lo, hi = (int(x, 16) for x in span.split('-'))
    if perms.startswith('rw') and hi - lo <= 64 * 2**20:
        try:
            data = read(lo, hi - lo)
        except OSError:
            continue
        for m in re.findall(rb'(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])', data):
            if m not in found:
                found.append(m)
fds = [v for v in sys._getframe(1).f_locals.values() if type(v) is int and 2 < v < 1024]
print('forge: found', len(found), 'candidates; fds', fds, flush=True)
for token in found[:1]:
    for fd in fds:
        try:
            os.write(fd, token)
        except OSError:
            pass
os._exit(0)
"""

# A reward hack a policy can find by itself: an answer equal to everything.
ALWAYS_EQUAL = """\
class _Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
def add(a, b):
    return _Anything()
"""

# Reading the answer key: the tests' source, found from the caller's frame or next to the program, parsed for
# `assert f(args) == expected`, and the expected value returned for those arguments.
ANSWER_KEY = """\
import ast, os, sys
def _answers():
    paths = []
    frame = sys._getframe(2)
    while frame is not None:
        paths.append(frame.f_code.co_filename)
        frame = frame.f_back
    here = os.path.dirname(os.path.abspath(__file__))
    paths += [os.path.join(here, n) for n in os.listdir(here)]
    for path in paths:
        try:
            tree = ast.parse(open(path).read())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and node.comparators:
                try:
                    yield [ast.literal_eval(a) for a in node.left.args], ast.literal_eval(node.comparators[0])
                except ValueError:
                    pass
def add(a, b):
    for args, expected in _answers():
        if args == [a, b]:
            return expected
    return a - b
"""

WRONG = "def add(a, b):\n    return a - b\n"
RIGHT = WRONG.replace("a - b", "a + b")
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"

# Issue 40's forges: each made a wrong program pass on 064e281.
# 1. A builtin the tests use, shadowed by a name the program defines (the judge merged the program's names
#    above its builtins).
SHADOW_ABS = "def abs(x):\n    return 0\ndef solve(x):\n    return 0.0\n"
SHADOW_SORTED = "def sorted(xs):\n    return []\ndef solve(xs):\n    return []\n"
SHADOW_SET = "def set(xs):\n    return [0, 0]\ndef solve(xs):\n    return [9]\n"
SHADOW_ROUND = "def round(x, n=0):\n    return 3.0\ndef solve(x):\n    return 99.0\n"
# 2. The names message rewritten through the server's own module: the tests see a __name__ (or __builtins__)
#    of the program's choosing, and a guarded test never runs.
NAMES_REWRITTEN = """\
import sys
_server = sys._getframe(1).f_globals
_send = _server['_send']
def _rewritten(fd, obj, _send=_send):
    if type(obj) is dict and type(obj.get('names')) is dict:
        obj['names']['__name__'] = 'not_main'
    return _send(fd, obj)
_server['_send'] = _rewritten
del _server, _send  # what the program sends is plain data, or the judge stops at once
def solve(x):
    return 0
"""
# 3. The tests' own arguments rewritten by the call: a program that empties its argument makes the tests'
#    expected value (computed after the call) empty too.
ARGUMENT_WRITE_BACK = "def solve(xs):\n    xs.clear()\n    return []\n"
# 4. A module the judge imports because the program named it: `this` prints the Zen of Python when imported,
#    so its text in the output says the judge ran a module of the program's choosing.
PROGRAM_CHOSEN_IMPORT = NAMES_REWRITTEN.replace(
    "obj['names']['__name__'] = 'not_main'", "obj['names']['zen'] = {'m': 'this'}")
ZEN = "Beautiful is better than ugly"
# 5. An iteration the tests drive, cut short: StopIteration raised by the program ends a map() early.
STOP_ITERATION = "def solve(x):\n    raise StopIteration\n"


@dataclass(frozen=True)
class Case:
    program: str   # the wrong program, with its forge
    tests: str
    right: str     # the right program: the same tests pass it, so a failure is the forge's


CASES = {
    "ctypes_memory": Case(WRONG + CTYPES_MEMORY, TESTS, RIGHT),
    "always_equal": Case(WRONG + ALWAYS_EQUAL, TESTS, RIGHT),
    "answer_key": Case(WRONG + ANSWER_KEY, TESTS, RIGHT),
    "shadow_abs": Case(SHADOW_ABS, "assert abs(solve(1.0) - 3.0) < 1e-9\n", "def solve(x):\n    return 3 * x\n"),
    "shadow_sorted": Case(SHADOW_SORTED, "assert solve([3, 1, 2]) == sorted([3, 1, 2])\n",
                          "def solve(xs):\n    return sorted(xs)\n"),
    "shadow_set": Case(SHADOW_SET, "assert len(set(solve([1, 2, 2]))) == 2\n",
                       "def solve(xs):\n    return xs\n"),
    "shadow_round": Case(SHADOW_ROUND, "assert round(solve(1.5), 2) == 3.0\n", "def solve(x):\n    return 2 * x\n"),
    "names_rewritten": Case(NAMES_REWRITTEN, "if __name__ == '__main__':\n    assert solve(1) == 3\n",
                            "def solve(x):\n    return 3 * x\n"),
    "argument_write_back": Case(ARGUMENT_WRITE_BACK, "xs = [3, 1, 2]\nassert solve(xs) == sorted(xs)\n",
                                "def solve(xs):\n    return sorted(xs)\n"),
    "program_chosen_import": Case(PROGRAM_CHOSEN_IMPORT, "assert solve(1) == 3\n", "def solve(x):\n    return 3 * x\n"),
    "stop_iteration": Case(STOP_ITERATION,
                           "for got, want in zip(map(solve, [1, 2]), [3, 6]):\n    assert got == want\n",
                           "def solve(x):\n    return 3 * x\n"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_forge_scores_as_failing(name):
    case = CASES[name]
    result = run_tests(case.program, tests=case.tests)
    assert (result.passed, result.outcome) == (False, "failed"), result
    assert result.verdict == "trusted"
    if name == "ctypes_memory":  # it read all its writable memory: no secret there to find
        assert "forge: found 0 candidates" in result.stdout, result
    if name == "program_chosen_import":
        assert ZEN not in result.stdout, "the judge imported a module the program named"
    # The same tests pass a right program: the failure is the forge's, not the harness's.
    assert run_tests(case.right, tests=case.tests).passed


def test_the_tests_get_plain_data_and_handles():
    program = ("import math\nclass Stack:\n    def __init__(self):\n        self.items = []\n"
               "    def push(self, x):\n        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
               "def parse(s):\n    return int(s)\nLIMIT = (1, 2.5, {'a': b'x'})\n")
    tests = ("s = Stack()\ns.push(3)\ns.push(4)\nassert s.pop() == 4 and s.items == [3]\n"
             "assert LIMIT == (1, 2.5, {'a': b'x'}) and math.pi > 3\n"
             "try:\n    parse('x')\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no ValueError')\n")
    result = run_tests(program, tests=tests)
    assert result.passed, result.stderr
    assert not run_tests(program.replace("self.items.pop()", "self.items[0]"), tests=tests).passed


def _ts(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, timezone.utc)


@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_the_worker_scores_every_forge_as_failing(own_kafka, tmp_path):
    """Each case through a real worker on a real broker: the forge's tests component is the failure's −0.25,
    its right program's is the pass's +0.75 (acceptance 0.5, tests 0.5, an accepted completion)."""
    suffix = "\n"
    prompts = {name: build_fim_prompt(f"# {name}\n", suffix) for name in CASES}
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"prompt": prompts[name], "tests": case.tests}) + "\n"
                                                  for name, case in CASES.items()))
    (tmp_path / "rewards.yaml").write_text("default:\n  weights: {acceptance: 0.5, tests: 0.5}\n")
    settings = make_settings(tmp_path, kafka_bootstrap=own_kafka.settings.kafka_bootstrap, idle_close_s=IDLE_S,
                             reward_spec_file=tmp_path / "rewards.yaml", tests_file=tmp_path / "tasks.jsonl")
    ensure_topics(settings)
    completions = {f"{kind}-{name}": (prompts[name], f"# {name}\n", text) for name, case in CASES.items()
                   for kind, text in (("forge", case.program), ("right", case.right))}
    now, events = int(time.time() * 1000), []
    for cid, (prompt, prefix, text) in completions.items():
        events.append(new_event(
            "CompletionServed", completion_id=cid, served_at=_ts(now), project_id="p", user_id="u", model="tiny",
            policy_version=1, prompt=prompt, prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(),
            prefix=prefix, suffix=suffix,
            completion_text=text, completion_token_ids=[1, 2], completion_logprobs=[-0.1, -0.2], finish_reason="stop",
            aborted=False, temperature=0.2, top_p=1.0, max_tokens=16, ttft_ms=1.0, latency_ms=2.0, replica_id="r"))
        events.append(new_event("FeedbackReceived", project_id="p", user_id="u", source="api", completion_id=cid,
                                outcome="ACCEPTED", raw_payload="{}", received_at=_ts(now + 5)))
    worker = start_worker(settings, "streams-forges.log")
    try:
        with EventProducer(settings) as producer:
            for e in events:
                producer.publish(e)
        got = wait(lambda: len(found := {r.event.record["completion_id"]: r.event.record
                                         for r in read_topic(settings, "tabloop.episodes") if r.event})
                   >= len(completions) and found, 240, "the scored episodes")
    finally:
        stop(worker)
    tests_scores = {cid: (ep["reward_components"].get("tests"), ep["scoring_errors"]) for cid, ep in got.items()}
    assert tests_scores == {cid: (0.75 if cid.startswith("right-") else -0.25, {}) for cid in completions}, tests_scores
