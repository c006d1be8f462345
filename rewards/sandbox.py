"""The unit-test scorer's sandbox: run a completion's program and its tests in a throwaway jail.

``run_tests(program)`` runs Python source (the prefix, the completion, the
suffix, then the task's test code, e.g. HumanEval's ``check(candidate)``) in a
child process and says whether it passed. The program is untrusted: a policy
being trained on this reward will try everything a model can emit, so the
child gets, where the OS allows each of them:

* its own private directory (``tempfile.mkdtemp``) as cwd, HOME and TMPDIR,
  removed afterwards, and a minimal environment (nothing inherited);
* resource limits: address space (memory), file size, processes, CPU time,
  no core files;
* an unprivileged uid/gid of its own (from a pool, when we are root: root
  ignores RLIMIT_NPROC, so without this a fork bomb is not contained);
* a network namespace: no interface but a loopback that is down, so no
  connection to anything, not even 127.0.0.1;
* a PID namespace: when the program ends, the kernel kills whatever it left
  behind, ``setsid()`` or not, and reaps it;
* a mount namespace: the shared world-writable directories (/tmp, /var/tmp,
  /dev/shm…) become empty and read-only, its own directory becomes a small
  tmpfs (so it can't fill the disk), and directories the interpreter needs but
  its uid may not enter (a pyenv under /root) are grafted in read-only;
* an IPC namespace (System V and POSIX message queues of its own).

Which of these work is found once per interpreter by running a trivial
program with the strongest set and weakening it until one runs (a weaker set
is refused unless allowed, see below); every
``SandboxResult`` lists the ones it got (``isolation``), and
``network_isolation_available()`` says whether the network is cut off.
Without root only a user namespace can give the other namespaces, and there
is no uid to drop to: the program can then write wherever the caller can.

How a run goes: we start a small bootstrap (this file run as a script, so it
needs no import path) in a new session. It makes the namespaces, becomes the
*child subreaper* (every orphan of the sandbox becomes its child instead of
init's: some inits, this machine's among them, never reap), forks the child
that sets up the filesystem and the limits, drops privileges and execs the
program; then it reaps everything and reports on a control pipe. We kill the
bootstrap's whole tree when the program ends or its time is up, so nothing is
left running, not even a grandchild of a ``fork()`` that left the process
group, and finally ``killpg`` the group for good measure. No ``preexec_fn``:
it is not safe in a process with threads, and the scorer has them.

How a program passes: it exits 0 *and* the sandbox's harness says the tests
ran to their end. The harness (``_HARNESS``, run with ``python -c``) compiles
the program and the tests as two units (so no completion can swallow the tests
into a string literal) before any of it runs; starts a *verdict thread* that
reads the per-run nonce from a pipe and closes it; seals the process
(``PR_SET_DUMPABLE`` 0: /proc/self/mem and /proc/self/environ become root's,
closed to it); installs an audit hook; runs the program; restores the builtins
it may have patched; runs the tests; and, on its last line, wakes the verdict
thread, which writes the nonce to the result pipe only if the harness's frame
stands on that line. The supervisor wants exactly the nonce there. The nonce is
in no file, argument, environment variable or inherited fd, and in no frame the
program can reach: Python signal handlers (which get the frame they interrupt)
run only in the main thread, the hook refuses ``sys._current_frames``,
``gc.get_objects``/``get_referrers``/``get_referents``, ``sys.settrace``/
``setprofile`` (a trace function could jump over the tests),
``sys.addaudithook`` and anything ``ctypes``, and the thread allocates nothing
the collector tracks while the program runs (on 3.11 a collection, and the
program's finalizers, run in the allocating thread). The program can wake the
thread early (its lock is in the harness's frame): the thread then sees the
harness on another line and writes nothing. So printing or writing a token,
``sys.exit(0)``/``os._exit(0)``/``exit()`` before or during the tests, an
``atexit`` handler, reading the program's own file, /proc/self, its fds or its
memory, waking the verdict thread, and patching builtins the tests use all
fail. ``must_reach_end=False`` (test code that ends in ``unittest.main()``,
which exits on purpose) gives this up: exit status 0 passes.

What this cannot give while the tests and the program share an interpreter:
the program's code runs again during the tests, every time they call it and
through whatever it left behind (a thread, a signal handler, a finalizer, a
replaced ``sys.stdout`` or module, an import hook), and such code can defeat
the *meaning* of the tests: return objects equal to everything, patch what the
tests call next (``math.isclose``, a builtin, a test helper in the module's
globals; e.g. a thread that rebinds ``check`` to a no-op wins when the tests
make a call between defining and using it), or read the expected values from
the caller's frame (``sys._getframe`` stays allowed: ``typing``, ``logging``
and ``enum`` need it). A pass means the harness's own code got past the tests'
last line; only a second interpreter for the tests, calling the program over a
pipe with plain data, would make it mean the tests' verdict. On Python 3.12+
(collections run in any thread), a program that wakes the verdict thread early
and has a finalizer ready for the moment it wakes might read the nonce; a
memory-safety bug in CPython would too. Unprivileged (a user namespace, no uid
to drop to), the program is root of its namespace, which owns a non-dumpable
process's /proc files: /proc/self/mem stays open to it, and so does the nonce.

Runs must not share a uid (RLIMIT_NPROC counts every process of a uid, and a
uid can signal its own processes): as root each run takes a uid of its own from
a pool (``UID_POOL_BASE`` + a slot held with ``flock`` in a root-only directory,
so concurrent scorers in other processes get other uids too), with a group of
the same number. Unprivileged, the user namespace's processes count against the
caller's own uid; a fork bomb is then limited but shares that limit.

No isolation, no run: when the strongest set of mechanisms for our privileges
is not available, ``run_tests`` raises ``SandboxUnavailable`` rather than run
untrusted code with less, unless ``TABLOOP_SANDBOX=unsafe`` says to (logged as
a warning).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import resource
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("tabloop.sandbox")

OUTCOMES = ("passed", "failed", "timeout", "memory", "killed", "error")
PROGRAM_NAME = "program.py"
TESTS_NAME = "tests.py"
SETUP_FAILED = 125  # the bootstrap's exit status when the sandbox could not be made

# As root, each run gets a uid (and a gid of the same number) of its own from this pool. Far above
# the ranges distributions give users (1000+) and containers' subordinate ids (100000+), so no
# file or process on the machine belongs to it; the kernel must map it (it does outside a user
# namespace; inside one, the plan's probe fails and says so).
UID_POOL_BASE = 2_000_000_000
UID_POOL_SIZE = 4096
_UID_LOCK_DIR = "tabloop-sandbox-uids"  # under the temp dir: one lock file per slot, held while a run lasts

# The mechanisms a run must get, by our privileges; anything less needs TABLOOP_SANDBOX=unsafe.
REQUIRED_AS_ROOT = frozenset({"uid", "mnt", "pid", "net", "ipc", "rlimits"})
REQUIRED_UNPRIVILEGED = frozenset({"user", "pid", "net", "ipc", "rlimits"})
SANDBOX_VAR = "TABLOOP_SANDBOX"  # the ``sandbox`` setting
_NONCE_BYTES = 16

# World-writable directories all processes share: inside the mount namespace each is
# replaced by an empty read-only tmpfs, so a program can neither leave files there nor
# read what others left.
SHARED_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock")
_HIDE_OPTIONS = "mode=0755,size=1m,nr_inodes=4096"
_SCRATCH_INODES = 4096
_TAIL_BYTES = 8 * 2**10     # of a capped stream, this much of its end is kept (the traceback)
_KILL_WAIT_S = 5.0          # how long killing the tree and the bootstrap's exit may take
_DRAIN_S = 2.0              # reading what is left in the pipes after everything is dead
_ENV_PATH = "/usr/local/bin:/usr/bin:/bin"

# Linux: sched.h, sys/mount.h, sys/prctl.h.
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
_NAMESPACE_FLAGS = {"user": CLONE_NEWUSER, "mnt": CLONE_NEWNS, "pid": CLONE_NEWPID,
                    "net": CLONE_NEWNET, "ipc": CLONE_NEWIPC}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 38, 36

_LINUX = sys.platform.startswith("linux")
_SECCOMP_ARCH = _LINUX and os.uname().machine == "x86_64"  # the filter below is written for x86_64's syscalls

# Every layer there is, by our privileges: a result's ``missing`` names those of these it did not get.
FULL_AS_ROOT = REQUIRED_AS_ROOT | {"dev", "sys", "seccomp", "cgroup"}
FULL_UNPRIVILEGED = REQUIRED_UNPRIVILEGED | {"seccomp", "cgroup"}
# A private /dev holds these, bound from the host's; nothing else (no ptmx, no pts, no disks).
DEV_NODES = ("null", "zero", "random", "urandom")
MAX_OPEN_FILES = 64         # RLIMIT_NOFILE of each process of a run (× the run's process cap: all its files)
_MESSAGE_BYTES = 16 * 2**20  # the most one message between the tests and the program may hold


class SandboxUnavailable(RuntimeError):
    """The OS won't give the isolation untrusted code needs here, and nobody said to run it anyway."""


