"""The spool keeps every record whose append returned, across closes, torn writes and kill -9."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from serving.spool import Spool, SpoolError

REPO = Path(__file__).resolve().parent.parent


def fill(spool: Spool, n: int, start: int = 0, size: int = 10) -> list[int]:
    return [spool.append("tabloop.feedback", f"k{i}".encode(), bytes([i % 256]) * size, f"e{i}", 1000 + i)
            for i in range(start, start + n)]


def seqs(spool: Spool) -> list[int]:
    return [r.seq for r in spool.pending()]


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


def test_append_pending_ack_round_trip(tmp_path):
    with Spool(tmp_path / "spool") as spool:
        assert spool.pending() == [] and spool.depth() == 0
        a = spool.append("tabloop.completions", b"c-1", b"\x00value", "ev-1", 1_700_000_000_000)
        b = spool.append("tabloop.feedback", None, b"", "ev-2", -5)
        assert b > a
        first, second = spool.pending()
        assert (first.seq, first.topic, first.key, first.value, first.event_id, first.timestamp_ms) == \
               (a, "tabloop.completions", b"c-1", b"\x00value", "ev-1", 1_700_000_000_000)
        assert (second.key, second.value, second.timestamp_ms) == (None, b"", -5)
        assert spool.depth() == 2
        spool.ack([a])
        assert seqs(spool) == [b] and spool.depth() == 1
        spool.ack([a])  # acking twice is harmless
        assert spool.depth() == 1
        assert [r.seq for r in spool.pending(limit=1)] == [b]
        with pytest.raises(ValueError, match="no record was given seq 99"):
            spool.ack([99])


def test_reopen_keeps_unacked_and_forgets_acked(tmp_path):
    with Spool(tmp_path) as spool:
        written = fill(spool, 6)
        spool.ack([written[1], written[4]])
        before = spool.pending()
    with Spool(tmp_path) as spool:
        assert spool.pending() == before
        assert seqs(spool) == [written[i] for i in (0, 2, 3, 5)]
        assert spool.depth() == 4
        assert spool.append("t", None, b"x", "later", 0) == written[-1] + 1


def test_one_spool_per_directory(tmp_path):
    with Spool(tmp_path):
        with pytest.raises(SpoolError, match="in use"):
            Spool(tmp_path)
    spool = Spool(tmp_path)
    spool.close()
    with pytest.raises(SpoolError, match="closed"):
        spool.append("t", None, b"x", "e", 0)


def test_bad_arguments_name_the_problem(tmp_path):
    with Spool(tmp_path) as spool:
        with pytest.raises(ValueError, match="topic"):
            spool.append("", None, b"x", "e", 0)
        with pytest.raises(TypeError, match="value bytes"):
            spool.append("t", None, "text", "e", 0)
        assert spool.depth() == 0 and spool.append("t", None, b"x", "e", 0) == 0


def reference_segment(directory: Path, n: int, after: bytes) -> bytes:
    """The bytes of a segment that never saw a crash: ``n`` records by fill, then one more."""
    with Spool(directory) as spool:
        fill(spool, n)
        spool.append("t", b"k", after, "e-new", 7)
    (seg,) = segments(directory)
    return seg.read_bytes()


def test_torn_tail_loses_only_the_torn_record(tmp_path):
    with Spool(tmp_path / "s") as spool:
        fill(spool, 3)
    (seg,) = segments(tmp_path / "s")
    os.truncate(seg, seg.stat().st_size - 3)
    with Spool(tmp_path / "s") as spool:
        assert seqs(spool) == [0, 1] and spool.depth() == 2
        assert spool.append("t", b"k", b"new", "e-new", 7) == 2
    assert seg.read_bytes() == reference_segment(tmp_path / "ref", 2, b"new")  # the torn bytes were cut off
    with Spool(tmp_path / "s") as spool:
        assert [(r.seq, r.value) for r in spool.pending()] == [(0, bytes([0]) * 10), (1, bytes([1]) * 10), (2, b"new")]


@pytest.mark.parametrize("garbage", [
    b"\x01",                                   # a header cut short
    b"\x00\x00\x10\x00partial",                # a length past the end of the file
    b"\x00\x00\x00\x03\xde\xad\xbe\xefabc",    # a whole frame with a wrong CRC
    b"\x00" * 64,                              # zeros, as a filesystem may leave after power loss
])
def test_garbage_tail_is_ignored_then_cut_off(tmp_path, garbage):
    with Spool(tmp_path / "s") as spool:
        fill(spool, 2)
    (seg,) = segments(tmp_path / "s")
    with open(seg, "ab") as f:
        f.write(garbage)
    with Spool(tmp_path / "s") as spool:
        assert seqs(spool) == [0, 1]
        spool.append("t", b"k", b"a", "e-new", 7)
    assert seg.read_bytes() == reference_segment(tmp_path / "ref", 2, b"a")
    with Spool(tmp_path / "s") as spool:
        assert [r.value for r in spool.pending()][-1] == b"a" and spool.depth() == 3


def test_corruption_mid_segment_is_logged_and_skipped(tmp_path, caplog):
    with Spool(tmp_path) as spool:
        fill(spool, 5, size=50)
    (seg,) = segments(tmp_path)
    data = bytearray(seg.read_bytes())
    frame = len(data) // 5
    data[2 * frame + 30] ^= 0xFF  # inside the third record's payload
    seg.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="tabloop.spool"):
        with Spool(tmp_path) as spool:
            assert seqs(spool) == [0, 1] and spool.depth() == 2
            new = spool.append("t", None, b"after", "e", 0)
    assert "corrupt" in caplog.text and str(seg) in caplog.text
    assert len(segments(tmp_path)) == 2  # the damaged segment is kept, not appended to or truncated
    with Spool(tmp_path) as spool:
        assert seqs(spool) == [0, 1, new]


def test_out_of_order_acks(tmp_path):
    with Spool(tmp_path) as spool:
        fill(spool, 10)
        spool.ack([7, 2, 9])
        spool.ack(iter([0]))
        spool.ack([2, 7])
        assert seqs(spool) == [1, 3, 4, 5, 6, 8] and spool.depth() == 6
    with Spool(tmp_path) as spool:
        assert seqs(spool) == [1, 3, 4, 5, 6, 8] and spool.depth() == 6
        spool.ack([8, 6, 5, 4, 3, 1])
        assert spool.pending() == [] and spool.depth() == 0
    with Spool(tmp_path) as spool:
        assert spool.pending() == [] and spool.append("t", None, b"x", "e", 0) == 10


def test_draining_in_batches(tmp_path):
    with Spool(tmp_path) as spool:
        fill(spool, 25)
        spool.ack([3, 4])
        drained, batches = [], 0
        while batch := spool.pending(limit=4):
            drained += [r.seq for r in batch]
            spool.ack([r.seq for r in batch][::-1])
            batches += 1
            if batches == 2:  # arrives mid-drain
                spool.append("t", None, b"late", "late", 0)
        assert drained == [0, 1, 2] + list(range(5, 26)) and spool.depth() == 0


def test_segments_rotate_and_acked_ones_are_deleted(tmp_path):
    with Spool(tmp_path, segment_bytes=400) as spool:
        written = fill(spool, 20, size=100)
        files = segments(tmp_path)
        assert len(files) >= 5
        first = [int(p.stem) for p in files]
        in_first = [s for s in written if s < first[1]]
        spool.ack(reversed(in_first))
        assert files[0] not in segments(tmp_path) and files[1] in segments(tmp_path)
        spool.ack(written)
        assert segments(tmp_path) == [files[-1]] and spool.depth() == 0
        assert sorted(tmp_path.glob("*.ack")) == [files[-1].with_suffix(".ack")]  # acks go with their segment
    with Spool(tmp_path, segment_bytes=400) as spool:
        assert spool.pending() == [] and spool.depth() == 0
        assert spool.append("t", None, b"x", "e", 0) == 20  # seqs stay monotonic after everything was acked


def test_acks_do_not_grow_without_bound(tmp_path):
    with Spool(tmp_path, segment_bytes=2000) as spool:
        for i in range(1500):
            (seq,) = fill(spool, 1, start=i)
            spool.ack([seq])
        assert spool.depth() == 0
        assert len(segments(tmp_path)) == 1
        assert sum(p.stat().st_size for p in tmp_path.iterdir()) < 2 * 2000 + 100


def test_damaged_ack_file_means_republishing_never_losing(tmp_path, caplog):
    with Spool(tmp_path) as spool:
        fill(spool, 6)
        spool.ack([1, 2, 3])
    (ack,) = tmp_path.glob("*.ack")
    data = bytearray(ack.read_bytes())
    data[0] ^= 0xFF  # the first entry (seq 1) no longer checks out
    ack.write_bytes(bytes(data) + b"\x00\x00\x00")  # and a torn entry at the end
    with caplog.at_level(logging.WARNING, logger="tabloop.spool"):
        with Spool(tmp_path) as spool:
            assert seqs(spool) == [0, 1, 4, 5]
            spool.ack([4])
    assert "corrupt entry" in caplog.text
    with Spool(tmp_path) as spool:
        assert seqs(spool) == [0, 1, 5] and spool.depth() == 3


CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from serving.spool import Spool
spool = Spool(Path(sys.argv[2]), segment_bytes=4096)
i = 0
while True:
    seq = spool.append("tabloop.feedback", str(i).encode(), b"v" * 100, f"e{i}", i)
    print("A", seq, flush=True)
    if seq % 3 == 0:
        spool.ack([seq])
        print("K", seq, flush=True)
    i += 1
"""


