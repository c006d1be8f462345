"""Secrets stay secret: the state dir is 0700, the key store, the history token and every log 0600 (as the
components make them, and tightened when an older tabloop left them looser), and no log holds the token."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tabloop import supervisor as sv
from infra.files import PrivateFileError, open_private, private_dir, write_private
from tests.conftest import make_settings
from tests.system_helpers import cli as _cli
from tests.system_helpers import supervising
from tests.system_helpers import wait as _wait


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def loose(root: Path) -> dict[str, str]:
    """Everything under ``root`` (itself included) another user could read, write or enter, with its mode."""
    found = {}
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink() and mode(path) & 0o077:
            found[str(path.relative_to(root))] = f"{mode(path):o}"
    return found


def test_private_dir_makes_0700_and_tightens_a_looser_one(tmp_path):
    made = private_dir(tmp_path / "a" / "state")
    assert made.is_dir() and mode(made) == 0o700
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    old.chmod(0o755)  # as an older tabloop left it (umask 022)
    (old / "inside.log").write_text("x")
    (old / "inside.log").chmod(0o644)
    private_dir(old)
    assert mode(old) == 0o700
    # What is under it is not walked: the closed dir is what keeps others out of it.
    assert mode(old / "inside.log") == 0o644
    (tmp_path / "file").write_text("")
    with pytest.raises(PrivateFileError, match="is not a directory"):
        private_dir(tmp_path / "file")


def test_open_private_creates_0600_and_tightens_an_existing_log_keeping_its_lines(tmp_path):
    with open_private(tmp_path / "new.log") as f:
        f.write(b"one\n")
    assert mode(tmp_path / "new.log") == 0o600
    old = tmp_path / "old.log"
    old.write_text("before\n")
    old.chmod(0o644)
    with open_private(old) as f:
        f.write(b"after\n")
    assert mode(old) == 0o600 and old.read_text() == "before\nafter\n"
    write_private(tmp_path / "status.json", "{}")
    assert mode(tmp_path / "status.json") == 0o600 and (tmp_path / "status.json").read_text() == "{}"
    with pytest.raises(ValueError, match="mode 'ab' or 'wb'"):
        open_private(tmp_path / "x", "r")


def test_the_cli_makes_the_state_dir_private_and_keeps_key_store_and_token_0600(tmp_path):
    state = tmp_path / "state"
    settings = make_settings(state)
    proc = _cli(settings, "keys", "add", "--project", "p", "--user", "u")
    assert proc.returncode == 0, proc.stderr
    assert mode(state) == 0o700 and mode(state / "keys.json") == 0o600
    # A state dir an older tabloop made 0755 is tightened by the next command, whichever it is.
    state.chmod(0o755)
    token = _cli(settings, "history", "token")
    assert token.returncode == 0, token.stderr
    assert mode(state) == 0o700 and mode(state / "history.token") == 0o600
    assert (state / "history.token").read_text().strip() == token.stdout.strip()
    url = _cli(settings, "history", "token", "--url")
    assert url.stdout.strip() == f"http://127.0.0.1:{settings.history_port}/#token={token.stdout.strip()}"
    assert loose(state) == {}


@pytest.mark.kafka
def test_the_kafka_brokers_dir_log_and_data_are_private(kafka):
    """The session's broker, started by LocalKafka.start: its dir, log and every data file it wrote."""
    assert mode(kafka.dir) == 0o700 and mode(kafka.log_file) == 0o600
    assert (kafka.data_dir / "meta.properties").exists()  # written by the storage tool, with the private umask
    assert loose(kafka.dir) == {}


@pytest.mark.kafka
def test_supervised_components_write_private_files_and_no_log_holds_the_token(kafka, tmp_path):
    """The real history sink under the real supervisor, in a state dir an older tabloop left world-readable
    with a 0644 history.log: afterwards nothing under the state dir is open to others, and neither the
    component's log nor the supervisor's output (logs/supervisor.log when detached) holds the token."""
    from infra.bus import ensure_topics

    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    for d in (state, state / "logs"):
        d.chmod(0o755)
    (state / "logs" / "history.log").write_text("an older run\n")
    (state / "logs" / "history.log").chmod(0o644)
    settings = make_settings(state, kafka_bootstrap=kafka.settings.kafka_bootstrap, history_port=0)
    ensure_topics(settings)
    history = next(c for c in sv.COMPONENTS if c.name == "history")
    with supervising(settings, (history,)) as (sup, out):
        log = state / "logs" / "history.log"
        _wait(lambda: "dashboard http://" in log.read_text(), 180, "the history sink to say where its dashboard is",
              explain=lambda: out.getvalue()[-3000:])
    token = (state / "history.token").read_text().strip()
    assert token.startswith("tlh_")
    assert "dashboard http://" in out.getvalue()  # the line is there, without its token
    assert token not in log.read_text() and token not in out.getvalue()
    assert log.read_text().startswith("an older run\n")
    assert mode(state) == 0o700 and mode(state / "logs") == 0o700 and mode(log) == 0o600
    assert mode(state / "history.token") == 0o600 and mode(state / "run" / "status.json") == 0o600
    # ClickHouse's files, made by the component: private through the umask it was started with.
    assert any((state / "clickhouse").rglob("*"))
    assert loose(state) == {}
