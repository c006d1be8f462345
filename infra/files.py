"""Files only the user who runs tabloop can read.

The state dir holds secrets — the API-key store, the history token — and logs that record what the
components did. Another local user must not read any of it, so:

- the state dir is 0700 (``private_dir``): made so, and tightened when it exists with looser modes.
  That alone closes everything under it, whatever the modes of the files inside (Kafka's data,
  ClickHouse, models, files written before this rule) — they are not walked and changed;
- the secrets and the logs tabloop writes are 0600 besides (``open_private``), also when they existed
  with other modes: a log copied out of the state dir, or a state dir loosened by hand, still keeps them;
- tabloop's long-running processes (the supervisor and its components, the Kafka broker) are started
  with the umask ``PRIVATE_UMASK``, so what they create — trainer logs, spool files, Kafka segments,
  ClickHouse parts — is private too, without every writer in the code base having to remember it.
  The umask is set on the child at spawn time, never on the calling process (a test or a CLI command
  whose other outputs, e.g. ``tabloop model tiny --out DIR``, keep the user's usual modes).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

PRIVATE_UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600


class PrivateFileError(PermissionError):
    """A directory or file that should be private can't be made so; the message says what to do."""


def private_dir(path: Path | str) -> Path:
    """``path`` as a directory only its owner can use (0700): created so, or tightened when it exists with
    group or other bits. Its missing parents are created with the usual modes (they are not tabloop's)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        pass
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise PrivateFileError(f"{path} is not a directory")
    if st.st_mode & 0o077:
        _tighten(path, st, DIR_MODE)
    return path


def open_private(path: Path | str, mode: str = "ab") -> BinaryIO:
    """Open ``path`` for writing as a file only its owner can read (0600), created so or tightened.
    ``mode`` is ``ab`` (append; a log) or ``wb`` (truncate)."""
    if mode not in ("ab", "wb"):
        raise ValueError(f"open_private writes bytes: mode 'ab' or 'wb', not {mode!r}")
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "ab" else os.O_TRUNC)
    fd = os.open(path, flags, FILE_MODE)
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077:  # an existing file keeps its mode on open: tighten it
            _tighten(Path(path), st, FILE_MODE, fd=fd)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def write_private(path: Path | str, data: str | bytes) -> None:
    """Write ``data`` to ``path`` (0600) through a temporary file and a rename: readers see the old or the
    new content, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open_private(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    tmp.replace(path)


def _tighten(path: Path, st: os.stat_result, mode: int, fd: int | None = None) -> None:
    if st.st_uid != os.geteuid() and os.geteuid() != 0:
        raise PrivateFileError(
            f"{path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}) and belongs to uid "
            f"{st.st_uid}, not to this user ({os.geteuid()}), so tabloop can't make it private; it keeps API "
            f"keys and tokens there: `chmod {mode:o} {path}` as its owner, or point TABLOOP_STATE_DIR elsewhere")
    if fd is not None:
        os.fchmod(fd, mode)
    else:
        os.chmod(path, mode)


def log_tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log, for an error message that says why something stopped; a word
    instead when the log is not there. The one log tail of the project (supervisor, benches, Kafka)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"({path} does not exist)"