def test_every_returned_append_survives_kill_9(tmp_path):
    directory = tmp_path / "spool"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(REPO), str(directory)],
                             stdout=subprocess.PIPE, text=True)
    lines = []
    try:
        while len(lines) < 400:
            line = child.stdout.readline()
            assert line, f"the child died early (rc={child.poll()})"
            lines.append(line)
    finally:
        child.send_signal(signal.SIGKILL)
        rest, _ = child.communicate(timeout=30)
    lines += rest.splitlines(keepends=True)
    done = [line.split() for line in lines if line.endswith("\n")]  # a half-printed line proves nothing
    appended = {int(n) for kind, n in done if kind == "A"}
    acked = {int(n) for kind, n in done if kind == "K"}
    in_flight = max(appended)  # its ack may have landed without being printed
    with Spool(directory, segment_bytes=4096) as spool:
        pending = {r.seq: r for r in spool.pending()}
        assert spool.depth() == len(pending)
    assert not acked & pending.keys()
    missing = {s for s in appended - acked - {in_flight} if s not in pending}
    assert not missing, f"returned appends lost after kill -9: {sorted(missing)[:10]}"
    assert all(r.event_id == f"e{r.timestamp_ms}" and r.value == b"v" * 100 for r in pending.values())


def test_threads_get_unique_seqs_and_lose_nothing(tmp_path):
    with Spool(tmp_path, segment_bytes=2000) as spool:
        results: dict[int, list[int]] = {}

        def work(t: int) -> None:
            mine = [spool.append("t", None, f"{t}-{i}".encode(), f"{t}-{i}", i) for i in range(60)]
            spool.ack(mine[::2])
            results[t] = mine

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        every = [s for mine in results.values() for s in mine]
        assert len(every) == len(set(every)) == 480 and set(every) == set(range(480))
        kept = {s for mine in results.values() for s in mine[1::2]}
        pending = spool.pending()
        assert {r.seq for r in pending} == kept and spool.depth() == 240
        assert [r.seq for r in pending] == sorted(kept)
    with Spool(tmp_path, segment_bytes=2000) as spool:
        assert {r.value.decode() for r in spool.pending()} == {f"{t}-{i}" for t in range(8) for i in range(1, 60, 2)}