@dataclass(frozen=True)
class SandboxResult:
    """How one program fared.

    ``outcome`` is one of ``OUTCOMES``: passed, failed (non-zero exit, an
    assertion, or an exit before the end), timeout (wall clock or CPU limit),
    memory (MemoryError under the memory limit), killed (another signal),
    error (the sandbox could not start it; ``stderr`` says why). ``exit_code``
    is the program's, negative for a signal as in ``subprocess`` (-9 after a
    timeout), None when it never ran. ``stdout``/``stderr`` are capped: their
    start and end, with a note of what was left out. ``isolation`` names the
    mechanisms this run got: "uid", "user", "mnt", "pid", "net", "ipc",
    "rlimits"; ``uid`` the uid it ran as (None: it didn't drop to one).
    """

    passed: bool
    outcome: str
    exit_code: int | None
    duration_s: float
    stdout: str
    stderr: str
    isolation: tuple[str, ...] = ()
    uid: int | None = None  # the uid it ran as, when we dropped to one
    missing: tuple[str, ...] = ()  # the layers of the full set (``full_isolation()``) this run did not get
    verdict: str = "nonce"  # "trusted": the tests ran in a process of their own; "nonce": see the docstring

    @property
    def network_isolated(self) -> bool:
        return "net" in self.isolation


@dataclass(frozen=True)
class _Plan:
    """What a run asks the OS for: the namespaces, whether to drop to a uid of its own (as root), and
    whether to harden it (a private /dev and no /sys, with a mount namespace; the seccomp filter)."""

    namespaces: tuple[str, ...]
    drop: bool
    hardened: bool = False

    @property
    def isolation(self) -> tuple[str, ...]:
        extra: tuple[str, ...] = ()
        if self.hardened:
            extra = (("dev", "sys") if "mnt" in self.namespaces else ()) + (("seccomp",) if _SECCOMP_ARCH else ())
        return (("uid",) if self.drop else ()) + self.namespaces + ("rlimits",) + extra


_plans: dict[str, _Plan] = {}
_plans_lock = threading.Lock()
_unsafe_warned: set[str] = set()


