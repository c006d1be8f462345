"""The scorer's sandbox against programs that misbehave: each must be scored a failure and contained.

These run real subprocesses under the isolation the sandbox requires
(``required_isolation``): on a machine that can't give it, they fail (the
sandbox refuses to run) rather than skip.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import stat
import subprocess
import sys
import time
import uuid

import pytest

from rewards import sandbox
from rewards.sandbox import (OUTCOMES, SANDBOX_VAR, UID_POOL_BASE, UID_POOL_SIZE, SandboxUnavailable, _execute, _Plan,
                             network_isolation_available, pooled_uid, required_isolation, run_tests)
from tests.system_helpers import poll, wait


@pytest.fixture(scope="module")
def isolation() -> tuple[str, ...]:
    result = run_tests("pass\n")
    assert result.passed, result.stderr
    assert required_isolation() <= set(result.isolation), result.isolation
    return result.isolation


def _in_pool(uid: int) -> bool:
    return UID_POOL_BASE <= uid < UID_POOL_BASE + UID_POOL_SIZE


def _sandbox_processes() -> set[int]:
    """Processes that look like the sandbox's: of a pool uid (when we are root) or working in one of its dirs."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
            in_sandbox_dir = "tabloop-sandbox-" in os.readlink(f"/proc/{entry}/cwd")
        except (OSError, StopIteration):
            continue
        if (os.geteuid() == 0 and _in_pool(uid)) or in_sandbox_dir:
            found.add(int(entry))
    return found


def _assert_nothing_left(before: set[int]) -> None:
    # the kernel may still be tearing the last ones down
    left = poll(lambda: _sandbox_processes() - before, lambda left: not left, timeout_s=2, poll_s=0.05)
    assert not left, f"left behind: {left}"


def test_a_correct_program_passes(isolation):
    result = run_tests("def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\nprint('fine')\n")
    assert (result.passed, result.outcome, result.exit_code) == (True, "passed", 0), result.stderr
    assert result.stdout == "fine\n"
    assert result.isolation == isolation and "rlimits" in isolation
    assert result.duration_s < 5


def test_a_wrong_program_fails():
    result = run_tests("def add(a, b):\n    return a - b\n\nassert add(2, 3) == 5\n")
    assert (result.passed, result.outcome, result.exit_code) == (False, "failed", 1)
    assert "AssertionError" in result.stderr and "line 4" in result.stderr


def test_a_syntax_error_fails():
    result = run_tests("def add(a, b) return a + b\n")
    assert (result.passed, result.outcome) == (False, "failed")
    assert "SyntaxError" in result.stderr


@pytest.mark.parametrize("escape", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "exit()"])
def test_leaving_before_the_tests_fails(escape):
    result = run_tests(f"{escape}\nassert False, 'the tests'\n")
    assert (result.passed, result.outcome, result.exit_code) == (False, "failed", 0)
    assert "did not see the tests run to their end" in result.stderr
    # Test code that ends in unittest.main() exits on purpose: it can say so.
    assert run_tests(f"{escape}\n", must_reach_end=False).passed


