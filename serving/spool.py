"""A local durable spool for events that could not reach Kafka yet.

The front door must not lose an event it has answered for while Kafka is down:
it appends the encoded event here (on disk, fsync'd, before ``append``
returns), republishes ``pending()`` records when Kafka is back and ``ack``s
what Kafka took. That is at-least-once: a crash between Kafka's ack and ours
publishes a record again, and readers drop the duplicate by its event_id.

On disk, per segment: ``<first seq>.seg``, frames of records (the payload's
length and CRC32, then the payload), and ``<first seq>.ack``, the acked seqs
(fixed-size entries, each with its CRC32). A segment is deleted with its acks
once all its records are acked, so nothing grows without bound. A frame cut
short or bad at the very end of the newest segment is what a crash mid-append
leaves: dropped quietly and cut off by the next append. Any other damage is
logged and the rest of that segment skipped, never raised.
"""

from __future__ import annotations

import bisect
import fcntl
import logging
import operator
import os
import re
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

log = logging.getLogger("tabloop.spool")

_FRAME = struct.Struct(">II")        # payload length, CRC32 of the payload
_RECORD = struct.Struct(">BQqHiHI")  # version, seq, timestamp_ms, len(topic), len(key) or -1, len(event_id), len(value)
_ACK = struct.Struct(">QI")          # an acked seq, CRC32 of its 8 bytes
_VERSION = 1
_NAME = re.compile(r"^(\d{20})\.(seg|ack)$")


class SpoolError(RuntimeError):
    """The spool can't be used as asked; the message says why."""


@dataclass(frozen=True, slots=True)
class SpoolRecord:
    seq: int
    topic: str
    key: bytes | None
    value: bytes
    event_id: str
    timestamp_ms: int


@dataclass(eq=False, slots=True)
class _Segment:
    path: Path
    base: int                 # no record in it has a lower seq: names keep seqs monotonic when all is acked
    top: int                  # 1 + its highest seq (base when empty)
    end: int = 0              # bytes of intact frames
    acks: int = 0             # bytes of whole entries in its ack file: the next ack is written there
    skip: int = 0             # where its first unacked record starts, as far as pending() has seen
    unacked: set[int] = field(default_factory=set)


