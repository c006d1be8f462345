"""The command registry (tabloop/cli.py): one way to add a command, its `--help` listing read without importing
the commands, each entry true to the command it names."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from tabloop.cli import BENCHES, COMMANDS, DRILLS, load_command, main


def _normalized(text: str) -> str:
    return " ".join(text.split())


REGISTRIES = [("", COMMANDS), ("bench ", BENCHES), ("drill ", DRILLS)]


@pytest.mark.parametrize("prefix,name", [(prefix, name) for prefix, registry in REGISTRIES for name in registry])
def test_each_entry_names_a_command_whose_help_starts_with_the_listed_line(prefix, name):
    registry = dict(REGISTRIES)[prefix]
    target, listed = registry[name]
    command = load_command(target)
    assert isinstance(command, click.Command), f"{prefix}{name}: {target} is not a click command"
    if listed is None:
        assert command.hidden, f"{prefix}{name}: no listed help, so it must be a hidden command"
        return
    assert _normalized(command.help or "").startswith(_normalized(listed).rstrip(".")), (
        f"{prefix}{name}: the registry lists {listed!r}, the command's help says {command.help!r}")


def test_top_level_help_lists_every_visible_command_without_importing_the_model_code():
    # A fresh interpreter: the registry's listing must not import torch (seconds) nor any command module.
    code = ("import sys; from click.testing import CliRunner; from tabloop.cli import main; "
            "r = CliRunner().invoke(main, ['--help']); print(r.output); "
            "print('IMPORTED', sorted(m for m in sys.modules if m in ('torch', 'serving.server', 'trainer.cli', "
            "'streams.app', 'infra.cli')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "IMPORTED []" in out
    listed = {line.split()[0] for line in out.split("Commands:")[1].splitlines() if line.startswith("  ")}
    assert listed == {name for name, (_, text) in COMMANDS.items() if text is not None}


def test_an_unknown_command_is_a_usage_error_naming_it():
    result = CliRunner().invoke(main, ["nope"])
    assert result.exit_code == 2 and "No such command 'nope'" in result.output


def test_a_registered_command_runs_through_the_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("TABLOOP_STATE_DIR", str(tmp_path / "state"))
    result = CliRunner().invoke(main, ["topics", "list"])
    assert result.exit_code == 0, result.output
    assert "tabloop.completions" in result.output and "tabloop.episodes" in result.output