def run_tests(program: str, *, tests: str | None = None, timeout_s: float = 10.0,
              memory_bytes: int = 512 * 2**20, max_file_bytes: int = 16 * 2**20, max_processes: int = 64,
              python: str = sys.executable, max_output_bytes: int = 64 * 2**10, must_reach_end: bool = True,
              uid: int | None = None, gid: int | None = None) -> SandboxResult:
    """Run ``program`` and then ``tests`` (Python source) in the sandbox; see the module docstring.

    ``tests`` is compiled apart from the program and run after it in its
    namespace, with the builtins as they were before the program; ``None``:
    ``program`` holds its own tests. ``memory_bytes`` caps the address space,
    ``max_file_bytes`` any one file it writes and, with a mount namespace, all
    its files together; ``max_processes`` the processes (and threads) of its
    uid; the CPU limit is a second above ``timeout_s``. As root the run gets a
    uid of its own from the pool unless ``uid`` (and ``gid``, default the same)
    names one; unprivileged they are ignored. Raises ``SandboxUnavailable`` if
    the isolation is short of the full set and ``TABLOOP_SANDBOX`` is not ``unsafe``.
    """
    if not isinstance(program, str):
        raise TypeError(f"program must be Python source as str, got {type(program).__name__}")
    if tests is not None and not isinstance(tests, str):
        raise TypeError(f"tests must be Python source as str, got {type(tests).__name__}")
    for name, value in (("timeout_s", timeout_s), ("memory_bytes", memory_bytes),
                        ("max_file_bytes", max_file_bytes), ("max_processes", max_processes),
                        ("max_output_bytes", max_output_bytes)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    exe = _resolve_python(python)
    if exe is None:
        return SandboxResult(False, "error", None, 0.0, "", f"[sandbox] no Python interpreter at {python!r}")
    plan = _plan_for(exe)
    missing = required_isolation() - set(plan.isolation)
    if missing:
        if sandbox_mode() != "unsafe":
            raise SandboxUnavailable(
                f"the sandbox can only get {', '.join(plan.isolation)} here (no {', '.join(sorted(missing))}): "
                f"refusing to run untrusted code with less isolation; set {SANDBOX_VAR}=unsafe to run it anyway")
        if exe not in _unsafe_warned:
            _unsafe_warned.add(exe)
            log.warning("sandbox: %s=unsafe: running untrusted programs with only %s (no %s)", SANDBOX_VAR,
                        ", ".join(plan.isolation), ", ".join(sorted(missing)))
    limits = dict(timeout_s=timeout_s, memory_bytes=memory_bytes, max_file_bytes=max_file_bytes,
                  max_processes=max_processes, max_output_bytes=max_output_bytes, must_reach_end=must_reach_end)
    if not plan.drop:
        return _execute(program, tests, plan, exe, None, None, **limits)
    with contextlib.ExitStack() as held:
        # The judge (with tests) gets a uid of its own too: neither side can signal or ptrace the other.
        judge_uid = held.enter_context(pooled_uid()) if tests is not None else None
        if uid is None:
            uid = held.enter_context(pooled_uid())
        return _execute(program, tests, plan, exe, uid, uid if gid is None else gid, judge_uid=judge_uid, **limits)


def sandbox_mode() -> str:
    """The ``sandbox`` setting (``TABLOOP_SANDBOX``): "isolated" (the default) or "unsafe".

    Loaded here, and only when the isolation is short of the full set, rather
    than passed in: ``run_tests`` is also called where there is no Settings
    object (``tabloop eval``, the simulator), and the rule must hold everywhere.
    """
    from infra.settings import load_settings  # not at the top: the bootstrap runs this file with no import path

    return load_settings().sandbox


def required_isolation() -> frozenset[str]:
    """The mechanisms a run must get without ``TABLOOP_SANDBOX=unsafe``, by our privileges."""
    return REQUIRED_AS_ROOT if os.geteuid() == 0 else REQUIRED_UNPRIVILEGED


def isolation_available(python: str = sys.executable) -> tuple[str, ...]:
    """The mechanisms programs run by ``python`` get here (probed once); compare with ``required_isolation``."""
    exe = _resolve_python(python)
    return _plan_for(exe).isolation if exe is not None else ()


def network_isolation_available(python: str = sys.executable) -> bool:
    """Whether programs run by ``python`` get no network (a namespace of their own). Probed once."""
    return "net" in isolation_available(python)


@contextlib.contextmanager
def pooled_uid():
    """A uid no other run holds, in this process or another, for as long as the ``with`` lasts.

    Each slot of the pool is a lock file in a directory only we (root) may
    enter; ``flock`` is released by the kernel when the holder exits, however
    it exits, so a crashed scorer leaves no slot taken.
    """
    directory = _uid_lock_dir()
    start = secrets.randbelow(UID_POOL_SIZE)  # concurrent runs rarely probe the same slots
    for i in range(UID_POOL_SIZE):
        slot = (start + i) % UID_POOL_SIZE
        fd = os.open(os.path.join(directory, str(slot)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield UID_POOL_BASE + slot
        finally:
            os.close(fd)
        return
    raise SandboxUnavailable(f"all {UID_POOL_SIZE} sandbox uids are in use")


def _uid_lock_dir() -> str:
    directory = os.path.join(tempfile.gettempdir(), _UID_LOCK_DIR)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    # In a shared /tmp someone else could have made it first (a symlink, or theirs): then it isn't ours.
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SandboxUnavailable(f"{directory} must be a directory of uid {os.geteuid()} with mode 0700 "
                                 f"(it is uid {st.st_uid}, mode {stat.filemode(st.st_mode)}): remove it")
    return directory


# -- one budget per run: a cgroup ----------------------------------------------------------------

_cgroup_warned: list[str] = []


def _cgroup_mounts() -> dict[str, str]:
    """Where each cgroup hierarchy is mounted: "unified" for cgroup v2, else the v1 controller's name."""
    found: dict[str, str] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            found.setdefault("unified", fields[4])
        elif tail[0] == "cgroup":
            for option in tail[2].split(","):
                if option in ("memory", "pids"):
                    found.setdefault(option, fields[4])
    return found


def _own_cgroups() -> dict[str, str]:
    """Our cgroup in each hierarchy, from /proc/self/cgroup: "unified" (v2) and v1 controllers by name."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f.read().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                own["unified"] = path
            for c in controllers.split(","):
                if c in ("memory", "pids"):
                    own[c] = path
    return own


class RunCgroup:
    """A cgroup for one run (memory, swap and processes capped for all of its processes together): v2 where
    our cgroup delegates the memory and pids controllers, else v1's memory and pids hierarchies where we may
    write them (root). ``make`` returns None, and says why once, when neither is possible here."""

    def __init__(self, dirs: list[str], version: int):
        self.dirs, self.version = dirs, version

    @classmethod
    def make(cls, memory_bytes: int, max_processes: int) -> "RunCgroup | None":
        if not _LINUX:
            return None
        name = f"tabloop-sandbox-{os.getpid()}-{secrets.token_hex(6)}"
        made: list[str] = []
        try:
            mounts, own = _cgroup_mounts(), _own_cgroups()
            v2 = os.path.join(mounts.get("unified", "/nonexistent"), own.get("unified", "/").lstrip("/"))
            delegated = set()
            with contextlib.suppress(OSError):
                with open(os.path.join(v2, "cgroup.subtree_control")) as f:
                    delegated = set(f.read().split())
            if {"memory", "pids"} <= delegated:
                path = os.path.join(v2, name)
                os.mkdir(path, 0o700)
                made.append(path)
                group = cls(made, 2)
                group._write(path, "memory.max", memory_bytes)
                with contextlib.suppress(FileNotFoundError):  # no swap accounting: no swap to take
                    group._write(path, "memory.swap.max", 0)
                group._write(path, "pids.max", max_processes)
                return group
            if "memory" in mounts and "pids" in mounts:
                for controller in ("memory", "pids"):
                    path = os.path.join(mounts[controller], own.get(controller, "/").lstrip("/"), name)
                    os.mkdir(path, 0o700)
                    made.append(path)
                group = cls(made, 1)
                group._write(made[0], "memory.limit_in_bytes", memory_bytes)
                with contextlib.suppress(FileNotFoundError):  # memsw: memory and swap together
                    group._write(made[0], "memory.memsw.limit_in_bytes", memory_bytes)
                group._write(made[1], "pids.max", max_processes)
                return group
            raise OSError("no cgroup v2 delegation of memory and pids, and no cgroup v1 memory and pids "
                          "hierarchies")
        except OSError as e:
            for path in reversed(made):
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            if not _cgroup_warned:
                _cgroup_warned.append(str(e))
                log.warning("sandbox: no cgroup for the runs (%s): a run's processes are capped one by one "
                            "(memory × processes bound their sum)", e)
            return None

    @staticmethod
    def _write(path: str, name: str, value: int) -> None:
        with open(os.path.join(path, name), "w") as f:
            f.write(f"{value}\n")

    @property
    def procs_files(self) -> list[str]:
        """Where the bootstrap writes its pid, so that it and all it starts are in the cgroup."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        """How many of the run's processes the kernel killed for the memory cap."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.dirs[0], name)) as f:
                for line in f.read().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def close(self) -> None:
        """Kill whatever is still in it and remove it."""
        give_up = time.monotonic() + _KILL_WAIT_S
        for path in self.dirs:
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > give_up:
                        log.error("sandbox: cgroup %s still has processes; left behind", path)
                        break
                with contextlib.suppress(OSError):
                    with open(os.path.join(path, "cgroup.procs")) as f:
                        for pid in f.read().split():
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.005)


# -- choosing what the OS allows ---------------------------------------------------------------

def _resolve_python(python: str) -> str | None:
    found = shutil.which(python) if os.sep not in python else python
    return os.path.abspath(found) if found and os.path.isfile(found) else None


def _candidate_plans() -> list[_Plan]:
    """From the strongest to nothing at all; the first that runs a trivial program is used."""
    if not _LINUX:
        return [_Plan((), True), _Plan((), False)] if os.geteuid() == 0 else [_Plan((), False)]
    if os.geteuid() == 0:
        return [_Plan(("mnt", "pid", "net", "ipc"), True, True), _Plan(("mnt", "pid", "net", "ipc"), True),
                _Plan(("mnt", "net"), True),
                _Plan(("net",), True), _Plan((), True), _Plan((), False)]
    # Unprivileged: a user namespace (if the kernel lets us) gives the others; no uid to drop to.
    return [_Plan(("user", "pid", "net", "ipc"), False, True), _Plan(("user", "pid", "net", "ipc"), False),
            _Plan(("user", "net"), False), _Plan((), False)]


def _probe(plan: _Plan, python: str) -> SandboxResult:
    limits = dict(timeout_s=20.0, memory_bytes=512 * 2**20, max_file_bytes=2**20, max_processes=64,
                  max_output_bytes=4096, must_reach_end=True)
    if not plan.drop:
        return _execute("pass\n", None, plan, python, None, None, **limits)
    with pooled_uid() as uid:
        return _execute("pass\n", None, plan, python, uid, uid, **limits)


def _plan_for(python: str) -> _Plan:
    with _plans_lock:
        if python in _plans:
            return _plans[python]
        candidates = _candidate_plans()
        for plan in candidates:
            probe = _probe(plan, python)
            if probe.passed:
                break
            log.debug("sandbox: %s unavailable: %s", plan.isolation, probe.stderr.strip()[-500:])
        else:
            # Nothing runs even a trivial program: the interpreter is broken, not the isolation.
            # Don't remember it; runs will report the error.
            return candidates[0]
        _plans[python] = plan
    if plan is not candidates[0]:
        log.warning("sandbox: running programs with only %s (no %s)", ", ".join(plan.isolation),
                    ", ".join(sorted(set(candidates[0].isolation) - set(plan.isolation))))
    else:
        log.info("sandbox: programs run with %s", ", ".join(plan.isolation))
    return plan


def _may_enter(st: os.stat_result, uid: int, gid: int) -> bool:
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _blocked_ancestor(path: str, uid: int, gid: int) -> str | None:
    """The shallowest directory on the way to ``path`` (not itself) that uid:gid may not enter."""
    parts = path.strip("/").split("/")[:-1]
    for i in range(1, len(parts) + 1):
        ancestor = "/" + "/".join(parts[:i])
        try:
            if not _may_enter(os.stat(ancestor), uid, gid):
                return ancestor
        except OSError:
            return None
    return None


def _is_under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _filesystem_layout(python: str, workdir: str, uid: int, gid: int) -> tuple[list[str], list[str]]:
    """What the mount namespace hides (replaces by an empty read-only tmpfs) and grafts back in.

    Grafted: the interpreter's prefixes (the venv and the real installation a
    venv points to) where the way to them is closed to uid:gid.
    """
    keeps = sorted({os.path.realpath(os.path.dirname(os.path.dirname(p)))
                    for p in (python, os.path.realpath(python))})
    hides = {os.path.realpath(d) for d in SHARED_WRITABLE_DIRS if os.path.isdir(d)}
    for path in keeps + [workdir]:
        blocked = _blocked_ancestor(path, uid, gid)
        if blocked:
            hides.add(blocked)
    hides.discard("/")
    hides = sorted(h for h in hides if not any(o != h and _is_under(h, o) for o in hides))
    keeps = [k for k in keeps if any(_is_under(k, h) and k != h for h in hides)]
    return hides, keeps


# -- one run ---------------------------------------------------------------------------------

class _CappedBuffer:
    """Keeps the first and the last bytes of a stream, and counts what it dropped between."""

    def __init__(self, cap: int):
        self.tail_cap = min(_TAIL_BYTES, cap // 4)
        self.head_cap = cap - self.tail_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self.tail_cap:
            self.tail += data
            del self.tail[:-self.tail_cap]

    def text(self) -> str:
        dropped = self.total - len(self.head) - len(self.tail)
        middle = f"\n[... {dropped} bytes left out ...]\n".encode() if dropped else b""
        return (bytes(self.head) + middle + bytes(self.tail)).decode("utf-8", "replace")


def _minimal_env(workdir: str) -> dict[str, str]:
    return {"PATH": _ENV_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8", "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1"}


def _execute(program: str, tests: str | None, plan: _Plan, python: str, uid: int | None, gid: int | None, *,
             timeout_s: float, memory_bytes: int, max_file_bytes: int, max_processes: int, max_output_bytes: int,
             must_reach_end: bool, max_open_files: int = MAX_OPEN_FILES, judge_uid: int | None = None) -> SandboxResult:
    """Run ``program`` then ``tests`` under ``plan`` (as ``uid``:``gid`` if it drops): write them to a
    fresh directory, start the bootstrap (and, with ``tests``, the judge that runs them), supervise."""
    trusted = tests is not None
    nonce = secrets.token_hex(_NONCE_BYTES).encode()
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="tabloop-sandbox-"))
    control_r, control_w = os.pipe()
    if trusted:  # calls from the judge to the program, answers back, the judge's verdict to us
        (program_in, judge_out), (judge_in, program_out), (result_r, result_w) = os.pipe(), os.pipe(), os.pipe()
        judge_control_r, judge_control_w = os.pipe()  # the judge's bootstrap says there if it could not start it
        fds = [control_r, control_w, program_in, judge_out, judge_in, program_out, result_r, result_w,
               judge_control_r, judge_control_w]
    else:
        (program_in, nonce_w), (result_r, program_out) = os.pipe(), os.pipe()
        fds = [control_r, control_w, program_in, nonce_w, result_r, program_out]
    cgroup = RunCgroup.make(memory_bytes, max_processes) if _LINUX else None
    judge = None
    try:
        if not trusted:
            # The nonce waits in a pipe whose only reader is the harness, which takes it before the program
            # runs; it is never in a file, an argument or the environment.
            os.write(nonce_w, nonce)
            os.close(nonce_w)
            fds.remove(nonce_w)
        files = []
        # With a judge the tests never enter the sandbox: the program can't read what they expect.
        for name, source in ((PROGRAM_NAME, program),) + (() if trusted else ((TESTS_NAME, tests or ""),)):
            path = os.path.join(workdir, name)
            with open(path, "w", encoding="utf-8") as f:
                f.write(source)
            os.chmod(path, 0o644)
            files.append(name)
        hides: list[str] = []
        keeps: list[str] = []
        if plan.drop:
            if "mnt" in plan.namespaces:
                hides, keeps = _filesystem_layout(python, workdir, uid, gid)
            else:  # no tmpfs of its own: it works in the real directory, which must be its own
                os.chown(workdir, uid, gid)
        cpu_s = math.ceil(timeout_s) + 1
        if trusted:
            argv = [python, "-s", "-B", "-c", _SERVER, os.path.join(workdir, PROGRAM_NAME), str(program_in),
                    str(program_out), str(_MESSAGE_BYTES)]
        else:
            argv = [python, "-s", "-B", "-c", _HARNESS, os.path.join(workdir, PROGRAM_NAME),
                    os.path.join(workdir, TESTS_NAME), str(program_in), str(program_out)]
        config = {
            "python": python, "argv": argv, "workdir": workdir, "files": files,
            "namespaces": list(plan.namespaces), "uid": uid if plan.drop else None, "gid": gid if plan.drop else None,
            "hides": hides, "keeps": keeps, "scratch_bytes": max_file_bytes,
            "limits": {"as": memory_bytes, "fsize": max_file_bytes, "nproc": max_processes, "cpu": cpu_s,
                       "nofile": max_open_files},
            "control_fd": control_w, "program_fds": [program_in, program_out], "parent_pid": os.getpid(),
            "hardened": plan.hardened and "mnt" in plan.namespaces, "seccomp": plan.hardened and _SECCOMP_ARCH,
            "cgroup_procs": cgroup.procs_files if cgroup else [],
        }
        isolation = plan.isolation + (("cgroup",) if cgroup else ())
        bootstrap = [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(config)]
        start = time.monotonic()
        try:
            proc = subprocess.Popen(bootstrap, cwd=workdir, env=_minimal_env(workdir), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(control_w, program_in, program_out), start_new_session=True)
            if trusted:
                judge = _start_judge(plan, python, workdir, config, judge_uid, judge_control_w,
                                     (judge_out, judge_in, result_w), must_reach_end=must_reach_end,
                                     memory_bytes=memory_bytes)
        except (OSError, subprocess.SubprocessError) as e:
            if "proc" in locals():
                _kill_tree(proc)
            return SandboxResult(False, "error", None, 0.0, "", f"[sandbox] could not start: {e}",
                                 isolation, config["uid"], _missing(isolation), "trusted" if trusted else "nonce")
        for fd in (control_w, program_in, program_out) + (
                (judge_out, judge_in, result_w, judge_control_w) if trusted else ()):
            os.close(fd)
            fds.remove(fd)
        if judge is not None:
            with contextlib.suppress(OSError):  # a judge that died at once says so on its stderr
                judge.stdin.write(tests.encode("utf-8", "surrogateescape"))
            with contextlib.suppress(OSError):
                judge.stdin.close()
        return _supervise(proc, control_r, result_r, nonce, isolation, config["uid"], start=start,
                          timeout_s=timeout_s, max_output_bytes=max_output_bytes, must_reach_end=must_reach_end,
                          judge=judge, judge_control_r=judge_control_r if trusted else None, cgroup=cgroup)
    finally:
        if judge is not None and judge.poll() is None:
            _kill_tree(judge)
        if cgroup is not None:
            cgroup.close()
        for fd in fds:
            os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)


def _start_judge(plan: _Plan, python: str, workdir: str, program_config: dict, judge_uid: int | None,
                 control_w: int, pipes: tuple[int, int, int], *, must_reach_end: bool,
                 memory_bytes: int) -> subprocess.Popen:
    """Start the judge (``_JUDGE``) through the bootstrap, in a jail like the program's: the same namespaces
    (no network), the run's cgroup (its memory is the run's), the limits, a uid of its own (as root) and a
    scratch directory of its own. It runs trusted code, the tests, but reads what the program sends: it gets
    no more than it needs. The tests reach it on stdin; ``pipes`` are its calls, the answers and the verdict."""
    call_fd, reply_fd, verdict_fd = pipes
    judge_dir = os.path.join(workdir, "judge")  # not the program's: its workdir is a tmpfs of its own
    os.mkdir(judge_dir, 0o700)
    hides: list[str] = []
    keeps: list[str] = []
    if plan.drop:
        if "mnt" in plan.namespaces:
            hides, keeps = _filesystem_layout(python, judge_dir, judge_uid, judge_uid)
        else:
            os.chown(judge_dir, judge_uid, judge_uid)
    judge_config = {"call_fd": call_fd, "reply_fd": reply_fd, "verdict_fd": verdict_fd,
                    "must_reach_end": must_reach_end, "limit": _MESSAGE_BYTES}
    # The judge's address space: its own copy of what crosses (a message up to _MESSAGE_BYTES) and the
    # tests' data; the run's cgroup counts it with the program's.
    limits = dict(program_config["limits"], **{"as": max(2 * memory_bytes, 2**30)})
    config = dict(program_config, argv=[python, "-I", "-B", "-c", _JUDGE, json.dumps(judge_config)],
                  workdir=judge_dir, files=[], uid=judge_uid if plan.drop else None,
                  gid=judge_uid if plan.drop else None, hides=hides, keeps=keeps, limits=limits,
                  control_fd=control_w, program_fds=list(pipes))
    bootstrap = [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(config)]
    return subprocess.Popen(bootstrap, cwd=judge_dir, env=_minimal_env(judge_dir), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(control_w,) + pipes,
                            start_new_session=True)


def _missing(isolation: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted((FULL_AS_ROOT if os.geteuid() == 0 else FULL_UNPRIVILEGED) - set(isolation)))


def _supervise(proc: subprocess.Popen, control_r: int, result_r: int, nonce: bytes, isolation: tuple[str, ...],
               uid: int | None, *, start: float, timeout_s: float, max_output_bytes: int, must_reach_end: bool,
               judge: subprocess.Popen | None = None, judge_control_r: int | None = None,
               cgroup: RunCgroup | None = None) -> SandboxResult:
    """Collect the output until the program ends (with a judge: until the judge has its verdict) or the time
    is up, then leave nothing running."""
    out, err = _CappedBuffer(max_output_bytes), _CappedBuffer(max_output_bytes)
    control, verdict = _CappedBuffer(4096), _CappedBuffer(4096)
    judge_out, judge_err = _CappedBuffer(max_output_bytes), _CappedBuffer(max_output_bytes)
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, control_r: control}
    judge_control = _CappedBuffer(4096)
    if judge is not None:
        sinks.update({judge.stdout.fileno(): judge_out, judge.stderr.fileno(): judge_err, result_r: verdict,
                      judge_control_r: judge_control})
    deadline = start + timeout_s
    timed_out = False
    ended_first = False  # the program ended before the judge's verdict
    with selectors.DefaultSelector() as sel:
        for fd in sinks:
            sel.register(fd, selectors.EVENT_READ)

        def running() -> bool:
            if judge is not None:
                return result_r in sinks  # the judge holds its end until it exits
            return control_r in sinks and b"exit " not in control.head

        while running():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            _pump(sel, sinks, remaining)
        duration = time.monotonic() - start
        if judge is not None:
            ended_first = b"exit " in control.head
            # The judge hung up: the program reads the end of its calls and exits; a moment for that.
            grace = min(time.monotonic() + 1.0, deadline + 1.0)
            while control_r in sinks and b"exit " not in control.head and time.monotonic() < grace:
                _pump(sel, sinks, grace - time.monotonic())
        _kill_tree(proc)
        if judge is not None:
            if not timed_out:  # the verdict is out: its bootstrap reaps the judge and exits with its status
                with contextlib.suppress(subprocess.TimeoutExpired):
                    judge.wait(timeout=_KILL_WAIT_S)
            _kill_tree(judge)
        else:
            sinks[result_r] = verdict
            sel.register(result_r, selectors.EVENT_READ)
        drain_until = time.monotonic() + _DRAIN_S
        while sinks and time.monotonic() < drain_until:  # every writer is dead: this is quick
            _pump(sel, sinks, drain_until - time.monotonic())
    for stream in (proc.stdout, proc.stderr) + ((judge.stdout, judge.stderr) if judge is not None else ()):
        stream.close()

    lines = control.text().splitlines()
    failure = next((line[5:] for line in lines if line.startswith("fail ")), None)
    judge_failure = next((line[5:] for line in judge_control.text().splitlines() if line.startswith("fail ")), None)
    status = next((int(line[5:]) for line in lines if line.startswith("exit ") and line[5:].isdigit()), None)
    exit_code = os.waitstatus_to_exitcode(status) if status is not None else proc.returncode
    oom = cgroup.oom_kills() if cgroup is not None else 0
    notes = []
    if failure is not None or (status is None and not timed_out and judge is None):
        outcome, exit_code = "error", None
        notes.append(f"[sandbox] could not run the program: {failure or f'bootstrap exited {proc.returncode}'}")
    elif judge_failure is not None:
        outcome = "error"
        notes.append(f"[sandbox] could not run the tests' judge: {judge_failure}")
    elif timed_out:
        outcome = "timeout"
        notes.append(f"[sandbox] killed after {timeout_s:g}s")
    elif judge is not None:
        # The verdict is the judge's alone: the tests' own code, run outside the sandbox, over plain data.
        if bytes(verdict.head) == b"passed\n" and judge.returncode == 0:
            outcome = "passed"
        elif oom:
            outcome = "memory"
            notes.append(f"[sandbox] the run went over its memory cap ({oom} process(es) killed for it)")
        elif ended_first and exit_code is not None and exit_code < 0:
            outcome = "timeout" if -exit_code == signal.SIGXCPU else "killed"
            notes.append(f"[sandbox] killed by signal {_signal_name(-exit_code)}")
        elif judge.returncode not in (0, None) and not verdict.total:
            outcome = "timeout" if judge.returncode == -signal.SIGXCPU else "failed"
            notes.append(f"[sandbox] the tests' process ended without a verdict (status {judge.returncode})")
        else:
            outcome = "memory" if b"MemoryError" in err.tail or b"MemoryError" in err.head[-_TAIL_BYTES:] else "failed"
    elif exit_code == 0:
        # Exactly the nonce: anything else written to the result pipe (guesses, junk) is a failure too.
        if not must_reach_end or (verdict.total == len(nonce) and bytes(verdict.head) == nonce):
            outcome = "passed"
        else:
            outcome = "failed"
            notes.append("[sandbox] the program exited 0 but the harness did not see the tests run to their end "
                         "(sys.exit? os._exit? tampering?)")
    elif exit_code < 0:
        outcome = "timeout" if -exit_code == signal.SIGXCPU else ("memory" if oom else "killed")
        notes.append(f"[sandbox] killed by signal {_signal_name(-exit_code)}"
                     + (" (the run went over its memory cap)" if oom else ""))
    else:
        outcome = "memory" if b"MemoryError" in err.tail or b"MemoryError" in err.head[-_TAIL_BYTES:] else "failed"
    stdout, stderr = out.text() + judge_out.text(), err.text() + judge_err.text()
    if notes:
        stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + "\n".join(notes) + "\n"
    return SandboxResult(outcome == "passed", outcome, exit_code, round(duration, 3), stdout, stderr,
                         isolation, uid, _missing(isolation), "trusted" if judge is not None else "nonce")