class Spool:
    """Append-only segments with their ack files; one Spool per directory (locked), thread-safe."""

    def __init__(self, directory: Path, segment_bytes: int = 64 * 2**20):
        if segment_bytes < 1:
            raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
        self.directory, self._segment_bytes = Path(directory), segment_bytes
        created = not self.directory.exists()
        self.directory.mkdir(parents=True, exist_ok=True)
        if created:
            _fsync_dir(self.directory.parent)
        self._lock = threading.Lock()
        self._dir_lock: int | None = _lock_directory(self.directory)
        self._fd: int | None = None        # the newest segment, opened for appending on first use
        self._repair: str | None = None    # 'torn'/'corrupt' end of the newest segment, dealt with by the next append
        try:
            self._recover()
        except BaseException:
            self.close()  # not holding the directory lock for a Spool that never was
            raise

    def _recover(self) -> None:
        files = {(int(m[1]), m[2]): p for p in self.directory.iterdir() if (m := _NAME.match(p.name))}
        for base, kind in files:
            if kind == "ack" and (base, "seg") not in files:  # its segment's deletion got this far
                files[base, kind].unlink()
        bases = sorted(base for base, kind in files if kind == "seg")
        self._segments = [self._load(files[b, "seg"], b, b == bases[-1]) for b in bases]
        self._next_seq = max([s.top for s in self._segments] + [0])
        if self._repair == "corrupt":  # the next append starts a new segment; its name must be free
            self._next_seq = max(self._next_seq, self._segments[-1].base + 1)
        self._depth = sum(len(s.unacked) for s in self._segments)
        self._drop_acked_segments()

    def append(self, topic: str, key: bytes | None, value: bytes, event_id: str, timestamp_ms: int) -> int:
        """Write one record durably; return its seq. Once this returns, the record survives kill -9 and power loss."""
        with self._lock:
            self._check_open()
            seq = self._next_seq
            frame = _frame(_encode(seq, topic, key, value, event_id, timestamp_ms))
            fd = self._writable(len(frame))
            try:
                _write_durably(fd, frame, self._segments[-1].end)
            except BaseException:
                self._repair = "torn"  # whatever part of it landed is cut off before the next append
                raise
            seg = self._segments[-1]
            seg.end, seg.top = seg.end + len(frame), seq + 1
            seg.unacked.add(seq)
            self._next_seq, self._depth = seq + 1, self._depth + 1
            return seq

    def pending(self, limit: int | None = None) -> list[SpoolRecord]:
        """Unacknowledged records in append order (the first ``limit`` of them)."""
        out: list[SpoolRecord] = []
        with self._lock:
            self._check_open()
            for seg in (s for s in self._segments if s.unacked):
                frames, first = _Frames(seg.path, seg.end, seg.skip), True
                for rec in frames.records():
                    if rec.seq in seg.unacked:
                        if first:  # a replay in batches must not re-read the acked head of a segment every time
                            seg.skip, first = frames.end, False
                        out.append(rec)
                        if limit is not None and len(out) >= limit:
                            return out
                if frames.damage:
                    log.warning("spool segment %s changed on disk since it was opened: unreadable from byte %d",
                                seg.path, frames.end)
        return out

    def ack(self, seqs: Iterable[int]) -> None:
        """Mark records published, durably, in any order; acking an acked record again is a no-op."""
        with self._lock:
            self._check_open()
            bases = [s.base for s in self._segments]
            fresh: dict[_Segment, set[int]] = {}
            for seq in map(operator.index, seqs):
                if not 0 <= seq < self._next_seq:
                    raise ValueError(f"spool ack: no record was given seq {seq} (the next seq is {self._next_seq})")
                i = bisect.bisect_right(bases, seq) - 1
                if i >= 0 and seq in (seg := self._segments[i]).unacked:
                    fresh.setdefault(seg, set()).add(seq)
            for seg, acked in fresh.items():
                entries = b"".join(_ACK.pack(s, zlib.crc32(s.to_bytes(8, "big"))) for s in sorted(acked))
                # Written at the end of the whole entries, over whatever a failed write left there; an entry
                # that did land from a failed ack is still true (the record was published), so no harm.
                fd = os.open(seg.path.with_suffix(".ack"), os.O_WRONLY)
                try:
                    _write_durably(fd, entries, seg.acks)
                finally:
                    os.close(fd)
                seg.acks += len(entries)
                seg.unacked -= acked
                self._depth -= len(acked)
            self._drop_acked_segments()

    def depth(self) -> int:
        return self._depth

    def close(self) -> None:
        with self._lock:
            for fd in (self._fd, self._dir_lock):
                if fd is not None:
                    os.close(fd)
            self._fd = self._dir_lock = None

    def __enter__(self) -> "Spool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals (called with the lock held) -----------------------------------

    def _check_open(self) -> None:
        if self._dir_lock is None:
            raise SpoolError(f"the spool in {self.directory} is closed")

    def _load(self, path: Path, base: int, newest: bool) -> _Segment:
        seg, acked = _Segment(path, base, top=base), set()
        ack_path = path.with_suffix(".ack")
        if not ack_path.exists():  # the crash came between creating the segment and its ack file
            ack_path.touch(0o600)
            _fsync_dir(self.directory)
        data = ack_path.read_bytes()
        seg.acks = len(data) - len(data) % _ACK.size  # a torn last entry is overwritten by the next ack
        for seq, crc in _ACK.iter_unpack(data[:seg.acks]):
            if crc == zlib.crc32(seq.to_bytes(8, "big")):
                acked.add(seq)
                seg.top = max(seg.top, seq + 1)  # a seq once acked is never handed out again
            elif seq or crc:  # zeros are what a filesystem may leave of a write cut by power loss
                log.warning("spool ack file %s has a corrupt entry: its record will be published again", ack_path)
        frames, last = _Frames(path), base - 1
        for rec in frames.records():
            if rec.seq <= last:  # seqs only grow within a segment
                frames.damage = "corrupt"
                break
            last = rec.seq
            if rec.seq not in acked:
                seg.unacked.add(rec.seq)
        seg.end, seg.top = frames.end, max(seg.top, last + 1)
        if frames.damage == "torn" and newest:
            log.info("spool segment %s ends in a torn record (a crash mid-append): dropped", path)
        elif frames.damage:
            log.warning("spool segment %s is corrupt at byte %d: the records after it are lost", path, frames.end)
        if newest:
            self._repair = frames.damage
        return seg

    def _writable(self, size: int) -> int:
        seg = self._segments[-1] if self._segments else None
        if seg is not None and self._fd is None:
            self._fd = os.open(seg.path, os.O_WRONLY)
        if self._repair == "torn":
            os.ftruncate(self._fd, seg.end)
            os.fsync(self._fd)
            self._repair = None
        if seg is None or self._repair == "corrupt" or (seg.end and seg.end + size > self._segment_bytes):
            if self._fd is not None:  # rotate; a corrupt newest segment is kept as it is, not appended to
                os.close(self._fd)
            path = self.directory / f"{self._next_seq:020d}.seg"
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(os.open(path.with_suffix(".ack"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            self._segments.append(_Segment(path, self._next_seq, top=self._next_seq))
            self._repair = None
            _fsync_dir(self.directory)  # the new names are durable before any record in them counts
        return self._fd

    def _drop_acked_segments(self) -> None:
        done = [s for s in self._segments[:-1] if not s.unacked]
        for seg in done:
            seg.path.unlink()
        if done:
            _fsync_dir(self.directory)  # the records are gone for good before their acks go
            for seg in done:
                seg.path.with_suffix(".ack").unlink(missing_ok=True)
            self._segments = [s for s in self._segments if s not in done]


class _Frames:
    """Iterates the intact frame payloads of a file (from ``start``, up to ``limit`` bytes). ``end`` is where
    the last one yielded starts while it is being handled, and where they stop once done; ``damage`` says why
    reading stopped early: 'torn' (cut short, or bad at the very end) or 'corrupt'."""

    def __init__(self, path: Path, limit: int | None = None, start: int = 0):
        self.path, self.limit, self.end, self.damage = path, limit, start, None

    def __iter__(self) -> Iterator[bytes]:
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size if self.limit is None else self.limit
            pos = f.seek(self.end)
            while pos < size:
                header = f.read(_FRAME.size)
                length, crc = _FRAME.unpack(header) if len(header) == _FRAME.size else (size, 0)
                stop = pos + _FRAME.size + length
                if stop > size:
                    self.damage = "torn"
                    return
                payload = f.read(length)
                if length == 0 or len(payload) < length or zlib.crc32(payload) != crc:
                    # Only zeros after a bad frame is a torn write too: filesystems may zero-fill after power loss.
                    f.seek(pos)
                    self.damage = "corrupt" if f.read(size - pos).strip(b"\0") and stop < size else "torn"
                    return
                yield payload
                self.end = pos = stop

    def records(self) -> Iterator[SpoolRecord]:
        for payload in self:
            if (rec := _decode(payload)) is None:
                self.damage = "corrupt"
                return
            yield rec


def _encode(seq: int, topic: str, key: bytes | None, value: bytes, event_id: str, timestamp_ms: int) -> bytes:
    if not (isinstance(topic, str) and isinstance(event_id, str) and isinstance(timestamp_ms, int)
            and isinstance(value, bytes) and (key is None or isinstance(key, bytes))):
        raise TypeError("spool append: topic and event_id must be str, key bytes or None, value bytes, "
                        "timestamp_ms int")
    t, e = topic.encode(), event_id.encode()
    if not 0 < len(t) < 2**16 or len(e) >= 2**16 or not -2**63 <= timestamp_ms < 2**63:
        raise ValueError(f"spool append: topic must be 1..65535 bytes, event_id under 64 KiB, timestamp_ms an int64; "
                         f"got {len(t)} bytes, {len(e)} bytes, {timestamp_ms}")
    if len(value) + len(key or b"") >= 2**31:
        raise ValueError("spool append: key and value together must be under 2 GiB")
    header = _RECORD.pack(_VERSION, seq, timestamp_ms, len(t), -1 if key is None else len(key), len(e), len(value))
    return b"".join((header, t, key or b"", e, value))


def _decode(payload: bytes) -> SpoolRecord | None:
    """The record in a payload, or None when its fields don't add up (a CRC can't catch our own bugs)."""
    if len(payload) < _RECORD.size:
        return None
    version, seq, ts, tlen, klen, elen, vlen = _RECORD.unpack_from(payload)
    if version != _VERSION or klen < -1 or len(payload) != _RECORD.size + tlen + max(klen, 0) + elen + vlen:
        return None
    p = _RECORD.size
    key = None if klen < 0 else payload[p + tlen:p + tlen + klen]
    q = p + tlen + max(klen, 0)
    try:
        return SpoolRecord(seq, payload[p:p + tlen].decode(), key, payload[q + elen:], payload[q:q + elen].decode(), ts)
    except UnicodeDecodeError:
        return None


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _write_durably(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
    os.fsync(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lock_directory(directory: Path) -> int:
    """Two Spools appending to one directory would interleave seqs and lose records: refuse the second."""
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SpoolError(f"the spool in {directory} is in use by another process (or an unclosed Spool)") from None
    return fd
