"""API keys and rate limits for the front door.

A key is ``tlk_<key_id>_<secret>``: the key_id (8 hex characters) finds the
entry, the secret (32 random bytes, url-safe base64) proves it. Only
sha256(secret) is stored: the secret is random, not a password, so a slow hash
would buy nothing. The key file is JSON, mode 0600, replaced atomically on
every change and re-read when it changes, so keys the CLI adds or revokes take
effect in a running server.
"""

from __future__ import annotations

import fcntl
import getpass
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
import unicodedata
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, TypeVar

from infra.files import private_dir

log = logging.getLogger("tabloop.auth")

_KEY = re.compile(r"tlk_([0-9a-f]{8})_([A-Za-z0-9_-]{43})")  # token_urlsafe(32) is 43 characters
_HASH = re.compile(r"[0-9a-f]{64}")
MAX_NAME = 128
T = TypeVar("T")


class KeyStoreError(RuntimeError):
    """The key file can't be read or written; the message names it and says why."""


@dataclass(frozen=True, slots=True)
class Principal:
    key_id: str
    project_id: str
    user_id: str
    rate_per_minute: int | None
    created_at: str | None = None  # ISO 8601, UTC


class KeyStore:
    """API keys in a JSON file: ``{"version": 1, "keys": {key_id: {sha256, project_id, user_id, ...}}}``."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._keys: dict[str, dict] = {}
        self._stamp: tuple | None = None
        self._reload(strict=True)

    def add(self, project: str, user: str, rate_per_minute: int | None = None) -> str:
        """Create a key; the plaintext is returned here once and never stored."""
        _check_name("project", project)
        _check_name("user", user)
        if rate_per_minute is not None:
            _check_rate("rate_per_minute", rate_per_minute)
        secret = secrets.token_urlsafe(32)

        def change(keys: dict[str, dict]) -> str:
            key_id = secrets.token_hex(4)
            while key_id in keys:
                key_id = secrets.token_hex(4)
            keys[key_id] = {"sha256": _digest(secret), "project_id": project, "user_id": user,
                            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                            "rate_per_minute": rate_per_minute}
            return key_id

        return f"tlk_{self._update(change)}_{secret}"

    def verify(self, presented: str) -> Principal | None:
        """The key's principal, or None for a malformed, unknown, revoked or wrong key."""
        match = _KEY.fullmatch(presented) if isinstance(presented, str) else None
        if match is None:
            return None
        key_id, secret = match.groups()
        with self._lock:
            self._reload(strict=False)
            entry = self._keys.get(key_id)
        if entry is None or not hmac.compare_digest(_digest(secret), entry["sha256"]):
            return None
        return _principal(key_id, entry)

    def revoke(self, key_id: str) -> bool:
        """Delete a key; False when there was no such key."""
        return self._update(lambda keys: keys.pop(key_id, None) is not None)

    def list(self) -> list[Principal]:
        with self._lock:
            self._reload(strict=False)
            principals = [_principal(k, e) for k, e in self._keys.items()]
        return sorted(principals, key=lambda p: (p.project_id, p.user_id, p.created_at or "", p.key_id))

    # -- the file -------------------------------------------------------------

    def _reload(self, strict: bool, force: bool = False) -> None:
        """Re-read the file when it changed. A file that went bad while serving keeps the last good keys
        (logged): failing every request would be worse, and the CLI only ever writes whole files."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # os.replace gives a new inode even within one mtime tick
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp and not force:
            return
        try:
            keys = {} if stamp is None else _parse(self.path.read_bytes())
        except (OSError, ValueError) as exc:
            if strict:
                raise KeyStoreError(f"key file {self.path}: {exc}") from None
            log.error("key file %s: %s; keeping the %d keys read before", self.path, exc, len(self._keys))
        else:
            self._keys = keys
        self._stamp = stamp

    def _update(self, change: Callable[[dict[str, dict]], T]) -> T:
        """Apply ``change`` to the keys as they are on disk now (another process may have written them)."""
        private_dir(self.path.parent)  # the state dir: 0700, so the key store (0600 below) sits in a closed dir
        lock = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with self._lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # writers in other processes (the CLI, other replicas) wait here
                self._reload(strict=True, force=True)
                keys = dict(self._keys)
                result = change(keys)
                if keys != self._keys:
                    self._write(keys)
                return result
        finally:
            os.close(lock)  # releases the flock

    def _write(self, keys: dict[str, dict]) -> None:
        data = json.dumps({"version": 1, "keys": keys}, indent=2, sort_keys=True).encode() + b"\n"
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.fchmod(fd, 0o600)  # whatever the umask, and even if a stale tmp file had other bits
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise KeyStoreError(f"key file {self.path} could not be written: {exc}") from None
        self._keys = keys
        st = os.stat(self.path)
        self._stamp = (st.st_ino, st.st_mtime_ns, st.st_size)


class RateLimiter:
    """A token bucket per key: ``per_minute`` tokens a minute, holding at most ``burst`` of them.

    Without ``burst`` a bucket holds a minute's worth, so "60 a minute" lets 60
    through at once and then one a second. Deterministic given ``now``.
    """

    _PRUNE_AT = 10_000  # buckets; full ones are dropped then (a full bucket is the same as none)

    def __init__(self, default_per_minute: int, burst: int | None = None):
        _check_rate("default_per_minute", default_per_minute)
        if burst is not None:
            _check_rate("burst", burst)
        self.default_per_minute, self.burst = default_per_minute, burst
        self._buckets: dict[str, tuple[float, float, float]] = {}  # key_id -> tokens, at, full again at
        self._lock = threading.Lock()

    def check(self, key_id: str, per_minute: int | None = None, now: float | None = None) -> float:
        """0.0 when a request may pass (a token is taken), else the seconds until one may (for Retry-After)."""
        rate = self.default_per_minute if per_minute is None else per_minute
        _check_rate("per_minute", rate)
        capacity = float(self.burst or rate)
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, at, _ = self._buckets.get(key_id, (capacity, now, now))
            # Tokens accrue from the last time seen; a clock passed in that went back accrues nothing.
            tokens, at = min(capacity, tokens + max(0.0, now - at) * rate / 60), max(at, now)
            if tokens >= 1 - 1e-9:  # float dust must not turn "wait 1.0 s" into "wait 1e-16 s" at t+1.0
                tokens, wait = max(0.0, tokens - 1), 0.0
            else:
                wait = (1 - tokens) * 60 / rate + (at - now)
            self._buckets[key_id] = (tokens, at, at + (capacity - tokens) * 60 / rate)
            if len(self._buckets) > self._PRUNE_AT:
                self._buckets = {k: b for k, b in self._buckets.items() if b[2] > now}
            return wait


def _check_name(field: str, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty string, got {value!r}")
    if len(value) > MAX_NAME:
        raise ValueError(f"{field} is {len(value)} characters long; at most {MAX_NAME} are allowed")
    for i, ch in enumerate(value):
        if unicodedata.category(ch) in ("Cc", "Cf", "Cs"):  # control, invisible formatting, lone surrogates
            raise ValueError(f"{field} has a control character ({ch!r}) at position {i}")


def _rate_ok(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def _check_rate(field: str, value: int) -> None:
    if value is None or not _rate_ok(value):
        raise ValueError(f"{field} must be a positive whole number, got {value!r}")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _parse(data: bytes) -> dict[str, dict]:
    doc = json.loads(data)
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, dict):
        raise ValueError('expected {"version": 1, "keys": {...}}')
    for key_id, entry in keys.items():
        if not (re.fullmatch(r"[0-9a-f]{8}", key_id) and isinstance(entry, dict)
                and _HASH.fullmatch(str(entry.get("sha256"))) and isinstance(entry.get("project_id"), str)
                and isinstance(entry.get("user_id"), str) and _rate_ok(entry.get("rate_per_minute"))):
            raise ValueError(f"key {key_id!r} is malformed (needs sha256, project_id, user_id; "
                             "rate_per_minute a positive whole number or null)")
    return keys


def _principal(key_id: str, entry: dict) -> Principal:
    return Principal(key_id, entry["project_id"], entry["user_id"], entry.get("rate_per_minute"),
                     entry.get("created_at"))


def new_local_key(keys_file: Path) -> str:
    """A new key of project 'local' for the user running this (``tabloop up``, ``tabloop continue config``)."""
    return KeyStore(keys_file).add("local", getpass.getuser())
