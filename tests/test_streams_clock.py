"""The streams worker's clock (``streams.clock.PartitionClock``) driven by hand: wall time is passed in.

Each test that main's clock failed also runs against ``MainClosures``, that clock's arithmetic as
``build_app`` kept it in closures at 470a90e, expected to fail (strict xfail): the test is what tells the
two apart (issue 32).
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from streams.clock import PartitionClock
from streams.join import JoinConfig, PromptMatcher

T0 = 1_800_000_000_000
S = 1000
IDLE = 300 * S
LATENESS = 60 * S


class MainClosures:
    """``advance`` / ``now_for`` as main had them (one stage), behind PartitionClock's interface: every
    record resets the idle wait, re-sends included; no caught-up rule; ``now`` can run back."""

    def __init__(self, idle_close_ms: int) -> None:
        self.idle_close_ms = idle_close_ms
        self.clocks: dict[int, tuple[int, float]] = {}

    def assigned(self, partition: int, end_offset: int | None = None) -> None:
        pass  # main had no such rule

    def consumed(self, partition: int, offset: int, **position) -> None:
        pass

    def advance(self, partition: int, event_ms: int, wall_ms: float, *, resent: bool = False) -> None:
        event_time, _ = self.clocks.get(partition, (0, 0.0))
        self.clocks[partition] = (max(event_time, event_ms), wall_ms)

    def now(self, partition: int, wall_ms: float) -> int:
        event_time, last_event_wall = self.clocks.get(partition, (0, 0.0))
        if event_time == 0:
            return wall_ms - self.idle_close_ms
        return event_time + max(0, int(wall_ms - last_event_wall) - self.idle_close_ms)


def fails_on_main(why: str):
    return pytest.param(MainClosures, marks=pytest.mark.xfail(strict=True, reason=f"main's clock: {why}"),
                        id="main")


def live(clock_type=PartitionClock, *partitions: int):
    """A clock whose partitions are assigned and caught up (nothing was there at assignment)."""
    clock = clock_type(IDLE)
    for p in partitions or (0,):
        clock.assigned(p, end_offset=0)
    return clock


@pytest.mark.parametrize("clock_type", [PartitionClock, pytest.param(MainClosures, id="main")])
def test_event_time_moves_forward_only(clock_type):
    clock = live(clock_type)
    clock.advance(0, T0 + 10 * S, wall_ms=T0 + 10 * S)
    clock.advance(0, T0, wall_ms=T0 + 11 * S)  # a late record
    assert clock.now(0, T0 + 12 * S) == T0 + 10 * S
    clock.advance(0, T0 + 20 * S, wall_ms=T0 + 20 * S)
    assert clock.now(0, T0 + 20 * S) == T0 + 20 * S


def test_an_idle_partition_follows_the_wall_clock_after_idle_close():
    clock = live()
    clock.advance(0, T0, wall_ms=T0)
    assert clock.now(0, T0 + IDLE) == T0  # not idle long enough yet
    assert clock.now(0, T0 + IDLE + 7 * S) == T0 + 7 * S


@pytest.mark.parametrize("clock_type", [PartitionClock, fails_on_main("an old record restarts the idle wait")])
def test_an_old_record_does_not_reset_the_idle_wait(clock_type):
    clock = live(clock_type)
    clock.advance(0, T0, wall_ms=T0)
    clock.advance(0, T0 - 10 * S, wall_ms=T0 + 200 * S)  # older than the high-water mark
    clock.advance(0, T0, wall_ms=T0 + 250 * S)  # as old as the mark: no news either
    assert clock.now(0, T0 + 400 * S) == T0 + 100 * S


@pytest.mark.parametrize("clock_type", [PartitionClock, fails_on_main("a straggler restarts the idle wait")])
def test_a_partition_reading_a_backlog_is_busy_not_idle(clock_type):
    """Shuffled input: the newest event comes early, and for longer than idle_close the partition reads
    records older than it with more behind each. Its clock stays at the mark (it is behind, not idle); once
    read up to its end, a straggler is no news and the clock follows the wall again."""
    clock = live(clock_type)
    clock.consumed(0, 0, wall_ms=T0, end_offset=1000)
    clock.advance(0, T0 + 100 * S, wall_ms=T0)  # the high-water mark, first
    for offset in range(1, 999):
        wall = T0 + offset * S  # a record a second, 998 s: more than three idle closes
        clock.consumed(0, offset, wall_ms=wall, end_offset=1000)
        clock.advance(0, T0 + (offset % 90) * S, wall_ms=wall)  # all older than the mark
        assert clock.now(0, wall) == T0 + 100 * S, offset
    clock.consumed(0, 999, wall_ms=T0 + 999 * S, end_offset=1000)  # the last: read up to its end
    clock.advance(0, T0 + 50 * S, wall_ms=T0 + 999 * S)
    clock.consumed(0, 1000, wall_ms=T0 + 1100 * S, end_offset=1001)  # a straggler later: no news
    clock.advance(0, T0 + 60 * S, wall_ms=T0 + 1100 * S)
    # Idle since its last busy read (offset 998, with 999 behind it), not since the straggler.
    assert clock.now(0, T0 + 998 * S + IDLE + 7 * S) == T0 + 100 * S + 7 * S


@pytest.mark.parametrize("clock_type", [PartitionClock, fails_on_main("a re-send restarts the idle wait")])
def test_a_resend_does_not_reset_the_idle_wait_nor_move_event_time(clock_type):
    clock = live(clock_type)
    clock.advance(0, T0, wall_ms=T0)
    # Feedback another partition expired, sent on under its reuse key: its time may be newer than this
    # partition's mark (this one went quiet first), and it is no news of this partition.
    clock.advance(0, T0 + 5 * S, wall_ms=T0 + 200 * S, resent=True)
    assert clock.now(0, T0 + 400 * S) == T0 + 100 * S


@pytest.mark.parametrize("clock_type", [PartitionClock, fails_on_main("now runs back")])
def test_now_never_runs_back(clock_type):
    clock = live(clock_type)
    clock.advance(0, T0, wall_ms=T0)
    assert clock.now(0, T0 + 400 * S) == T0 + 100 * S  # idle: following the wall
    clock.advance(0, T0 + 50 * S, wall_ms=T0 + 401 * S)  # news, but older than the clock's value
    seen = [clock.now(0, T0 + w * S) for w in range(401, 800)]
    assert seen == sorted(seen) and seen[0] >= T0 + 100 * S


@pytest.mark.parametrize("clock_type", [PartitionClock, fails_on_main("the wall clock closes before the backlog "
                                                                      "is read")])
def test_nothing_closes_by_the_wall_clock_before_the_partition_has_caught_up(clock_type):
    clock = clock_type(IDLE)
    clock.assigned(0, end_offset=10)
    wall = T0 + 3600 * S  # restored state, an hour after the worker stopped
    assert clock.now(0, wall) <= T0  # nothing seen: no time at all
    clock.consumed(0, 0)
    clock.advance(0, T0, wall_ms=wall)  # the backlog's first record
    for offset in range(1, 9):
        clock.consumed(0, offset)
        assert clock.now(0, wall + 2 * IDLE) == T0, offset  # event time alone while the backlog is read
    clock.consumed(0, 9)  # the end at assignment: caught up, the idle rule applies again
    assert clock.now(0, wall + 2 * IDLE) == T0 + IDLE


def test_caught_up_needs_the_end_offset_and_restored_state_then_ages_by_the_wall():
    clock = PartitionClock(IDLE)
    clock.assigned(3)
    clock.consumed(3, 41)
    assert not clock.caught_up(3) and clock.now(3, T0) == 0  # end not known yet
    clock.set_end_offset(3, 43)  # a transaction marker at 42: the next record (a tick) passes it
    assert not clock.caught_up(3)
    clock.consumed(3, 43)
    assert clock.caught_up(3)
    assert clock.now(3, T0) == T0 - IDLE  # nothing seen since assignment: restored state ages by the wall
    clock.set_end_offset(3, 100)  # the first end given counts
    assert clock.caught_up(3)
    clock.assigned(3)  # a rebalance: afresh
    assert not clock.caught_up(3) and clock.end_offset(3) is None


def test_a_partition_of_several_sources_has_caught_up_once_each_has():
    """The one join reads partition n of the completions, the feedback and its own topic: caught up when
    every one of them is read up to the end it had, whatever the others' offsets (each counts apart)."""
    clock = PartitionClock(IDLE)
    clock.assigned(2)
    clock.set_end_offsets(2, {"completions": 10, "feedback": 0, "rekeyed": 5})  # feedback: empty
    clock.consumed(2, 9, source="completions")
    assert not clock.caught_up(2)  # the rekeyed topic not yet: offset 9 there would not count
    clock.consumed(2, 3, source="rekeyed")
    assert not clock.caught_up(2) and clock.now(2, T0 + 10 * IDLE) == 0
    clock.consumed(2, 4, source="rekeyed")
    assert clock.caught_up(2)
    clock.set_end_offsets(2, {"completions": 99})  # the first ends given count
    assert clock.caught_up(2) and clock.end_offset(2, "completions") == 10
    clock.assigned(2)
    assert not clock.ends_known(2) and not clock.caught_up(2)


