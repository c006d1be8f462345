"""Helpers of `tabloop up` and the tests: the readiness poll, the addresses of a system, the Continue config
snippet, a fresh local key."""

from __future__ import annotations

import getpass
import subprocess
import time
from pathlib import Path

import httpx

from infra.settings import Settings


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


def client_host(host: str) -> str:
    """The address a client on this machine uses for a server listening on ``host``: a wildcard listen address
    (0.0.0.0, ::) is no address to connect to, so it becomes the loopback; an IPv6 literal gets its brackets."""
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def endpoints(settings: Settings) -> dict:
    """Where a system run with ``settings`` answers, as a client on this machine reaches it. The supervisor
    records this in its status, and `tabloop up` prints it. No secrets: status.json is no place for them."""
    serve = client_host(settings.serve_host)
    return {"completions": f"http://{serve}:{settings.completions_port}/v1",
            "feedback": f"http://{serve}:{settings.feedback_port}",
            "history": f"http://{client_host(settings.history_host)}:{settings.history_port}",
            "auth": settings.auth,
            "kafka_bootstrap": settings.kafka_bootstrap,
            "state_dir": str(settings.state_dir.resolve())}


KEY_PLACEHOLDER = "<your tabloop API key>"


def continue_config(addresses: dict, key: str | None) -> str:
    """The Continue config.yaml snippet for the system at ``addresses`` (``endpoints``). ``key`` None: the
    system's auth is open, or the user fills in a key of theirs."""
    api_key = key or ("unused-in-open-mode" if addresses["auth"] == "open" else KEY_PLACEHOLDER)
    completions, feedback = addresses["completions"], addresses["feedback"]
    return f"""\
# ~/.continue/config.yaml — autocomplete from tabloop, feedback back to it
models:
  - name: tabloop
    provider: openai
    model: qwen2.5-coder-1.5b      # "qwen" + "coder" in the name: Continue uses the Qwen FIM template
    apiBase: {completions}
    apiKey: {api_key}
    roles: [autocomplete]
# Feedback from stock Continue:
data:
  - name: tabloop
    destination: {feedback}/api/continue/events
    schema: 0.2.0
    level: all
    events: [autocomplete]
    apiKey: {api_key}
# Or, with the Continue fork of the RLinf recipe, in its tabAutocompleteOptions:
#   completionTrackingUrl: {feedback}/api/training/submit
#   completionTrackingHeaders: {{Authorization: "Bearer {api_key}"}}
"""


def new_local_key(keys_file: Path) -> str:
    """A new key of project 'local' for the user running this, in the key store at ``keys_file``."""
    from serving.auth import KeyStore

    return KeyStore(keys_file).add("local", getpass.getuser())
