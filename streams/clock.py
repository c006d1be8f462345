"""The streams worker's clock: event time per partition of a stage, pure (no Kafka, no Faust).

Windows close on event time, so a worker that lags never closes one early and a replay closes the same
ones. A partition that gets no new events would then never close its last windows, so after
``idle_close_ms`` without news its clock follows the wall clock::

    now = high-water mark + max(0, wall - wall of the last record that moved the mark - idle_close_ms)

Four rules keep that from running late, running back, or running ahead (issue 32):

- **Only news resets the idle wait.** A record no newer than the partition's high-water mark (a
  late event, a replayed backlog) and a re-send of the worker's own (marked ``resent``: its time was
  counted where it came from) move nothing: neither the mark nor the wall time the idle wait counts
  from. On main every record reset it, and each FIM feedback that expired and was re-sent under its
  reuse key restarted the wait of the partition it landed on, costing that partition about
  ``idle_close_ms`` plus the lateness again: minutes before unmatched feedback became an episode in a
  quiet period. (The one join of ``streams.app`` re-sends nothing: it tries the reuse key in place.)
- **Busy is not idle.** A partition read while more records wait behind the one in hand (its end
  offset past it) is working through a backlog, whatever the records' times: the idle wait counts from
  the last such read too. Shuffled input holds many records older than the mark; without this rule a
  backlog read for longer than ``idle_close_ms`` ran the clock ahead of what was still unread and closed
  feedback as unmatched whose completion was a few offsets on (the 10,000-event drill: 103 of them, at
  an idle close of 3 s). A straggler on a partition that is read up to its end is still no news.
- **Never back.** ``now`` never returns less than it returned before for the partition (a record
  newer than the mark but older than an idle clock's value would otherwise pull it back).
- **Caught up first.** After its assignment a partition follows event time alone (the mark) until
  the worker has consumed it (each of its sources: the join reads partition *n* of three topics) up to
  the offset that was its end then (the worker asks its consumer
  for that end on the partition's first tick; any record at or past ``end - 1`` counts, so a
  transaction marker at the end is passed by the next tick; a source with nothing to read, its
  committed offset already at its end, the worker reports as read). Until then the wall clock closes
  nothing: a restarted worker would otherwise close feedback as unmatched while the backlog that
  holds its completion is still unread. A partition with nothing seen yet (state restored from the
  changelog, no backlog) ages by ``wall - idle_close_ms`` as before, once caught up.

Times are epoch milliseconds; the wall time is passed in (the worker's ticks carry it), so tests drive
it by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Partition:
    high_water: int = 0
    """The newest event time seen since assignment (0: none yet)."""
    moved_at_wall: float = 0.0
    """The wall time of the record that last moved ``high_water``."""
    busy_at_wall: float = 0.0
    """The wall time of the last read with more records behind it (a backlog)."""
    end_offsets: dict | None = None
    """Each source's end offset at assignment (None: not known yet). A partition of the join reads several
    topics' partitions of that number (its sources): it has caught up when it has caught up with each."""
    consumed: dict = field(default_factory=dict)
    """The highest offset consumed since assignment, per source."""
    caught_up: bool = False
    returned: int = 0
    """The largest ``now`` returned: never less after it."""


class PartitionClock:
    """Event time per partition of one stage, with the idle, busy, never-back and caught-up rules above."""

    def __init__(self, idle_close_ms: int) -> None:
        self.idle_close_ms = idle_close_ms
        self.partitions: dict[int, _Partition] = {}

    def _of(self, partition: int) -> _Partition:
        # A partition never announced is treated as just assigned with its end not known yet.
        return self.partitions.setdefault(partition, _Partition())

    def assigned(self, partition: int, end_offset: int | None = None) -> None:
        """The partition was (re)assigned: start afresh, and wait for the end offset (given here or later
        by ``set_end_offset``) before the wall clock may move it."""
        self.partitions[partition] = _Partition()
        if end_offset is not None:
            self.set_end_offset(partition, end_offset)

    def ends_known(self, partition: int) -> bool:
        return self._of(partition).end_offsets is not None

    def end_offset(self, partition: int, source=None) -> int | None:
        ends = self._of(partition).end_offsets
        return None if ends is None else ends.get(source)

    def set_end_offset(self, partition: int, end_offset: int, source=None) -> None:
        """What the partition's end was at its assignment (the first value given counts)."""
        self.set_end_offsets(partition, {source: end_offset})

    def set_end_offsets(self, partition: int, ends: dict) -> None:
        """The ends of all the partition's sources at once (source -> end offset; the first ends given
        count): caught up once each source is read up to its end."""
        p = self._of(partition)
        if p.end_offsets is None:
            p.end_offsets = dict(ends)
            self._check_caught_up(p)

    def consumed(self, partition: int, offset: int, *, wall_ms: float | None = None,
                 end_offset: int | None = None, source=None) -> None:
        """A record at ``offset`` of ``source`` was consumed (any record, ticks too), at ``wall_ms`` with
        the source's end then at ``end_offset`` (as far as the consumer knows; None: not known): a record
        behind it makes the partition busy."""
        p = self._of(partition)
        p.consumed[source] = max(p.consumed.get(source, -1), offset)
        self._check_caught_up(p)
        if wall_ms is not None and end_offset is not None and end_offset > offset + 1:
            p.busy_at_wall = max(p.busy_at_wall, wall_ms)

    @staticmethod
    def _check_caught_up(p: _Partition) -> None:
        if not p.caught_up and p.end_offsets is not None and all(
                p.consumed.get(source, -1) + 1 >= end for source, end in p.end_offsets.items()):
            p.caught_up = True

    def caught_up(self, partition: int) -> bool:
        return self._of(partition).caught_up

    def advance(self, partition: int, event_ms: int, wall_ms: float, *, resent: bool = False) -> None:
        """A record with event time ``event_ms`` arrived at ``wall_ms``. Only one newer than the mark, and
        not a re-send of the worker's own, moves the mark and restarts the idle wait."""
        p = self._of(partition)
        if resent or event_ms <= p.high_water:
            return
        p.high_water, p.moved_at_wall = event_ms, wall_ms

    def now(self, partition: int, wall_ms: float) -> int:
        """The partition's stream time at ``wall_ms``: what windows close against."""
        p = self._of(partition)
        if not p.caught_up:
            t = p.high_water
        elif p.high_water == 0:  # nothing seen since assignment: state restored from the changelog ages by the wall
            t = int(wall_ms) - self.idle_close_ms
        else:
            quiet_since = max(p.moved_at_wall, p.busy_at_wall)
            t = p.high_water + max(0, int(wall_ms - quiet_since) - self.idle_close_ms)
        p.returned = max(p.returned, t)
        return p.returned
