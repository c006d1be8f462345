"""One run, one budget, and a smaller world (issue 29): a run's processes share one memory and process cap
(a cgroup), each has few open files, /dev holds only what Python needs, /sys is not the host's, no new
namespaces, only the socket families a program with no network can use. Real sandbox runs, on this
machine's isolation: a layer the machine can't give fails its test rather than skipping it."""

from __future__ import annotations

import errno
import json

from rewards.sandbox import DEV_NODES, MAX_OPEN_FILES, run_tests

LOOK_AROUND = """\
import json, os, resource, socket, subprocess
seen = {'dev': sorted(os.listdir('/dev')), 'nofile': list(resource.getrlimit(resource.RLIMIT_NOFILE))}
try:
    os.openpty()
    seen['pty'] = 'opened'
except OSError as e:
    seen['pty'] = e.strerror
try:
    seen['sys_net'] = sorted(os.listdir('/sys/class/net'))
except OSError as e:
    seen['sys_net'] = e.strerror
userns = subprocess.run(['unshare', '--user', 'true'], capture_output=True, text=True)
seen['userns'] = [userns.returncode, userns.stderr.strip()]
for family in ('AF_VSOCK', 'AF_NETLINK', 'AF_UNIX', 'AF_INET'):
    try:
        socket.socket(getattr(socket, family), socket.SOCK_DGRAM if family == 'AF_NETLINK' else socket.SOCK_STREAM).close()
        seen[family] = 0
    except OSError as e:
        seen[family] = e.errno
files = []
try:
    while len(files) < 1000:
        files.append(open('/dev/null'))
except OSError:
    pass
seen['opened'] = len(files)
print(json.dumps(seen))
"""


def test_a_run_sees_a_small_world():
    result = run_tests(LOOK_AROUND)
    assert result.passed, result.stderr
    assert {"dev", "sys", "seccomp", "cgroup"} <= set(result.isolation) and result.missing == (), result
    seen = json.loads(result.stdout.splitlines()[-1])
    # /dev: the four nodes, the links to /proc/self/fd and an empty shm; no ptmx, no pts, no disks.
    assert seen["dev"] == sorted(DEV_NODES + ("fd", "stdin", "stdout", "stderr", "shm")), seen["dev"]
    assert seen["pty"] != "opened"
    assert seen["sys_net"] == "No such file or directory", seen  # the host's interfaces are not listed
    assert seen["userns"][0] != 0 and "Operation not permitted" in seen["userns"][1], seen
    assert (seen["AF_VSOCK"], seen["AF_NETLINK"]) == (errno.EAFNOSUPPORT, errno.EAFNOSUPPORT), seen
    assert (seen["AF_UNIX"], seen["AF_INET"]) == (0, 0), seen  # what a program may still use, with no network
    assert seen["nofile"] == [MAX_OPEN_FILES, MAX_OPEN_FILES] and seen["opened"] < MAX_OPEN_FILES, seen


# Three children each holding 200 MiB: each is under the per-process cap, the three are over the run's.
THREE_HOLDERS = """\
import os, time
children = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        data = b'x' * (200 * 2**20)
        time.sleep(1.5)
        os._exit(0)
    children.append(pid)
print(sorted(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children))
"""


def test_a_runs_processes_share_one_memory_cap():
    result = run_tests(THREE_HOLDERS, memory_bytes=384 * 2**20, timeout_s=10)
    assert "cgroup" in result.isolation, result
    statuses = json.loads(result.stdout.splitlines()[-1])
    # At most one held its 200 MiB to the end; the kernel killed the others for the run's cap.
    assert statuses.count(0) <= 1 and -9 in statuses, result
    assert run_tests(THREE_HOLDERS.replace("range(3)", "range(1)"), memory_bytes=384 * 2**20).stdout.strip() == "[0]"