def test_an_infinite_loop_times_out():
    start = time.monotonic()
    result = run_tests("while True:\n    pass\n", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert (result.passed, result.outcome) == (False, "timeout")
    assert 1.0 <= result.duration_s < 1.5
    assert elapsed < 1.0 + 2
    assert "killed after 1s" in result.stderr


def test_a_fork_bomb_is_contained(isolation):
    before = _sandbox_processes()
    start = time.monotonic()
    result = run_tests("import os\nwhile True:\n    os.fork()\n", timeout_s=5.0, max_processes=32)
    assert not result.passed and result.outcome in ("failed", "timeout"), result
    assert time.monotonic() - start < 5.0 + 2
    _assert_nothing_left(before)
    # The machine is still usable: we can fork, and the next program runs.
    assert subprocess.run([sys.executable, "-c", "pass"], timeout=10).returncode == 0
    assert run_tests("assert 1 + 1 == 2\n").passed


def test_what_a_program_leaves_running_is_killed(isolation):
    """A grandchild in a session of its own outlives its parent; the sandbox kills it anyway."""
    daemon = ("import os, time\n"
              "if os.fork() == 0:\n"
              "    os.setsid()\n"
              "    if os.fork() == 0:\n"
              "        time.sleep(60)\n"
              "    time.sleep(60)\n"
              "print('main done')\n")
    before = _sandbox_processes()
    start = time.monotonic()
    result = run_tests(daemon, timeout_s=10.0)
    assert result.passed and result.stdout == "main done\n", result
    assert time.monotonic() - start < 3  # the orphans did not hold the run up
    _assert_nothing_left(before)


def test_orphans_are_killed_without_a_pid_namespace(isolation):
    """The fallback when the kernel won't give a PID namespace: the bootstrap's tree is killed."""
    assert "mnt" in isolation
    before = _sandbox_processes()
    plan = _Plan(("mnt", "net"), drop=os.geteuid() == 0)
    with pooled_uid() as uid:
        result = _execute("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n", None,
                          plan, sys.executable, uid, uid, timeout_s=10.0, memory_bytes=512 * 2**20,
                          max_file_bytes=2**20, max_processes=64, max_output_bytes=4096, must_reach_end=True)
    assert result.passed and "pid" not in result.isolation, result
    _assert_nothing_left(before)


def test_a_huge_allocation_fails():
    result = run_tests("x = bytearray(10 * 2**30)\n", memory_bytes=512 * 2**20)
    assert not result.passed and result.outcome in ("memory", "failed"), result
    assert result.outcome == "memory" and "MemoryError" in result.stderr


def test_no_network(isolation):
    assert network_isolation_available() and "net" in isolation
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        result = run_tests(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)\n")
        assert (result.passed, result.outcome) == (False, "failed"), result
        assert "OSError" in result.stderr and "unreachable" in result.stderr
        assert result.network_isolated
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()


@pytest.mark.parametrize("where", ["shared_tmp", "test_tmp_path"])
def test_a_write_outside_its_directory_fails(where, tmp_path, isolation):
    target = f"/tmp/tabloop-escape-{uuid.uuid4().hex}" if where == "shared_tmp" else str(tmp_path / "escape.txt")
    result = run_tests(f"with open({target!r}, 'w') as f:\n    f.write('out')\n")
    assert (result.passed, result.outcome) == (False, "failed"), result
    assert "Error" in result.stderr
    assert not os.path.exists(target)


def test_it_may_write_in_its_own_directory():
    program = ("import os, tempfile\n"
               "assert os.environ['HOME'] == os.getcwd() == os.environ['TMPDIR']\n"
               "open('notes.txt', 'w').write('kept')\n"
               "with tempfile.NamedTemporaryFile() as f:\n"
               "    f.write(b'x')\n"
               "assert open('notes.txt').read() == 'kept'\n")
    result = run_tests(program)
    assert result.passed, result.stderr


def test_a_file_bigger_than_the_limit_fails():
    result = run_tests("open('big', 'wb').write(b'x' * (4 * 2**20))\n", max_file_bytes=2**20)
    assert (result.passed, result.outcome) == (False, "failed"), result
    assert "OSError" in result.stderr


def test_huge_output_is_truncated():
    cap = 64 * 2**10
    result = run_tests("import sys\nsys.stdout.write('x' * 5_000_000)\nprint('END')\n", max_output_bytes=cap)
    assert result.passed, result.stderr
    assert len(result.stdout) < cap + 100
    assert result.stdout.startswith("xxx") and result.stdout.endswith("END\n")  # the start and the end
    assert "bytes left out" in result.stdout


def test_printing_forever_is_cut_off():
    result = run_tests("while True:\n    print('y' * 1000)\n", timeout_s=1.0, max_output_bytes=4096)
    assert result.outcome == "timeout"
    assert len(result.stdout) < 4096 + 100 and len(result.stderr) < 4096 + 100


def test_the_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("TABLOOP_SECRET_FOR_TEST", "leak")
    result = run_tests("import os\nprint(sorted(os.environ))\nprint(os.environ['PYTHONHASHSEED'])\n")
    assert result.passed, result.stderr
    assert "TABLOOP_SECRET_FOR_TEST" not in result.stdout
    assert result.stdout.splitlines()[-1] == "0"


def test_it_runs_unprivileged(isolation):
    result = run_tests("import os\nprint(os.getuid(), os.geteuid(), os.getgid())\nassert os.getgroups() == []\n")
    assert result.passed, result.stderr
    uid, euid, gid = map(int, result.stdout.split())
    if os.geteuid() == 0:  # a uid of its own from the pool, and a group of the same number
        assert uid == euid == gid == result.uid and _in_pool(uid), result
    else:  # root of a user namespace, which is us outside it
        assert "user" in isolation


def test_errors_that_are_not_the_programs():
    result = run_tests("print(1)\n", python="/nonexistent/python3")
    assert (result.passed, result.outcome, result.exit_code) == (False, "error", None)
    assert "/nonexistent/python3" in result.stderr
    assert set(OUTCOMES) >= {result.outcome}
    with pytest.raises(ValueError, match="timeout_s"):
        run_tests("pass", timeout_s=0)
    with pytest.raises(TypeError):
        run_tests(b"pass")  # type: ignore[arg-type]


# -- forging a pass: each attack here made the old sandbox (a token in the program's last line) say
# "passed"; the nonce below is what the sandbox would use, so the tests can look for it in the output.

KNOWN_NONCE = "5eed" * 8


@pytest.fixture
def known_nonce(monkeypatch):
    monkeypatch.setattr(sandbox.secrets, "token_hex", lambda n: KNOWN_NONCE[:2 * n])
    return KNOWN_NONCE


# Issue 18's forge_token: find the end token and its fd in its own file, write it, leave.
FORGE_TOKEN = """\
import os, re
source = open(__file__).read()
fd, token = re.search(r"write\\((\\d+), b'([0-9a-f]+)'\\)", source).groups()
os.write(int(fd), token.encode())
os._exit(0)
"""

# Everything a program can read about itself: its file, argv, environment, /proc/self, every fd it
# holds, the frames above it (the harness's locals and globals), and every object the collector
# knows; then it writes each hex string it found to every fd and leaves.
LOOK_EVERYWHERE = """\
import os, re, sys
found = set()
def scan(data):
    if isinstance(data, str):
        data = data.encode('utf-8', 'replace')
    if isinstance(data, (bytes, bytearray)):
        found.update(m.decode() for m in re.findall(rb'[0-9a-f]{32}', data))
for path in (__file__, '/proc/self/cmdline', '/proc/self/environ'):
    try:
        scan(open(path, 'rb').read())
    except OSError as e:
        print('refused:', path, e.strerror)
scan(' '.join(sys.argv))
scan(repr(dict(os.environ)))
try:
    fds = [int(n) for n in os.listdir('/proc/self/fd')]
except OSError as e:
    print('refused: /proc/self/fd', e.strerror)
    fds = range(3, 256)
for fd in fds:
    try:
        os.set_blocking(fd, False)
        scan(os.read(fd, 65536))
    except OSError:
        pass
frame = sys._getframe()
while frame is not None:
    for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
        scan(value if isinstance(value, (str, bytes)) else repr(value))
    frame = frame.f_back
try:
    import gc
    for obj in gc.get_objects():
        for cell in getattr(obj, '__closure__', None) or ():
            scan(cell.cell_contents)
except RuntimeError as e:
    print('refused:', e)
print('found', sorted(found))
for secret in found:
    for fd in range(3, 256):
        try:
            os.write(fd, secret.encode())
        except OSError:
            pass
os._exit(0)
"""

# Its own memory, through /proc/self/mem.
READ_OWN_MEMORY = """\
import re
found = set()
try:
    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split('-'))
            if 'r' not in perms or hi - lo > 64 * 2**20:
                continue
            try:
                mem.seek(lo)
                found.update(re.findall(rb'[0-9a-f]{32}', mem.read(hi - lo)))
            except (OSError, OverflowError, ValueError):
                pass
except OSError as e:
    print('refused:', e.strerror)
print('found', sorted(found))
"""


@pytest.mark.parametrize("attack", [FORGE_TOKEN, LOOK_EVERYWHERE], ids=["forge_token", "look_everywhere"])
def test_a_program_cannot_forge_the_verdict(attack, known_nonce):
    # As one program (the tests at its end), and as the scorer runs it: program, then tests.
    for result in (run_tests(attack + "assert False, 'the tests'\n"), run_tests(attack, tests="assert False\n")):
        assert (result.passed, result.outcome) == (False, "failed"), result
        assert known_nonce not in result.stdout


def test_what_a_program_could_read_holds_no_nonce(known_nonce):
    # A program that holds its own tests (no ``tests``): the nonce harness decides, in the program's process.
    result = run_tests(LOOK_EVERYWHERE.replace("os._exit(0)", "") + "print('tests ran')\n")
    # Its file, argv, environment, fds, the frames above it: no 32-hex-digit secret anywhere.
    assert "found []" in result.stdout and known_nonce not in result.stdout, result
    assert "refused: /proc/self/environ" in result.stdout
    assert "refused: [sandbox] gc.get_objects is not allowed" in result.stdout
    assert result.passed and result.stdout.endswith("tests ran\n")  # it did run its tests to the end


# The verdict thread's lock is within the program's reach (the harness's frame is above it): it can
# wake the thread early, itself or from a callback that fires as the harness restores the builtins;
# then make the process exit 0 when the tests fail.
WAKE_THE_VERDICT = """\
import atexit, os, sys
sys._getframe(1).f_locals['go'].release()
atexit.register(os._exit, 0)
"""
WAKE_FROM_A_CALLBACK = """\
import atexit, builtins, sys, weakref
class Bait:
    pass
builtins.bait = Bait()  # only the builtins hold it: the harness drops it when it restores them
go = sys._getframe(1).f_locals['go']
ref = weakref.ref(builtins.bait, lambda _: go.release())
atexit.register(__import__('os')._exit, 0)
"""


@pytest.mark.parametrize("attack", [WAKE_THE_VERDICT, WAKE_FROM_A_CALLBACK], ids=["wake", "wake_from_a_callback"])
def test_waking_the_verdict_early_fails(attack):
    result = run_tests(attack + "assert False, 'the tests'\n")  # the nonce harness: tests in the program
    assert (result.passed, result.outcome, result.exit_code) == (False, "failed", 0), result
    assert "did not see the tests run to their end" in result.stderr


# A signal handler gets the frame it interrupts: it ran inside an audit hook that held the nonce.
SIGNAL_HANDLER_LOOKS = """\
import os, signal, sys
result_fd = int(open('/proc/self/cmdline', 'rb').read().split(b'\\0')[-2])
def handler(signum, frame):
    while frame is not None:
        nonce = frame.f_locals.get('nonce')
        if nonce:
            print('found', nonce, flush=True)
            os.write(result_fd, nonce)
            os._exit(0)
        frame = frame.f_back
signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.0001, 0.0001)
for _ in range(20000):
    open(__file__).close()  # an audit event each time: hooks run, and the timer fires in them
signal.setitimer(signal.ITIMER_REAL, 0)
"""


def test_a_signal_handler_finds_no_nonce(known_nonce):
    result = run_tests(SIGNAL_HANDLER_LOOKS, tests="assert False, 'the tests'\n", timeout_s=20)
    assert (result.passed, result.outcome) == (False, "failed"), result
    assert "found" not in result.stdout and "AssertionError: the tests" in result.stderr


def test_a_program_cannot_read_its_own_memory(known_nonce):
    result = run_tests(READ_OWN_MEMORY)
    assert result.passed, result.stderr
    assert "refused: Permission denied" in result.stdout and known_nonce not in result.stdout, result.stdout


TRACER_SKIPS_CHECK = """\
def add(a, b):
    return a - b

import sys
def tracer(frame, event, arg):
    if frame.f_code.co_name != 'check':
        return None
    last = max(line for _, _, line in frame.f_code.co_lines() if line)
    def jump(frame, event, arg):
        if event == 'line' and frame.f_lineno != last:
            frame.f_lineno = last  # straight to check's last line: its asserts never run
        return jump
    return jump
sys.settrace(tracer)
"""
CHECK = "def check(candidate):\n    assert candidate(2, 3) == 5\n    return\n\ncheck(add)\n"


def test_a_trace_function_cannot_skip_the_tests():
    for result in (run_tests(TRACER_SKIPS_CHECK + CHECK), run_tests(TRACER_SKIPS_CHECK, tests=CHECK)):
        assert (result.passed, result.outcome) == (False, "failed"), result
        assert "sys.settrace is not allowed" in result.stderr
    assert run_tests("def add(a, b):\n    return a + b\n", tests=CHECK).passed


def test_the_tests_see_the_builtins_unpatched():
    program = "import builtins\nbuiltins.abs = lambda x: 0\ndef area(r):\n    return 0\n"
    tests = "assert abs(area(1) - 3.14159) < 1e-3\n"
    result = run_tests(program, tests=tests)
    assert (result.passed, result.outcome) == (False, "failed") and "AssertionError" in result.stderr, result
    assert run_tests(program.replace("return 0", "return 3.14159"), tests=tests).passed


def test_ctypes_is_refused():
    result = run_tests("import ctypes\n")
    assert not result.passed and "importing ctypes is not allowed" in result.stderr, result


@pytest.mark.parametrize("escape", ["raise SystemExit(0)", "import os; os._exit(0)"])
def test_leaving_from_inside_the_tests_fails(escape):
    result = run_tests(f"def add(a, b):\n    {escape}\n", tests=CHECK)
    assert (result.passed, result.outcome, result.exit_code) == (False, "failed", 0), result


def test_the_program_runs_as_main_with_its_file():
    program = ("import sys, __main__\nassert __name__ == '__main__' and __main__.__dict__ is globals()\n"
               "assert sys.argv == [__file__] and __file__.endswith('program.py')\n"
               "from dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\n")
    result = run_tests(program, tests="assert P(1).x == 1\nimport logging, typing\nT = typing.TypeVar('T')\n"
                                      "logging.getLogger('t').warning('logged')\n")
    assert result.passed, result.stderr
    assert "logged" in result.stderr


# -- runs side by side ------------------------------------------------------------------------------

# A fork bomb that survives hitting its limit (a bare one dies of its first BlockingIOError), so its
# uid stays at the limit for the whole run.
BOMB_THAT_HOLDS_ON = """\
import os, time
while True:
    try:
        os.fork()
    except OSError:
        time.sleep(0.05)
"""

def test_a_fork_bomb_does_not_fail_the_runs_beside_it(isolation):
    """Issue 18: runs sharing one uid shared its process limit, so a bomb failed its neighbours."""
    before = _sandbox_processes()
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        bomb = pool.submit(run_tests, BOMB_THAT_HOLDS_ON, timeout_s=6.0)
        wait(lambda: len(_sandbox_processes() - before) >= 32 or bomb.done(), 20, "the bomb near its limit",
             poll_s=0.02)
        assert not bomb.done()
        benign = [pool.submit(run_tests, "import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()\nprint('ok')\n",
                              timeout_s=20.0) for _ in range(4)]
        results = [f.result() for f in benign]
        bombed = bomb.result()
    assert all(r.passed and r.stdout == "ok\n" for r in results), [r.stderr[-300:] for r in results]
    assert not bombed.passed
    if os.geteuid() == 0:
        assert len({r.uid for r in results + [bombed]}) == 5
    _assert_nothing_left(before)


def test_the_uid_pool_hands_out_distinct_uids_and_takes_them_back():
    with pooled_uid() as a, pooled_uid() as b:
        assert a != b and _in_pool(a) and _in_pool(b)
    with pooled_uid() as c:
        assert _in_pool(c)


def test_a_lock_directory_that_is_not_ours_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox.tempfile, "gettempdir", lambda: str(tmp_path))
    (tmp_path / "tabloop-sandbox-uids").mkdir(mode=0o777)
    os.chmod(tmp_path / "tabloop-sandbox-uids", 0o777)  # as someone else could have made it in /tmp
    with pytest.raises(SandboxUnavailable, match="mode 0700"):
        with pooled_uid():
            pass
    os.chmod(tmp_path / "tabloop-sandbox-uids", 0o700)
    with pooled_uid() as uid:
        assert stat.S_IMODE(os.stat(tmp_path / "tabloop-sandbox-uids" / str(uid - UID_POOL_BASE)).st_mode) == 0o600