def _pump(sel: selectors.BaseSelector, sinks: dict[int, _CappedBuffer], timeout: float) -> None:
    for key, _ in sel.select(max(timeout, 0)):
        data = os.read(key.fd, 65536)
        if data:
            sinks[key.fd].feed(data)
        else:
            sel.unregister(key.fd)
            del sinks[key.fd]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _descendants(root: int) -> list[int]:
    """Live (not zombie) processes below ``root``, from a scan of /proc."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                line = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = line[line.rindex(")") + 2:].split()  # the command name may hold spaces and ')'
        children.setdefault(int(fields[1]), []).append((int(entry), fields[0]))
    found, todo = [], [root]
    while todo:
        for pid, state in children.get(todo.pop(), ()):
            todo.append(pid)
            if state not in ("Z", "X"):
                found.append(pid)
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL everything below the bootstrap, let it reap them and exit, then kill its group.

    As the subreaper, the bootstrap is the ancestor of every process the
    program made, however it forked or whichever session it moved to; a fork
    bomb is beaten by killing until a scan finds nothing alive.
    """
    give_up = time.monotonic() + _KILL_WAIT_S
    if _LINUX:
        while time.monotonic() < give_up:
            victims = _descendants(proc.pid)
            if not victims:
                break
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.005)
    # The bootstrap exits once it has reaped them all. Wait without reaping it, so that its
    # process group can't have been reused when we kill it.
    while time.monotonic() < give_up:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break
        except ChildProcessError:
            break
        time.sleep(0.005)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=_KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        log.error("sandbox: bootstrap %d did not exit; left behind", proc.pid)


