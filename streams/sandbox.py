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
* an unprivileged uid/gid (``nobody`` when we are root: root ignores
  RLIMIT_NPROC, so without this a fork bomb is not contained);
* a network namespace: no interface but a loopback that is down, so no
  connection to anything, not even 127.0.0.1;
* a PID namespace: when the program ends, the kernel kills whatever it left
  behind, ``setsid()`` or not, and reaps it;
* a mount namespace: the shared world-writable directories (/tmp, /var/tmp,
  /dev/shm…) become empty and read-only, its own directory becomes a small
  tmpfs (so it can't fill the disk), and directories the interpreter needs but
  ``nobody`` may not enter (a pyenv under /root) are grafted in read-only;
* an IPC namespace (System V and POSIX message queues of its own).

Which of these work is found once per interpreter by running a trivial
program with the strongest set and weakening it until one runs; every
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

Passing means exiting 0 *after reaching the end of the program*: the last
line we append writes a random token to a pipe, so a completion that calls
``sys.exit(0)`` or ``os._exit(0)`` before the tests run fails
(``must_reach_end=False`` for test code that ends in ``unittest.main()``).

Runs that share a uid share its process limit (RLIMIT_NPROC counts every
process of that uid), and can signal each other: run them one at a time per
uid, or give each worker its own ``uid``.
"""

from __future__ import annotations

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
NOBODY = 65534   # the uid and gid (nogroup) a root scorer runs programs as
PROGRAM_NAME = "program.py"
SETUP_FAILED = 125  # the bootstrap's exit status when the sandbox could not be made

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
    "rlimits".
    """

    passed: bool
    outcome: str
    exit_code: int | None
    duration_s: float
    stdout: str
    stderr: str
    isolation: tuple[str, ...] = ()

    @property
    def network_isolated(self) -> bool:
        return "net" in self.isolation


@dataclass(frozen=True)
class _Plan:
    """What a run asks the OS for: the namespaces, and the uid/gid to drop to (None: stay)."""

    namespaces: tuple[str, ...]
    uid: int | None
    gid: int | None

    @property
    def isolation(self) -> tuple[str, ...]:
        return (("uid",) if self.uid is not None else ()) + self.namespaces + ("rlimits",)


_plans: dict[tuple[str, int, int], _Plan] = {}
_plans_lock = threading.Lock()


def run_tests(program: str, *, timeout_s: float = 10.0, memory_bytes: int = 512 * 2**20,
              max_file_bytes: int = 16 * 2**20, max_processes: int = 64, python: str = sys.executable,
              max_output_bytes: int = 64 * 2**10, must_reach_end: bool = True,
              uid: int = NOBODY, gid: int = NOBODY) -> SandboxResult:
    """Run ``program`` (Python source with its tests) in the sandbox; see the module docstring.

    ``memory_bytes`` caps the address space, ``max_file_bytes`` any one file it
    writes and, with a mount namespace, all its files together;
    ``max_processes`` the processes (and threads) of ``uid``; the CPU limit is
    a second above ``timeout_s``. ``uid``/``gid`` are used only when we are root.
    """
    if not isinstance(program, str):
        raise TypeError(f"program must be Python source as str, got {type(program).__name__}")
    for name, value in (("timeout_s", timeout_s), ("memory_bytes", memory_bytes),
                        ("max_file_bytes", max_file_bytes), ("max_processes", max_processes),
                        ("max_output_bytes", max_output_bytes)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    exe = _resolve_python(python)
    if exe is None:
        return SandboxResult(False, "error", None, 0.0, "", f"[sandbox] no Python interpreter at {python!r}")
    plan = _plan_for(exe, uid, gid)
    return _execute(program, plan, exe, timeout_s=timeout_s, memory_bytes=memory_bytes,
                    max_file_bytes=max_file_bytes, max_processes=max_processes,
                    max_output_bytes=max_output_bytes, must_reach_end=must_reach_end)


def network_isolation_available(python: str = sys.executable) -> bool:
    """Whether programs run by ``python`` get no network (a namespace of their own). Probed once."""
    exe = _resolve_python(python)
    return exe is not None and "net" in _plan_for(exe, NOBODY, NOBODY).namespaces


# -- choosing what the OS allows ---------------------------------------------------------------

def _resolve_python(python: str) -> str | None:
    found = shutil.which(python) if os.sep not in python else python
    return os.path.abspath(found) if found and os.path.isfile(found) else None


def _candidate_plans(uid: int, gid: int) -> list[_Plan]:
    """From the strongest to nothing at all; the first that runs a trivial program is used."""
    if not _LINUX:
        return [_Plan((), uid, gid), _Plan((), None, None)] if os.geteuid() == 0 else [_Plan((), None, None)]
    if os.geteuid() == 0:
        return [_Plan(("mnt", "pid", "net", "ipc"), uid, gid), _Plan(("mnt", "net"), uid, gid),
                _Plan(("net",), uid, gid), _Plan((), uid, gid), _Plan((), None, None)]
    # Unprivileged: a user namespace (if the kernel lets us) gives the others; no uid to drop to.
    return [_Plan(("user", "pid", "net", "ipc"), None, None), _Plan(("user", "net"), None, None),
            _Plan((), None, None)]


def _plan_for(python: str, uid: int, gid: int) -> _Plan:
    key = (python, uid, gid)
    with _plans_lock:
        if key in _plans:
            return _plans[key]
        candidates = _candidate_plans(uid, gid)
        for plan in candidates:
            probe = _execute("pass\n", plan, python, timeout_s=20.0, memory_bytes=512 * 2**20,
                             max_file_bytes=2**20, max_processes=64, max_output_bytes=4096,
                             must_reach_end=True)
            if probe.passed:
                break
            log.debug("sandbox: %s unavailable: %s", plan.isolation, probe.stderr.strip()[-500:])
        else:
            # Nothing runs even a trivial program: the interpreter is broken, not the isolation.
            # Don't remember it; runs will report the error.
            return candidates[0]
        _plans[key] = plan
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


def _execute(program: str, plan: _Plan, python: str, *, timeout_s: float, memory_bytes: int,
             max_file_bytes: int, max_processes: int, max_output_bytes: int,
             must_reach_end: bool) -> SandboxResult:
    """Run ``program`` under ``plan``: write it to a fresh directory, start the bootstrap, supervise."""
    token = secrets.token_hex(16)
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="tabloop-sandbox-"))
    control_r, control_w = os.pipe()
    token_r, token_w = os.pipe()
    fds = [control_r, control_w, token_r, token_w]
    try:
        program_path = os.path.join(workdir, PROGRAM_NAME)
        epilogue = f"\n\n__import__('os').write({token_w}, b'{token}')\n"
        with open(program_path, "w", encoding="utf-8") as f:
            f.write(program + epilogue)
        os.chmod(program_path, 0o644)
        hides: list[str] = []
        keeps: list[str] = []
        if plan.uid is not None:
            if "mnt" in plan.namespaces:
                hides, keeps = _filesystem_layout(python, workdir, plan.uid, plan.gid)
            else:  # no tmpfs of its own: it works in the real directory, which must be its own
                os.chown(workdir, plan.uid, plan.gid)
        cpu_s = math.ceil(timeout_s) + 1
        config = {
            "python": python, "argv": [python, "-s", "-B", PROGRAM_NAME], "workdir": workdir,
            "program": PROGRAM_NAME, "namespaces": list(plan.namespaces), "uid": plan.uid, "gid": plan.gid,
            "hides": hides, "keeps": keeps, "scratch_bytes": max_file_bytes,
            "limits": {"as": memory_bytes, "fsize": max_file_bytes, "nproc": max_processes, "cpu": cpu_s},
            "control_fd": control_w, "token_fd": token_w, "parent_pid": os.getpid(),
        }
        bootstrap = [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(config)]
        start = time.monotonic()
        try:
            proc = subprocess.Popen(bootstrap, cwd=workdir, env=_minimal_env(workdir), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(control_w, token_w),
                                    start_new_session=True)
        except (OSError, subprocess.SubprocessError) as e:
            return SandboxResult(False, "error", None, 0.0, "", f"[sandbox] could not start: {e}",
                                 plan.isolation)
        for fd in (control_w, token_w):
            os.close(fd)
            fds.remove(fd)
        return _supervise(proc, control_r, token_r, token, plan, start=start, timeout_s=timeout_s,
                          max_output_bytes=max_output_bytes, must_reach_end=must_reach_end)
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)