# -- no isolation, no run ---------------------------------------------------------------------------

@pytest.fixture
def only_weak_isolation(monkeypatch):
    """As on a machine without namespaces: the probe finds only the plan with nothing."""
    monkeypatch.setattr(sandbox, "_plans", {})
    monkeypatch.setattr(sandbox, "_unsafe_warned", set())
    monkeypatch.setattr(sandbox, "_candidate_plans", lambda: [_Plan((), False)])


def test_without_isolation_it_refuses_to_run(only_weak_isolation, monkeypatch):
    monkeypatch.delenv(SANDBOX_VAR, raising=False)
    with pytest.raises(SandboxUnavailable, match=f"{SANDBOX_VAR}=unsafe"):
        run_tests("pass\n")
    monkeypatch.setenv(SANDBOX_VAR, "isolated")
    with pytest.raises(SandboxUnavailable, match="no .*net"):
        run_tests("pass\n")
    monkeypatch.setenv(SANDBOX_VAR, "sure")
    with pytest.raises(ValueError, match=SANDBOX_VAR):
        run_tests("pass\n")


def test_unsafe_runs_without_isolation_and_says_so(only_weak_isolation, monkeypatch, caplog):
    monkeypatch.setenv(SANDBOX_VAR, "unsafe")
    with caplog.at_level(logging.WARNING, logger="tabloop.sandbox"):
        result = run_tests("print('ran')\n")
    assert result.passed and result.stdout == "ran\n" and result.isolation in (("rlimits",), ("rlimits", "cgroup"))
    assert {"net", "uid", "seccomp"} <= set(result.missing), result  # what it did not get, by name
    assert any(f"{SANDBOX_VAR}=unsafe" in r.getMessage() for r in caplog.records)


def test_unsafe_can_come_from_the_config_file(only_weak_isolation, monkeypatch, tmp_path):
    monkeypatch.delenv(SANDBOX_VAR, raising=False)
    monkeypatch.delenv("TABLOOP_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tabloop.yaml").write_text("sandbox: unsafe\n")
    assert run_tests("pass\n").passed
    (tmp_path / "tabloop.yaml").write_text("sandbox: isolated\n")
    with pytest.raises(SandboxUnavailable):
        run_tests("pass\n")