# -- the harness: what the program's interpreter runs (python -c), before and after the program -----

# Trusted code that runs first in the program's own interpreter. It may rely on nothing the program
# can change later: every builtin and function it calls after the program starts is bound before,
# and the hook touches no object the program made (an argument's __eq__ would run the program's code
# inside the hook, where the nonce is). Keep it small; the module docstring says what it guarantees.
_HARNESS = r"""
def _tabloop_sandbox_verdict(nonce_fd, result_fd, end_frame, end_line, ready, go, done):
    # A thread of its own, so the nonce is in no frame the program can reach: Python signal handlers
    # (which get the current frame) run only in the main thread; sys._current_frames and gc are
    # refused; and, once the program runs, this thread allocates nothing the collector tracks, so no
    # finalizer of the program's runs here (Python 3.11: collections run in the allocating thread).
    import os
    nonce = b""
    while True:
        chunk = os.read(nonce_fd, 256)
        if not chunk:
            break
        nonce += chunk
    os.close(nonce_fd)
    write = os.write
    ready.release()
    go.acquire()
    # Woken by the harness on its last line, past the tests, or by the program (it can reach the lock):
    # only the harness's frame standing on that line says which.
    if end_frame.f_lineno == end_line:
        write(result_fd, nonce)
    nonce = None
    done.release()


def _tabloop_sandbox_hook(event, args, type=type, str=str, RuntimeError=RuntimeError):
    # Refuses what would reach the verdict thread's frame or rewrite the harness's control flow. It
    # holds no secret, and binds its builtins now (the program may patch them).
    if event in ("sys._current_frames", "sys.settrace", "sys.setprofile", "sys.addaudithook",
                 "gc.get_objects", "gc.get_referrers", "gc.get_referents") or event.startswith("ctypes."):
        raise RuntimeError(f"[sandbox] {event} is not allowed in a sandboxed program")
    if event == "import":
        name = args[0]
        if type(name) is not str or name in ("ctypes", "_ctypes") or name.startswith("ctypes."):
            raise RuntimeError("[sandbox] importing ctypes is not allowed in a sandboxed program")


def _tabloop_sandbox_main(program_path):
    # A fresh __main__ for the program with the audit hook on: where both harnesses run it.
    import builtins, sys, types

    main = types.ModuleType("__main__")
    namespace = main.__dict__
    namespace.update(__file__=program_path, __builtins__=builtins)
    sys.modules["__main__"] = main
    sys.argv = [program_path]
    sys.addaudithook(_tabloop_sandbox_hook)
    return namespace


def _tabloop_sandbox_seal():
    # Not dumpable: /proc/self/mem, /proc/self/environ… become root's, closed to the program (it
    # could otherwise read the nonce out of its own memory). ctypes goes once used.
    import sys
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "[sandbox] prctl(PR_SET_DUMPABLE, 0) failed")
    for name in [n for n in sys.modules if n in ("ctypes", "_ctypes") or n.startswith("ctypes.")]:
        del sys.modules[name]


def _tabloop_sandbox_harness():
    import _thread, builtins, sys, types
    program_path, tests_path, nonce_fd, result_fd = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    # Both read and compiled before any of the program runs, each on its own: the program can't
    # change the tests, nor swallow them (an unclosed string), nor patch open() or compile().
    with open(program_path, "rb") as f:
        program = compile(f.read(), program_path, "exec", dont_inherit=True)
    with open(tests_path, "rb") as f:
        tests = compile(f.read(), tests_path, "exec", dont_inherit=True)
    run = exec  # bound now: the program may replace builtins.exec
    builtins_ns = builtins.__dict__
    original_builtins = dict(builtins_ns)
    clear_builtins, update_builtins = builtins_ns.clear, builtins_ns.update
    ready, go, done = _thread.allocate_lock(), _thread.allocate_lock(), _thread.allocate_lock()
    for lock in (ready, go, done):
        lock.acquire()
    _thread.start_new_thread(_tabloop_sandbox_verdict,
                             (nonce_fd, result_fd, sys._getframe(), END_LINE, ready, go, done))
    if not ready.acquire(timeout=30):
        raise RuntimeError("[sandbox] the verdict thread did not start")
    _tabloop_sandbox_seal()
    namespace = _tabloop_sandbox_main(program_path)
    run(program, namespace)
    clear_builtins()  # the tests see the builtins as they were, whatever the program patched
    update_builtins(original_builtins)
    namespace["__builtins__"] = builtins
    run(tests, namespace)
    go.release(); done.acquire()  # the end: the verdict thread checks that this is the line we are on


_tabloop_sandbox_harness()
"""
_END_LINE = "    go.release(); done.acquire()  # the end: the verdict thread checks that this is the line we are on"
assert _HARNESS.count(_END_LINE) == 1
_HARNESS = _HARNESS.replace("END_LINE", str(_HARNESS.splitlines().index(_END_LINE) + 1), 1)
# The hook and the program's __main__, shared with the tests server (``_SERVER``).
_HOOK_SOURCE = "\n" + _HARNESS[_HARNESS.index("def _tabloop_sandbox_hook("):_HARNESS.index("def _tabloop_sandbox_seal(")]


