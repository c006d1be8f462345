"""Helpers of `tabloop up` and the tests: the readiness poll, the addresses of a system, the Continue config
snippet, a fresh local key."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import yaml

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


CONTINUE_NAME = "tabloop"
"""The name of the model and of the data destination that `tabloop continue config --merge` owns."""


def _api_key(addresses: dict, key: str | None) -> str:
    return key or ("unused-in-open-mode" if addresses["auth"] == "open" else KEY_PLACEHOLDER)


def continue_entries(addresses: dict, key: str | None) -> tuple[dict, dict]:
    """(the autocomplete model, the ``data:`` destination) for the system at ``addresses`` (``endpoints``)."""
    api_key = _api_key(addresses, key)
    # "qwen" + "coder" in the model name: Continue writes its Qwen FIM template (the front door renders
    # the prompt in the served model's own format whatever template the client used).
    model = {"name": CONTINUE_NAME, "provider": "openai", "model": "qwen2.5-coder-1.5b",
             "apiBase": addresses["completions"], "apiKey": api_key, "roles": ["autocomplete"]}
    data = {"name": CONTINUE_NAME, "destination": f"{addresses['feedback']}/api/continue/events",
            "schema": "0.2.0", "level": "all", "events": ["autocomplete"], "apiKey": api_key}
    return model, data


def continue_config(addresses: dict, key: str | None) -> str:
    """A complete Continue ``config.yaml`` for the system at ``addresses`` (``endpoints``): what Continue's
    parser requires (name, version, schema), the autocomplete model and the feedback destination. ``key``
    None: the system's auth is open, or the user fills in a key of theirs."""
    model, data = continue_entries(addresses, key)
    body = yaml.safe_dump({"name": "tabloop", "version": "1.0.0", "schema": "v1", "models": [model], "data": [data]},
                          sort_keys=False, default_flow_style=None, width=200)
    return (f"# ~/.continue/config.yaml: autocomplete from tabloop, feedback back to it. To keep a config of your own,\n"
            f"# `tabloop continue config --merge ~/.continue/config.yaml` adds these two entries to it instead.\n"
            f"{body}"
            f"# Or, with the Continue fork of the RLinf recipe, in its tabAutocompleteOptions:\n"
            f"#   completionTrackingUrl: {addresses['feedback']}/api/training/submit\n"
            f"#   completionTrackingHeaders: {{Authorization: \"Bearer {model['apiKey']}\"}}\n")


class ContinueConfigError(Exception):
    """A Continue config that `tabloop continue config --merge` will not touch."""


def merge_continue_config(path: Path, addresses: dict, key: str | None) -> Path:
    """Put tabloop's autocomplete model and data destination into the Continue config at ``path``: an entry
    of the same name is replaced, everything else kept (comments excepted: the YAML is rewritten). The
    file as it was is kept beside it (``<name>.bak``, or ``.bak.N`` if one exists); returns that path. A
    file that is not YAML, or whose ``models``/``data`` are not lists, is refused and left as it is."""
    text = path.read_text(encoding="utf-8")
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ContinueConfigError(f"{path} is not YAML Continue could read, so it was left as it is: {exc}") from None
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise ContinueConfigError(f"{path} is not a Continue config (its top level is a "
                                  f"{type(config).__name__}, not a mapping); it was left as it is")
    # What Continue's parser requires of a whole file; a file that already has them keeps its own.
    config = {"name": "Local Config", "version": "1.0.0", "schema": "v1", **config}
    model, data = continue_entries(addresses, key)
    for section, entry in (("models", model), ("data", data)):
        entries = config.get(section) or []
        if not isinstance(entries, list):
            raise ContinueConfigError(f"{path}: '{section}' is a {type(entries).__name__}, not a list; "
                                      "it was left as it is")
        kept = [e for e in entries if not (isinstance(e, dict) and e.get("name") == CONTINUE_NAME)]
        config[section] = [*kept, entry]
    backup = path.with_name(path.name + ".bak")
    n = 1
    while backup.exists():
        backup, n = path.with_name(f"{path.name}.bak.{n}"), n + 1
    backup.write_text(text, encoding="utf-8")
    tmp = path.with_name(path.name + ".tabloop-tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=200), encoding="utf-8")
    tmp.replace(path)  # whole or not at all: Continue may read it at any moment
    return backup
