"""The worker's gap bookkeeping (SeekSafeConsumer._add_gap) keeps exactly the intervals Faust's keeps."""

from __future__ import annotations

import asyncio
import random

from intervaltree import IntervalTree

from streams.upstream import SeekSafeConsumer


class _Gaps:
    """Just the state ``_add_gap`` reads and writes."""

    _add_gap = SeekSafeConsumer._add_gap

    def __init__(self, committed):
        self._committed_offset = {"tp": committed}
        self._gap = {"tp": IntervalTree()}


def test_gaps_equal_fausts_add_then_merge_overlaps_for_any_order_and_overlap():
    async def run() -> None:
        rng = random.Random(0)
        for _ in range(300):
            ours, faust = _Gaps(rng.choice([None, 5, 50])), IntervalTree()
            for _ in range(rng.randrange(1, 40)):
                a = rng.randrange(0, 200)
                b = a + rng.randrange(-2, 15)
                await ours._add_gap("tp", a, b)
                committed = ours._committed_offset["tp"]
                start = a if committed is None else max(a, committed + 1)
                if start <= b:  # Faust's _add_gap
                    faust.addi(start, b + 1)
                    faust.merge_overlaps()
                assert sorted(ours._gap["tp"]) == sorted(faust)

    asyncio.run(run())