# -- the trusted verdict: the tests in a process of their own, the program answering their calls ----

# Both sides speak in messages: 4 bytes of length (big-endian), then JSON. Values cross as plain data:
# None, bools, ints and strings as themselves; floats {"f": repr}, lists {"l": […]}, tuples {"t": […]},
# sets {"s": […]}, frozensets {"fs": […]}, dicts {"d": [[k, v], …]}, bytes {"b": base64}, complex {"c": [re, im]};
# anything else the program has stays in the program, named by a handle {"h": n, "r": "TypeName"}.
_WIRE = r"""
import base64 as _b64, json as _json, os as _os, struct as _struct


def _send(fd, obj):
    data = _json.dumps(obj, separators=(",", ":")).encode()
    data = _struct.pack(">I", len(data)) + data
    while data:
        data = data[_os.write(fd, data):]


def _recv(fd, limit):
    def exactly(n):
        buf = b""
        while len(buf) < n:
            chunk = _os.read(fd, min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError("the other side is gone")
            buf += chunk
        return buf
    (n,) = _struct.unpack(">I", exactly(4))
    if n > limit:
        raise ValueError(f"a message of {n} bytes (at most {limit})")
    return _json.loads(exactly(n))
"""

# The program's side (untrusted: nothing here is believed by anyone). It runs the program as __main__,
# sends what the program defined, then answers the tests' calls until they hang up.
_SERVER = _WIRE + _HOOK_SOURCE + r"""

def _tabloop_sandbox_server():
    import builtins, sys, traceback, types
    program_path, call_fd, reply_fd, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    handles = []

    def enc(x, depth=0):
        if depth > 100:
            raise ValueError("nests too deep")
        if x is None or isinstance(x, (bool, str)):
            return str(x) if isinstance(x, str) else x
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return {"f": repr(float(x))}
        if isinstance(x, complex):
            return {"c": [repr(x.real), repr(x.imag)]}
        if isinstance(x, (bytes, bytearray)):
            return {"b": _b64.b64encode(bytes(x)).decode()}
        for kind, tag in ((list, "l"), (tuple, "t"), (frozenset, "fs"), (set, "s")):
            if isinstance(x, kind):
                return {tag: [enc(i, depth + 1) for i in x]}
        if isinstance(x, dict):
            return {"d": [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in x.items()]}
        if isinstance(x, types.ModuleType):
            return {"m": x.__name__}
        handles.append(x)
        return {"h": len(handles) - 1, "r": type(x).__name__}

    def dec(v):
        if isinstance(v, dict):
            (tag, x), = v.items()
            if tag == "h":
                return handles[x]
            if tag == "f":
                return float(x)
            if tag == "c":
                return complex(float(x[0]), float(x[1]))
            if tag == "b":
                return _b64.b64decode(x)
            if tag == "d":
                return {dec(k): dec(w) for k, w in x}
            return {"l": list, "t": tuple, "s": set, "fs": frozenset}[tag](dec(i) for i in x)
        return v

    with open(program_path, "rb") as f:
        source = f.read()
    namespace = _tabloop_sandbox_main(program_path)
    try:
        exec(compile(source, program_path, "exec", dont_inherit=True), namespace)
        names = {k: enc(v) for k, v in list(namespace.items()) if not (k.startswith("__") and k.endswith("__"))}
    except BaseException as e:
        traceback.print_exc()
        _send(reply_fd, {"failed": f"{type(e).__name__}: {e}"[:2000]})
        raise SystemExit(1)
    _send(reply_fd, {"names": names})
    while True:
        try:
            request = _recv(call_fd, limit)
        except EOFError:
            return
        op, target = request["op"], handles[request["h"]]
        args = [dec(a) for a in request.get("args", ())]
        try:
            if op == "call":
                value = target(*args, **{k: dec(v) for k, v in request.get("kwargs", {}).items()})
            elif op == "getattr":
                value = getattr(target, request["name"])
            elif op == "getitem":
                value = target[args[0]]
            elif op == "len":
                value = len(target)
            elif op == "list":
                value = list(target)
            elif op == "repr":
                value = repr(target)
            else:
                raise ValueError(f"no such operation: {op}")
            reply = {"value": enc(value)}
            if request.get("copies"):  # call_with_copies: the arguments as the call left them
                reply["after"] = [enc(a) for a in args]
        except Exception as e:
            reply = {"raised": [type(e).__name__, str(e)[:2000]]}
        _send(reply_fd, reply)


_tabloop_sandbox_server()
"""

