"""Commands a user types, run as the user runs them (`python -m tabloop.cli` in a subprocess, a state dir of
the test's own): `tabloop keys list|revoke`, `tabloop continue config --merge` and `tabloop schemas check`
on a schema change that breaks old data. No broker, no model: each is one short process."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import yaml

from infra.auth import KeyStore
from tests.conftest import make_settings
from tests.system_helpers import ROOT
from tests.system_helpers import cli as _cli


# -- keys -----------------------------------------------------------------------------------------------


def test_keys_list_shows_ids_never_keys_and_revoke_ends_a_key(tmp_path):
    settings = make_settings(tmp_path, auth="keys")
    added = _cli(settings, "keys", "add", "--project", "acme", "--user", "alice", "--rate", "7")
    assert added.returncode == 0, added.stderr
    alice = added.stdout.strip()
    bob = KeyStore(settings.keys_file).add("acme", "bob")
    alice_id, bob_id = (re.fullmatch(r"tlk_([0-9a-f]{8})_\S+", k).group(1) for k in (alice, bob))

    listed = _cli(settings, "keys", "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == [f"{alice_id}  project=acme  user=alice  rate=7",
                                          f"{bob_id}  project=acme  user=bob  rate=default"]
    secrets = [k.split("_", 2)[2] for k in (alice, bob)]  # the secret is url-safe base64: it may hold "_" too
    assert all(secrets) and not any(secret in listed.stdout for secret in secrets)

    revoked = _cli(settings, "keys", "revoke", alice_id)
    assert (revoked.returncode, revoked.stdout) == (0, f"revoked {alice_id}\n"), revoked.stderr
    store = KeyStore(settings.keys_file)
    assert store.verify(alice) is None and store.verify(bob).user_id == "bob"  # the door refuses it from now on
    assert _cli(settings, "keys", "list").stdout.splitlines() == [f"{bob_id}  project=acme  user=bob  rate=default"]

    again = _cli(settings, "keys", "revoke", alice_id)
    assert again.returncode == 1 and f"no key with id '{alice_id}'" in again.stderr
    assert store.verify(bob) is not None


# -- continue config --merge ------------------------------------------------------------------------------


def test_continue_config_merge_adds_tabloop_keeps_the_rest_and_a_backup(tmp_path):
    settings = make_settings(tmp_path / "state", auth="keys", completions_port=18581, feedback_port=18582)
    config = tmp_path / "config.yaml"
    own = ("name: Mine\nversion: 0.0.1\nschema: v1\nmodels:\n  - name: chat\n    provider: ollama\n"
           "    model: llama3\n  - name: tabloop\n    provider: openai\n    model: old\ncontext:\n  - provider: code\n")
    config.write_text(own)

    merged = _cli(settings, "continue", "config", "--merge", str(config), "--new-key")
    assert merged.returncode == 0, merged.stderr
    assert merged.stdout == f"merged the tabloop model and data destination into {config} (the old file: " \
                            f"{config}.bak)\n"
    key = re.search(r"shown once, only its hash is kept\): (tlk_\S+)", merged.stderr).group(1)
    assert (tmp_path / "config.yaml.bak").read_text() == own
    got = yaml.safe_load(config.read_text())
    assert [m["name"] for m in got["models"]] == ["chat", "tabloop"] and got["context"] == [{"provider": "code"}]
    tabloop = got["models"][1]
    assert (tabloop["apiBase"], tabloop["apiKey"], tabloop["roles"]) == \
        ("http://127.0.0.1:18581/v1", key, ["autocomplete"])
    assert got["data"] == [{"name": "tabloop", "destination": "http://127.0.0.1:18582/api/continue/events",
                            "schema": "0.2.0", "level": "all", "events": ["autocomplete"], "apiKey": key}]
    assert KeyStore(settings.keys_file).verify(key).project_id == "local"

    # A second merge replaces tabloop's entries (no duplicate) and keeps the first backup.
    again = _cli(settings, "continue", "config", "--merge", str(config))
    assert again.returncode == 0 and again.stdout.endswith(f"(the old file: {config}.bak.1)\n"), again.stderr
    assert [m["name"] for m in yaml.safe_load(config.read_text())["models"]] == ["chat", "tabloop"]
    assert (tmp_path / "config.yaml.bak").read_text() == own

    # A file it cannot read: exit 1, said why, left as it was.
    config.write_text("models: [\n")
    broken = _cli(settings, "continue", "config", "--merge", str(config))
    assert broken.returncode == 1 and "is not YAML Continue could read" in broken.stderr
    assert config.read_text() == "models: [\n"


# -- schemas check ----------------------------------------------------------------------------------------


def _schemas_check(package_root) -> subprocess.CompletedProcess:
    """`tabloop schemas check` with the ``schemas`` package imported from ``package_root`` (a copy)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package_root), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "tabloop.cli", "schemas", "check"], env=env, cwd=package_root,
                          capture_output=True, text=True, timeout=120)


def test_schemas_check_fails_on_a_breaking_change_and_passes_a_compatible_one(tmp_path):
    shutil.copytree(ROOT / "schemas", tmp_path / "schemas", ignore=shutil.ignore_patterns("__pycache__"))
    current = tmp_path / "schemas" / "avro" / "FeedbackReceived.avsc"
    schema = json.loads(current.read_text())

    ok = _schemas_check(tmp_path)
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "", ""), ok.stderr

    # Compatible: a new field with a default. Passes, and says the schema needs releasing.
    compatible = json.loads(json.dumps(schema))
    compatible["fields"].append({"name": "extra_note", "type": ["null", "string"], "default": None})
    current.write_text(json.dumps(compatible))
    said = _schemas_check(tmp_path)
    assert said.returncode == 0, said.stderr
    assert said.stdout == ("FeedbackReceived: changed since its last release (compatible); "
                           "run `tabloop schemas release`\n")

    # Breaking: a new field without a default (old data cannot be read with it). Exit 1, said for that type.
    breaking = json.loads(json.dumps(schema))
    breaking["fields"].append({"name": "extra_count", "type": "long"})
    current.write_text(json.dumps(breaking))
    bad = _schemas_check(tmp_path)
    assert bad.returncode == 1, (bad.stdout, bad.stderr)
    lines = bad.stderr.splitlines()
    assert lines[-1] == "Error: breaking schema changes", bad.stderr
    problems = [ln for ln in lines[:-1] if ln.startswith("FeedbackReceived: ")]
    assert problems and all("extra_count" in ln for ln in problems), bad.stderr
    assert not [ln for ln in lines[:-1] if not ln.startswith("FeedbackReceived: ")], bad.stderr