def test_an_empty_partition_is_caught_up_at_once():
    clock = PartitionClock(IDLE)
    clock.assigned(0, end_offset=0)
    assert clock.caught_up(0) and clock.now(0, T0) == T0 - IDLE


def _at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, timezone.utc)


def _feedback(eid: str, prompt_sha256: str, received_ms: int) -> dict:
    return {"event_id": eid, "project_id": "acme", "user_id": "u", "prompt_sha256": prompt_sha256,
            "received_at": _at(received_ms), "completion": "x"}


@pytest.mark.parametrize("clock_type", [PartitionClock, fails_on_main("a re-send landing on a quiet partition "
                                                                      "holds its unmatched feedback another "
                                                                      "idle_close")])
def test_unmatched_feedback_closes_within_idle_close_and_lateness_in_a_quiet_period(clock_type):
    """The prompt stage in a quiet period, as the worker runs it: a matcher per partition, a tick a second.
    Feedback A (partition 0) and B (partition 1) find no completion. A's wait ends first; the worker sends
    it on to partition 1 (as ``expire_prompt`` does under a reuse key), and it must not hold B back: each
    closes within idle_close + lateness (+ a tick) of its partition going idle, A again after its re-send."""
    config = JoinConfig(max_lateness_ms=LATENESS, idle_close_ms=IDLE)
    clock = live(clock_type, 0, 1)
    matchers = {p: PromptMatcher(config) for p in (0, 1)}
    arrivals = {0: [(T0, _feedback("A", "a" * 64, T0), False)],
                1: [(T0 + 30 * S, _feedback("B", "b" * 64, T0 + 30 * S), False)]}
    closed: dict[str, int] = {}
    for wall in range(T0, T0 + 1200 * S, S):
        for p in (0, 1):
            for at, fb, resent in [a for a in arrivals[p] if a[0] == wall]:
                clock.advance(p, int(fb["received_at"].timestamp() * 1000), wall_ms=wall, resent=resent)
                matchers[p].on_feedback(fb)
            m = matchers[p]
            m.stream_time = max(m.stream_time, clock.now(p, wall))
            for fb in m.expire():
                if p == 0:  # no completion had its prompt: one more try, on the other partition
                    arrivals[1].append((wall + S, fb, True))
                else:
                    closed[fb["event_id"]] = wall
    assert closed["B"] <= T0 + 30 * S + IDLE + LATENESS + S
    assert closed["A"] <= T0 + IDLE + LATENESS + 2 * S