# The tests' side: trusted, outside every namespace of the program, reached only by the pipe. The tests
# run here with the judge's own builtins, in a __main__ of their own; of what the program defined, they see
# only the names their code spells (never a builtin's, never a dunder), as plain data (a copy) or as a handle
# whose calls go to the program with copies of their arguments and whose answers come back as plain data,
# made here by a decoder that builds built-in types only. A module crosses as its name at most, and the judge
# imports only a standard module the tests themselves use by that name. So every comparison the tests make
# runs code of ours over values of ours: the program can give wrong answers, but not a pass. The verdict goes
# to the scorer on a pipe the program never had. The judge runs in a jail like the program's (the bootstrap,
# with a uid of its own and the run's cgroup): it needs no more.
_JUDGE = _WIRE + r"""

import builtins, dis, importlib, keyword, sys, traceback, types


class _ProgramGone(BaseException):
    # Not an Exception: test code's `except Exception` must not swallow the program's end.
    pass


# What the program may raise into the tests, as the judge's own exception: an ordinary Exception of the
# builtins, but not one that steers the tests' control flow (a StopIteration ends a map() or zip() early).
_NOT_RAISED_AS_ITSELF = (StopIteration, StopAsyncIteration)


def _code_objects(code):
    # The tests' code and every function, class body and comprehension in it.
    todo = [code]
    while todo:
        c = todo.pop()
        yield c
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))


def _names_the_tests_use(code):
    # (every name the tests' code holds, the names it loads as globals, the names it uses as a module: loaded
    # as a global and then an attribute read of it, e.g. `math.isclose`). Of the program's names, only the
    # first set are given.
    names, loaded, module_like = set(), set(), set()
    for c in _code_objects(code):
        names.update(c.co_names)
        previous = None
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and previous is not None:
                module_like.add(previous)
            previous = ins.argval if ins.opname in ("LOAD_NAME", "LOAD_GLOBAL") else None
            if previous is not None:
                loaded.add(previous)
    return names, loaded, module_like


def _unittest_main(ran):
    # unittest.main() as the tests call it, without its sys.exit and its reading of the judge's argv: the
    # verdict is the tests' result, raised as a failure when one failed.
    import unittest

    def main(*args, **kwargs):
        kwargs.setdefault("argv", ["tests.py"])
        kwargs["exit"] = False
        program = unittest.TestProgram(*args, **kwargs)
        result = program.result
        ran.append(result)
        if not result.wasSuccessful():
            raise AssertionError(f"unittest: {len(result.failures)} failed and {len(result.errors)} errors "
                                 f"of {result.testsRun} tests")
        return program
    return main


def _main(cfg):
    call_fd, reply_fd, limit = cfg["call_fd"], cfg["reply_fd"], cfg["limit"]
    broken = []
    tests = compile(sys.stdin.read(), "tests.py", "exec", dont_inherit=True)
    used, loaded, module_like = _names_the_tests_use(tests)

    def dec(v, depth=0):
        if depth > 100:
            raise ValueError("nests too deep")
        if v is None or type(v) in (bool, int, str):
            return v
        if type(v) is dict and len(v) in (1, 2):
            tag = next(iter(v))
            x = v[tag]
            if tag == "h" and type(x) is int:
                return Remote(x, str(v.get("r", "object")))
            if len(v) == 1:
                if tag == "f" and type(x) is str:
                    return float(x)
                if tag == "c" and type(x) is list and len(x) == 2:
                    return complex(float(x[0]), float(x[1]))
                if tag == "b" and type(x) is str:
                    return _b64.b64decode(x, validate=True)
                if tag in ("l", "t", "s", "fs") and type(x) is list:
                    items = [dec(i, depth + 1) for i in x]
                    return {"l": list, "t": tuple, "s": set, "fs": frozenset}[tag](items)
                if tag == "d" and type(x) is list:
                    out = {}
                    for pair in x:
                        if type(pair) is not list or len(pair) != 2:
                            raise ValueError("a dict item that is not a pair")
                        out[dec(pair[0], depth + 1)] = dec(pair[1], depth + 1)
                    return out
        raise ValueError(f"not plain data: {str(v)[:100]}")

    def enc(x, depth=0):
        if depth > 100:
            raise ValueError("nests too deep")
        t = type(x)
        if x is None or t in (bool, int, str):
            return x
        if t is float:
            return {"f": repr(x)}
        if t is complex:
            return {"c": [repr(x.real), repr(x.imag)]}
        if t in (bytes, bytearray):
            return {"b": _b64.b64encode(bytes(x)).decode()}
        for kind, tag in ((list, "l"), (tuple, "t"), (set, "s"), (frozenset, "fs")):
            if t is kind:
                return {tag: [enc(i, depth + 1) for i in x]}
        if t is dict:
            return {"d": [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in x.items()]}
        if t is Remote:
            return {"h": object.__getattribute__(x, "_h")}
        raise TypeError(f"the tests can't send a {t.__name__} to the program: plain data only")

    def ask(request):
        # The program's answer, made here; with "copies": (it, the program's copies of the arguments as the
        # call left them).
        if broken:
            raise _ProgramGone(broken[0])
        try:
            _send(call_fd, request)
            reply = _recv(reply_fd, limit)
            if type(reply) is not dict:
                raise ValueError("not an answer")
            if "raised" in reply:
                name, message = (str(p) for p in reply["raised"][:2])
                kind = getattr(builtins, name, None)
                if (not (isinstance(kind, type) and issubclass(kind, Exception))
                        or issubclass(kind, _NOT_RAISED_AS_ITSELF)):
                    kind = RuntimeError
                    message = f"the program raised {name}: {message}"
                raised = kind(message)
            else:
                value = dec(reply["value"])
                if not request.get("copies"):
                    return value
                after = reply.get("after")
                if type(after) is not list:
                    raise ValueError("no copies of the arguments in the answer")
                return value, tuple(dec(a) for a in after)
        except (OSError, EOFError, ValueError, TypeError, KeyError, RecursionError, MemoryError) as e:
            broken.append(f"the program stopped answering the tests: {type(e).__name__}: {e}")
            raise _ProgramGone(broken[0]) from None
        raise raised

    class Remote:
        # Something the program has: attribute reads, calls, items, length and iteration are asked of the
        # program; == and hash stay Python's identity, so nothing the program defines decides a comparison.
        # A call sends copies: nothing the program does to its arguments comes back into the tests' objects.
        __slots__ = ("_h", "_r")

        def __init__(self, h, r):
            object.__setattr__(self, "_h", h)
            object.__setattr__(self, "_r", r)

        def __getattr__(self, name):
            return ask({"op": "getattr", "h": object.__getattribute__(self, "_h"), "name": name})

        def __call__(self, *args, **kwargs):
            return call(self, args, kwargs)

        def __getitem__(self, key):
            return ask({"op": "getitem", "h": object.__getattribute__(self, "_h"), "args": [enc(key)]})

        def __len__(self):
            n = ask({"op": "len", "h": object.__getattribute__(self, "_h")})
            if type(n) is not int:
                raise TypeError("len() of the program's object is not an int")
            return n

        def __iter__(self):
            items = ask({"op": "list", "h": object.__getattribute__(self, "_h")})
            return iter(items if type(items) is list else [])

        def __repr__(self):
            return f"<the program's {object.__getattribute__(self, '_r')}>"

    def call(function, args, kwargs, copies=False):
        if type(function) is not Remote:
            raise TypeError(f"not something the program defined: {function!r}")
        return ask({"op": "call", "h": object.__getattribute__(function, "_h"), "args": [enc(a) for a in args],
                    "kwargs": {str(k): enc(v) for k, v in kwargs.items()}, "copies": copies})

    def call_with_copies(function, *args, **kwargs):
        # For tests of a function that changes its arguments: (what it returned, the copies of the positional
        # arguments it was given, as it left them). The tests' own objects stay as they were.
        return call(function, args, kwargs, copies=True)

    # What a task's tests may import beyond the standard library: `from tabloop_judge import call_with_copies`.
    helpers = types.ModuleType("tabloop_judge", "What the judge offers a task's tests.")
    helpers.call_with_copies = call_with_copies
    sys.modules["tabloop_judge"] = helpers

    try:
        first = _recv(reply_fd, limit)
        if type(first) is not dict or type(first.get("names")) is not dict:
            print("[sandbox] the program failed before the tests ran:", str(first.get("failed") if type(first) is dict
                  else first)[:2000], file=sys.stderr)
            return False
        given = {}
        for name, value in first["names"].items():
            # Only names the tests spell, and none of the judge's own: a builtin, a dunder, a keyword.
            if (name not in used or not name.isidentifier() or keyword.iskeyword(name) or name.startswith("__")
                    or name in builtins.__dict__):
                continue
            if name in module_like and name in sys.stdlib_module_names:
                given[name] = importlib.import_module(name)  # the module the tests use by that name, ours
            elif not (type(value) is dict and "m" in value):  # any other module stays the program's
                given[name] = dec(value)
    except (OSError, EOFError, ValueError, TypeError, KeyError, RecursionError, MemoryError, ImportError) as e:
        print(f"[sandbox] the program did not say what it defined: {type(e).__name__}: {e}", file=sys.stderr)
        return False
    # The tests' __main__, as on a developer's machine: `from __main__ import solve` and unittest.main() find
    # it, __name__ is "__main__", and sys.argv holds no argument for unittest to read as a test's name.
    main = types.ModuleType("__main__")
    main.__dict__.update(given)
    main.__dict__.update(__name__="__main__", __file__="tests.py", __builtins__=builtins)
    sys.modules["__main__"] = main
    sys.argv = ["tests.py"]
    ran_unittest = []
    if "unittest" in used:  # imported only for tests that use it: a module of its own costs every run its import
        import unittest
        unittest.main = _unittest_main(ran_unittest)
    try:
        exec(tests, main.__dict__)
        _run_uncalled_tests(loaded, main.__dict__, ran_unittest)
        passed = True
    except SystemExit as e:
        passed = not cfg["must_reach_end"] and e.code in (0, None, False)
        if not passed:
            print(f"[sandbox] the tests exited ({e.code!r}) before their end", file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        passed = False
    if broken:
        print(f"[sandbox] {broken[0]}", file=sys.stderr)
        return False
    return passed


def _run_uncalled_tests(named, namespace, ran_unittest):
    # pytest's way, for tests written in it: each test_* function the tests define and never name themselves
    # (``named``: the globals their code loads) is called, and, unless unittest.main() ran, each TestCase class
    # they define is run.
    for name, value in list(namespace.items()):
        if (name.startswith("test") and name not in named and isinstance(value, types.FunctionType)
                and value.__code__.co_filename == "tests.py" and value.__code__.co_argcount == 0):
            value()
    unittest = sys.modules.get("unittest")  # not imported: the tests define no TestCase
    if unittest is not None and not ran_unittest:
        cases = [v for v in namespace.values() if isinstance(v, type) and issubclass(v, unittest.TestCase)
                 and v.__module__ == "__main__"]
        if cases:
            suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromTestCase(c) for c in cases)
            result = unittest.TextTestRunner(stream=sys.stderr).run(suite)
            if not result.wasSuccessful():
                raise AssertionError(f"unittest: {len(result.failures)} failed and {len(result.errors)} errors "
                                     f"of {result.testsRun} tests")


def _tabloop_sandbox_judge():
    cfg = _json.loads(sys.argv[1])
    passed = _main(cfg)
    sys.stdout.flush()
    sys.stderr.flush()
    _os.write(cfg["verdict_fd"], b"passed\n" if passed else b"failed\n")


_tabloop_sandbox_judge()
"""


# -- the bootstrap: this file run as a script, as root if we are ---------------------------------

def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
    libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
    libc.unshare.argtypes = (ctypes.c_int,)
    return libc


