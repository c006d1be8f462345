"""Running the whole system as a user does, for system tests and drills: the `tabloop` CLI in a subprocess
on settings of a test's own (free ports, a tmp state dir), its status, and waiting on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def env(settings) -> dict:
    from infra.settings import to_environ

    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "PYTHONPATH": str(ROOT),
            **to_environ(settings)}


def cli(settings, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", *args], env=env(settings), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def status(settings) -> dict:
    return json.loads(cli(settings, "status", "--json").stdout)


def row(status: dict, name: str) -> dict:
    return next(r for r in status["components"] if r["component"] == name)


def wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def processes_of(state_dir: Path) -> list[int]:
    """Every process whose environment or command line names this state dir."""
    found = []
    needle = str(state_dir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes() or needle in (entry / "cmdline").read_bytes():
                if (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found