def _supervise(proc: subprocess.Popen, control_r: int, token_r: int, token: str, plan: _Plan, *,
               start: float, timeout_s: float, max_output_bytes: int, must_reach_end: bool) -> SandboxResult:
    """Collect the output until the program ends or its time is up, then leave nothing running."""
    out, err = _CappedBuffer(max_output_bytes), _CappedBuffer(max_output_bytes)
    control, token_seen = _CappedBuffer(4096), _CappedBuffer(4096)
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, control_r: control}
    deadline = start + timeout_s
    timed_out = False
    with selectors.DefaultSelector() as sel:
        for fd in sinks:
            sel.register(fd, selectors.EVENT_READ)
        while control_r in sinks and b"exit " not in control.head:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            _pump(sel, sinks, remaining)
        duration = time.monotonic() - start
        _kill_tree(proc)
        sinks[token_r] = token_seen
        sel.register(token_r, selectors.EVENT_READ)
        drain_until = time.monotonic() + _DRAIN_S
        while sinks and time.monotonic() < drain_until:  # every writer is dead: this is quick
            _pump(sel, sinks, drain_until - time.monotonic())
    proc.stdout.close()
    proc.stderr.close()

    lines = control.text().splitlines()
    failure = next((line[5:] for line in lines if line.startswith("fail ")), None)
    status = next((int(line[5:]) for line in lines if line.startswith("exit ") and line[5:].isdigit()), None)
    exit_code = os.waitstatus_to_exitcode(status) if status is not None else proc.returncode
    notes = []
    if failure is not None or (status is None and not timed_out):
        outcome, exit_code = "error", None
        notes.append(f"[sandbox] could not run the program: {failure or f'bootstrap exited {proc.returncode}'}")
    elif timed_out:
        outcome = "timeout"
        notes.append(f"[sandbox] killed after {timeout_s:g}s")
    elif exit_code == 0:
        if not must_reach_end or token in token_seen.text():
            outcome = "passed"
        else:
            outcome = "failed"
            notes.append("[sandbox] the program exited 0 before reaching its end (sys.exit? os._exit?)")
    elif exit_code < 0:
        outcome = "timeout" if -exit_code == signal.SIGXCPU else "killed"
        notes.append(f"[sandbox] killed by signal {_signal_name(-exit_code)}")
    else:
        outcome = "memory" if b"MemoryError" in err.tail or b"MemoryError" in err.head[-_TAIL_BYTES:] else "failed"
    stderr = err.text()
    if notes:
        stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + "\n".join(notes) + "\n"
    return SandboxResult(outcome == "passed", outcome, exit_code, round(duration, 3), out.text(), stderr,
                         plan.isolation)


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
    workdir = cfg["workdir"]
    program = os.path.join(workdir, cfg["program"])
    program_fd = os.open(program, os.O_PATH)  # opened before anything covers it
    keep_fds = [(keep, os.open(keep, os.O_PATH)) for keep in cfg["keeps"]]
    for hide in cfg["hides"]:
        _mount(libc, "tmpfs", hide, "tmpfs", MS_NOSUID | MS_NODEV, _HIDE_OPTIONS)
        for keep, fd in keep_fds:
            if _is_under(keep, hide):
                _graft(libc, fd, keep)
    os.makedirs(workdir, mode=0o755, exist_ok=True)  # under a hidden directory: the way to it, anew
    _mount(libc, "tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
           f"mode=0700,size={cfg['scratch_bytes']},nr_inodes={_SCRATCH_INODES},uid={cfg['uid']},gid={cfg['gid']}")
    _graft(libc, program_fd, program)
    for hide in cfg["hides"]:
        _mount(libc, None, hide, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    if "pid" in cfg["namespaces"]:  # its /proc shows its own processes only
        _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for _, fd in keep_fds:
        os.close(fd)
    os.close(program_fd)


def _set_limits(limits: dict) -> None:
    cpu = limits["cpu"]
    for res, soft, hard in ((resource.RLIMIT_AS, limits["as"], limits["as"]),
                            (resource.RLIMIT_FSIZE, limits["fsize"], limits["fsize"]),
                            (resource.RLIMIT_NPROC, limits["nproc"], limits["nproc"]),
                            (resource.RLIMIT_CPU, cpu, cpu + 1),
                            (resource.RLIMIT_CORE, 0, 0)):
        _, current = resource.getrlimit(res)
        if current != resource.RLIM_INFINITY:  # unprivileged: a hard limit only comes down
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(res, (soft, hard))


def _child(libc, cfg: dict) -> None:
    """Set up and exec the program; never returns."""
    control = cfg["control_fd"]  # close-on-exec: the program never sees it
    try:
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
        os.execve(cfg["python"], cfg["argv"], dict(os.environ))
    except BaseException as e:  # noqa: BLE001 - whatever it is, the parent must hear of it
        message = f"{type(e).__name__}: {e}".replace("\n", " ")
        os.write(control, f"fail {message}\n".encode())
    os._exit(SETUP_FAILED)


def _bootstrap(argv: list[str]) -> None:
    cfg = json.loads(argv[0])
    control, token_fd = cfg["control_fd"], cfg["token_fd"]
    os.set_inheritable(control, False)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = _libc() if _LINUX else None
    try:
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
    os.close(token_fd)
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
