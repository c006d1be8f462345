"""The scorer's sandbox against programs that misbehave: each must be scored a failure and contained.

These run real subprocesses under whatever isolation this machine allows
(``SandboxResult.isolation``); a check that needs a mechanism the machine
lacks is skipped, saying which.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from streams.sandbox import NOBODY, OUTCOMES, _execute, _Plan, network_isolation_available, run_tests

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")


@pytest.fixture(scope="module")
def isolation() -> tuple[str, ...]:
    result = run_tests("pass\n")
    assert result.passed, result.stderr
    return result.isolation


def _sandbox_processes() -> set[int]:
    """Processes that look like the sandbox's: of its uid (when we are root) or working in one of its dirs."""
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
        if (os.geteuid() == 0 and uid == NOBODY) or in_sandbox_dir:
            found.add(int(entry))
    return found


def _assert_nothing_left(before: set[int]) -> None:
    deadline = time.monotonic() + 2  # the kernel may still be tearing the last ones down
    while (left := _sandbox_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
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
    assert "before reaching its end" in result.stderr
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
    if "uid" not in isolation and "user" not in isolation:
        pytest.skip(f"processes are not limited as root without a uid to drop to ({isolation})")
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
    if "mnt" not in isolation:
        pytest.skip(f"needs the mount namespace plan ({isolation})")
    before = _sandbox_processes()
    plan = _Plan(("mnt", "net"), NOBODY, NOBODY)
    result = _execute("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n", plan,
                      sys.executable, timeout_s=10.0, memory_bytes=512 * 2**20, max_file_bytes=2**20,
                      max_processes=64, max_output_bytes=4096, must_reach_end=True)
    assert result.passed and "pid" not in result.isolation, result
    _assert_nothing_left(before)


def test_a_huge_allocation_fails():
    result = run_tests("x = bytearray(10 * 2**30)\n", memory_bytes=512 * 2**20)
    assert not result.passed and result.outcome in ("memory", "failed"), result
    assert result.outcome == "memory" and "MemoryError" in result.stderr


def test_no_network(isolation):
    if not network_isolation_available():
        pytest.skip("no network namespace on this machine")
    assert "net" in isolation
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
    if where == "shared_tmp":
        target = f"/tmp/tabloop-escape-{uuid.uuid4().hex}"
        if "mnt" not in isolation:
            pytest.skip(f"/tmp is writable by everyone without a mount namespace ({isolation})")
    else:
        target = str(tmp_path / "escape.txt")
        if "mnt" not in isolation and "uid" not in isolation:
            pytest.skip(f"the sandbox runs as us ({isolation})")
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
    if "uid" not in isolation:
        pytest.skip(f"no uid to drop to ({isolation})")
    result = run_tests(f"import os\nassert os.getuid() == os.geteuid() == {NOBODY}\nassert os.getgroups() == []\n")
    assert result.passed, result.stderr


def test_errors_that_are_not_the_programs():
    result = run_tests("print(1)\n", python="/nonexistent/python3")
    assert (result.passed, result.outcome, result.exit_code) == (False, "error", None)
    assert "/nonexistent/python3" in result.stderr
    assert set(OUTCOMES) >= {result.outcome}
    with pytest.raises(ValueError, match="timeout_s"):
        run_tests("pass", timeout_s=0)
    with pytest.raises(TypeError):
        run_tests(b"pass")  # type: ignore[arg-type]
