"""Helpers of `tabloop up` and the tests: the readiness poll, the Continue config snippet, a fresh local key."""

from __future__ import annotations

import getpass
import subprocess
import time

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