def _checked(ret: int, what: str) -> None:
    if ret != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)
    _checked(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _prctl(libc, option: int, value: int) -> None:
    _checked(libc.prctl(option, value, 0, 0, 0), f"prctl {option}")


def _graft(libc, fd: int, path: str) -> None:
    """Bind the file or directory open as ``fd`` (O_PATH) at ``path``, read-only."""
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.makedirs(path, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        open(path, "ab").close()
    _mount(libc, f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    _mount(libc, None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _setup_filesystem(libc, cfg: dict) -> None:
    """In the new mount namespace: hide the shared directories, graft the interpreter, make the scratch."""
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount may show outside
    if cfg.get("hardened"):
        _private_dev(libc)
        _mount(libc, "tmpfs", "/sys", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0555,size=4k,nr_inodes=8")
        _mount(libc, None, "/sys", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    workdir = cfg["workdir"]
    file_fds = [(os.path.join(workdir, name), os.open(os.path.join(workdir, name), os.O_PATH))
                for name in cfg["files"]]  # opened before anything covers them
    keep_fds = [(keep, os.open(keep, os.O_PATH)) for keep in cfg["keeps"]]
    for hide in cfg["hides"]:
        _mount(libc, "tmpfs", hide, "tmpfs", MS_NOSUID | MS_NODEV, _HIDE_OPTIONS)
        for keep, fd in keep_fds:
            if _is_under(keep, hide):
                _graft(libc, fd, keep)
    os.makedirs(workdir, mode=0o755, exist_ok=True)  # under a hidden directory: the way to it, anew
    _mount(libc, "tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
           f"mode=0700,size={cfg['scratch_bytes']},nr_inodes={_SCRATCH_INODES},uid={cfg['uid']},gid={cfg['gid']}")
    for path, fd in file_fds:  # read-only: what the harness runs is what we wrote
        _graft(libc, fd, path)
    for hide in cfg["hides"]:
        _mount(libc, None, hide, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    if "pid" in cfg["namespaces"]:  # its /proc shows its own processes only
        _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if cfg.get("hardened"):
        _mount(libc, None, "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    for _, fd in keep_fds + file_fds:
        os.close(fd)


def _private_dev(libc) -> None:
    """A tmpfs over /dev with only DEV_NODES (bound from the host's), the /proc links and an empty shm."""
    nodes = [(name, os.open(f"/dev/{name}", os.O_PATH)) for name in DEV_NODES]  # before /dev is covered
    _mount(libc, "tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k,nr_inodes=64")
    for name, fd in nodes:
        open(f"/dev/{name}", "wb").close()
        _mount(libc, f"/proc/self/fd/{fd}", f"/dev/{name}", None, MS_BIND)
        _mount(libc, None, f"/dev/{name}", None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC)
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/shm", 0o755)  # hidden like the other shared directories, when the host has one


# x86_64 syscall numbers (asm/unistd_64.h) and the seccomp ABI (linux/seccomp.h, linux/filter.h).
_NR = {"clone": 56, "socket": 41, "socketpair": 53, "unshare": 272, "setns": 308, "clone3": 435}
_NR_REFUSED = {"ptrace": 101, "add_key": 248, "request_key": 249, "keyctl": 250, "perf_event_open": 298,
               "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425, "unshare": 272, "setns": 308}
_CLONE_NAMESPACES = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
_SOCKET_FAMILIES = (1, 2, 10)   # AF_UNIX, AF_INET, AF_INET6 (in a network namespace with nothing in it)
_AUDIT_ARCH_X86_64 = 0xC000003E
_SECCOMP_ALLOW, _SECCOMP_KILL, _SECCOMP_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97


def _seccomp_program() -> bytes:
    """The filter: no new namespaces (unshare, setns, clone with a CLONE_NEW* flag; clone3, whose flags a
    filter can't read, answers ENOSYS so the C library falls back to clone), sockets of AF_UNIX, AF_INET and
    AF_INET6 only (EAFNOSUPPORT: no AF_VSOCK, no netlink, no packet sockets), none of a few syscalls a test
    never needs and kernel exploits love (bpf, userfaultfd, io_uring, perf events, keyrings, ptrace); any
    other architecture's syscall kills the process."""
    import struct

    LD, JEQ, JSET, JGE, RET = 0x20, 0x15, 0x45, 0x35, 0x06
    code: list[tuple] = []  # (op, k, jump-if-true label, jump-if-false label) or (op, k)

    def ret(value: int) -> None:
        code.append((RET, value))

    code.append((LD, 4))  # seccomp_data.arch
    code.append((JEQ, _AUDIT_ARCH_X86_64, None, "kill"))
    code.append((LD, 0))  # seccomp_data.nr
    code.append((JGE, 0x40000000, "eperm", None))  # the x32 ABI
    code.append((JEQ, _NR["clone3"], "enosys", None))
    for nr in sorted(set(_NR_REFUSED.values())):
        code.append((JEQ, nr, "eperm", None))
    code.append((JEQ, _NR["clone"], "clone", None))
    code.append((JEQ, _NR["socket"], "family", None))
    code.append((JEQ, _NR["socketpair"], "family", None))
    ret(_SECCOMP_ALLOW)
    labels = {"clone": len(code)}
    code.append((LD, 16))  # args[0], its low 32 bits (little-endian)
    code.append((JSET, _CLONE_NAMESPACES, "eperm", None))
    ret(_SECCOMP_ALLOW)
    labels["family"] = len(code)
    code.append((LD, 16))
    for family in _SOCKET_FAMILIES:
        code.append((JEQ, family, "allow", None))
    ret(_SECCOMP_ERRNO | _EAFNOSUPPORT)
    for label, value in (("allow", _SECCOMP_ALLOW), ("eperm", _SECCOMP_ERRNO | _EPERM),
                         ("enosys", _SECCOMP_ERRNO | _ENOSYS), ("kill", _SECCOMP_KILL)):
        labels[label] = len(code)
        ret(value)
    out = b""
    for i, ins in enumerate(code):
        if len(ins) == 2:
            out += struct.pack("=HBBI", ins[0], 0, 0, ins[1])
        else:
            op, k, yes, no = ins
            jt = labels[yes] - i - 1 if yes else 0
            jf = labels[no] - i - 1 if no else 0
            assert 0 <= jt < 256 and 0 <= jf < 256
            out += struct.pack("=HBBI", op, jt, jf, k)
    return out


def _install_seccomp(libc) -> None:
    import ctypes

    program = _seccomp_program()

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = SockFprog(len(program) // 8, program)
    libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong)
    _checked(libc.prctl(22, 2, ctypes.addressof(prog), 0, 0), "prctl PR_SET_SECCOMP")  # SECCOMP_MODE_FILTER


def _set_limits(limits: dict) -> None:
    cpu = limits["cpu"]
    for res, soft, hard in ((resource.RLIMIT_AS, limits["as"], limits["as"]),
                            (resource.RLIMIT_FSIZE, limits["fsize"], limits["fsize"]),
                            (resource.RLIMIT_NPROC, limits["nproc"], limits["nproc"]),
                            (resource.RLIMIT_CPU, cpu, cpu + 1),
                            (resource.RLIMIT_NOFILE, limits["nofile"], limits["nofile"]),
                            (resource.RLIMIT_CORE, 0, 0)):
        _, current = resource.getrlimit(res)
        if current != resource.RLIM_INFINITY:  # unprivileged: a hard limit only comes down
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(res, (soft, hard))


def _child(libc, cfg: dict) -> None:
    """Set up and exec the program; never returns."""
    control = cfg["control_fd"]  # close-on-exec: the program never sees it
    try:
        for fd in cfg["program_fds"]:  # the nonce's pipe and the verdict's, for the harness
            os.set_inheritable(fd, True)
        os.umask(0o022)
        if "mnt" in cfg["namespaces"]:
            _setup_filesystem(libc, cfg)
        os.chdir(cfg["workdir"])
        _set_limits(cfg["limits"])
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
        if libc is not None:
            _prctl(libc, PR_SET_NO_NEW_PRIVS, 1)  # no setuid binary gives the privileges back
            _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
            if cfg.get("seccomp"):
                _install_seccomp(libc)
        os.execve(cfg["python"], cfg["argv"], dict(os.environ))
    except BaseException as e:  # noqa: BLE001 - whatever it is, the parent must hear of it
        message = f"{type(e).__name__}: {e}".replace("\n", " ")
        os.write(control, f"fail {message}\n".encode())
    os._exit(SETUP_FAILED)


def _bootstrap(argv: list[str]) -> None:
    cfg = json.loads(argv[0])
    control = cfg["control_fd"]
    os.set_inheritable(control, False)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = _libc() if _LINUX else None
    try:
        for procs in cfg.get("cgroup_procs", ()):  # first: all we start from here on is in the run's cgroup
            with open(procs, "w") as f:
                f.write(f"{os.getpid()}\n")
        if libc is not None:
            _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)  # the scorer dies: so do we, and the program
            _prctl(libc, PR_SET_CHILD_SUBREAPER, 1)  # orphans of the sandbox come to us, not to init
            if os.getppid() != cfg["parent_pid"]:
                os._exit(SETUP_FAILED)
        flags = 0
        for name in cfg["namespaces"]:
            flags |= _NAMESPACE_FLAGS[name]
        if flags:
            _checked(libc.unshare(flags), f"unshare {'+'.join(cfg['namespaces'])}")
        pid = os.fork()  # with a PID namespace, the child is its init
    except OSError as e:
        os.write(control, f"fail {e}\n".encode())
        os._exit(SETUP_FAILED)
    if pid == 0:
        _child(libc, cfg)
    for fd in cfg["program_fds"]:  # the program's alone: no stray reader or writer of the verdict here
        os.close(fd)
    main_status = None
    while True:  # reap the program and, as subreaper, all it leaves behind
        try:
            reaped, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if reaped == pid:
            main_status = status
            os.write(control, f"exit {status}\n".encode())
    code = os.waitstatus_to_exitcode(main_status) if main_status is not None else SETUP_FAILED
    if code < 0:  # die of the same signal, as the program did
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP: no handler to reset
            pass
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


if __name__ == "__main__":
    _bootstrap(sys.argv[1:])
