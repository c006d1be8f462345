"""The whole system on one machine, until the supervisor exists: Kafka, topics, `tabloop serve` detached."""

from __future__ import annotations

import getpass
import os
import signal
import subprocess
import sys
import time

import httpx

from infra.settings import Settings

SERVE_READY_TIMEOUT_S = 300.0  # a real model can take minutes to load


class LocalRunError(RuntimeError):
    pass


def _pid_file(settings: Settings):
    return settings.state_dir / "serve.pid"


def serving_pid(settings: Settings) -> int | None:
    try:
        pid = int(_pid_file(settings).read_text())
        os.kill(pid, 0)
        return pid
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None


def wait_ready(url: str, timeout_s: float, process: subprocess.Popen | None = None) -> bool:
    """Poll ``url`` (a /readyz) until it answers 200; False on timeout or when ``process`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            return False
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def start_serving(settings: Settings) -> int:
    """Start `tabloop serve` in the background (logs under the state dir); return once it is ready."""
    pid = serving_pid(settings)
    if pid:
        return pid
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    log_path = settings.state_dir / "serve.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "serve"], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    _pid_file(settings).write_text(f"{proc.pid}\n")
    url = f"http://{settings.serve_host}:{settings.completions_port}/readyz"
    if wait_ready(url, SERVE_READY_TIMEOUT_S, proc):
        return proc.pid
    if proc.poll() is not None:
        _pid_file(settings).unlink(missing_ok=True)
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise LocalRunError(f"tabloop serve exited with code {proc.returncode}:\n{tail}")
    raise LocalRunError(f"tabloop serve was not ready within {SERVE_READY_TIMEOUT_S:.0f}s; see {log_path}")


def stop_serving(settings: Settings) -> bool:
    pid = serving_pid(settings)
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    for _ in range(150):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(pid, signal.SIGKILL)
    _pid_file(settings).unlink(missing_ok=True)
    return True


def continue_config(settings: Settings, key: str | None) -> str:
    """The Continue config.yaml snippet for this machine's tabloop."""
    host = settings.serve_host
    api_key = key or "unused-in-open-mode"
    return f"""\
# ~/.continue/config.yaml — autocomplete from tabloop, feedback back to it
models:
  - name: tabloop
    provider: openai
    model: qwen2.5-coder-1.5b      # "qwen" + "coder" in the name: Continue uses the Qwen FIM template
    apiBase: http://{host}:{settings.completions_port}/v1
    apiKey: {api_key}
    roles: [autocomplete]
# Feedback from stock Continue:
data:
  - name: tabloop
    destination: http://{host}:{settings.feedback_port}/api/continue/events
    schema: 0.2.0
    level: all
    events: [autocomplete]
    apiKey: {api_key}
# Or, with the Continue fork of the RLinf recipe, in its tabAutocompleteOptions:
#   completionTrackingUrl: http://{host}:{settings.feedback_port}/api/training/submit
#   completionTrackingHeaders: {{Authorization: "Bearer {api_key}"}}
"""


def new_local_key(settings: Settings) -> str | None:
    if settings.auth == "open":
        return None
    from serving.auth import KeyStore

    return KeyStore(settings.keys_file).add("local", getpass.getuser())
