"""The join's state in the worker's one Faust table, and the rules of ``streams.join`` applied to it.

The worker (``streams.app``) hands each of a partition's records to ``JoinState``; every rule is decided
inside that partition (one project and user). One table, ``join-state``, three kinds of keys: a prompt's (or
reuse key's) waiting feedback (``prompt_state_key``); a completion's episode state (``completion_state_key``:
the joiner's open completion, closed mark, early feedback and seen decisions, and what the matchers keep of
it: the prompts' candidates are an index in memory over these, ``CandidateIndex``); unmatched feedback's
identity (a completion key too). Each is written only while its home partition is processed, so one
transactional producer owns each key. What time alone changes is found through ``ExpiryIndex``.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from contextlib import contextmanager
from typing import Awaitable, Callable, Iterator

import faust

from schemas.events import Event
from streams.join import REUSE_MARK, EpisodeJoiner, JoinConfig, PromptMatcher, millis, reuse_key
from rewards.spec import RewardSpecs


class ExpiryIndex:
    """When each table key next needs looking at, per partition, so a tick touches only keys that are due.

    Lives in memory only: after a start or a rebalance the first tick of a partition rebuilds it from
    the (restored) table.
    """

    def __init__(self) -> None:
        self.heaps: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
        self.due: dict[bytes, int] = {}
        self.built: set[int] = set()

    def schedule(self, partition: int, key: bytes, deadline: int | None) -> None:
        if deadline is None:
            self.due.pop(key, None)
        elif self.due.get(key) != deadline:
            self.due[key] = deadline
            heapq.heappush(self.heaps[partition], (deadline, key))

    def pop_due(self, partition: int, now: int) -> list[bytes]:
        heap, out = self.heaps[partition], []
        while heap and heap[0][0] <= now:
            deadline, key = heapq.heappop(heap)
            if self.due.get(key) == deadline:  # else superseded by a later schedule()
                del self.due[key]
                out.append(key)
        return out

    def reset(self) -> None:
        self.heaps.clear()
        self.due.clear()
        self.built.clear()


class CandidateIndex:
    """Which completions each prompt (and reuse) key may match: derived from the completions' table entries
    (their ``cands``), kept in memory only, so a completion costs one state write, not one per key as well.
    Rebuilt from the table after an assignment; a completion leaves it when its entry is deleted (stale
    ones in between are out of every window: the matcher passes them over)."""

    def __init__(self) -> None:
        self.by_key: dict[tuple, dict[str, dict]] = defaultdict(dict)
        self.built = False

    def add(self, cid: str, cands: list | None) -> None:
        for key, candidate in cands or ():
            self.by_key[tuple(key)][cid] = candidate

    def remove(self, cid: str, cands: list | None) -> None:
        for key, _ in cands or ():
            found = self.by_key.get(tuple(key))
            if found is not None:
                found.pop(cid, None)
                if not found:
                    del self.by_key[tuple(key)]

    def of(self, key: tuple) -> dict[str, dict]:
        return self.by_key.get(key, {})

    def build(self, entries) -> None:
        for skey, entry in entries:
            if entry.get("cands") and skey.startswith(b"c\x1f"):
                self.add(skey.decode()[2:], entry["cands"])
        self.built = True

    def reset(self) -> None:
        self.by_key.clear()
        self.built = False


def prompt_deadline(state: dict, config: JoinConfig) -> int | None:
    """When a prompt key's state next changes by time alone: a wait ends or a candidate leaves the window."""
    times = [fb["received_at"] + config.max_lateness_ms for fb in state.get("waiting", [])]
    times += [c["served_at"] + config.match_window_ms + config.max_lateness_ms + 1
              for c in state.get("candidates", [])]
    return min(times) if times else None


def completion_deadline(state: dict, config: JoinConfig) -> int | None:
    """When a completion key's state next changes by time alone: its TTL, an early feedback's wait, or
    (closed) when it is forgotten."""
    if state.get("closed"):
        return state.get("served_at", 0) + 2 * config.completion_ttl_ms + 1
    times = [fb["received_at"] + config.max_lateness_ms for fb in state.get("early", [])]
    if state.get("completion"):
        times.append(state["completion"]["served_at"] + config.completion_ttl_ms)
    return min(times) if times else None


def prompt_state_key(key: tuple) -> bytes:
    return ("p\x1f" + "\x1f".join(key)).encode()


def is_prompt_state_key(skey: bytes) -> bool:
    return skey.startswith(b"p\x1f")


def prompt_tuple(skey: bytes, legacy: bool = False) -> tuple:
    """A prompt key from its state key (or, ``legacy``, from an old stage's key: no kind mark)."""
    return tuple(skey.decode().split("\x1f")[0 if legacy else 1:])


def completion_state_key(cid: str) -> bytes:
    return ("c\x1f" + cid).encode()


def completion_of_state_key(skey: bytes) -> str:
    return skey.decode()[2:]


def _prompt_tuple_of(record: dict) -> tuple:
    return (record["project_id"], record["user_id"], record["prompt_sha256"])


def _identity(fb: dict) -> str:
    """The key of unmatched feedback: the IDE's id for it when there is one, so a repeat dedupes."""
    ident = fb.get("client_completion_id")
    return f"fb:{fb['project_id']}/{ident}" if ident else f"fb:{fb['event_id']}"


class JoinState:
    """The join of one partition's completions and feedback, its state kept in the ``join-state`` table.

    A prompt key's state: the feedback waiting for a completion of that prompt; a completion key's: the
    joiner's open completion, closed mark, early feedback and seen decisions. The matchers and joiners of
    ``streams.join`` are made from an entry, given one record and written back; the episodes they give
    go to ``emit`` (the worker: published, or scored first).
    """

    def __init__(self, table: faust.Table, specs: RewardSpecs, config: JoinConfig, counts: Counter,
                 emit: Callable[[Event], Awaitable[None]]) -> None:
        self.table, self.specs, self.config, self.counts, self.emit = table, specs, config, counts, emit
        self.due = ExpiryIndex()
        self.candidates = CandidateIndex()
        # Keys a move of an old worker's stages wrote (``streams.legacy``), and until when (wall ms) time alone
        # may not close them: what the old stages held comes over from several partitions in no set order (a
        # completion's state, its feedback on an old stage's topic) and is old beside this partition's event
        # time; without the hold, feedback would close as unmatched in the moment before its completion's
        # state arrived. In memory: the move is over in seconds.
        self.held: dict[bytes, float] = {}
        self._holding_until: float | None = None  # the hold's end while a moved record or entry is taken over

    def reset(self) -> None:
        """After an assignment: both indexes are rebuilt from the tables as restored."""
        self.due.reset()
        self.candidates.reset()

    def index_candidates(self) -> None:
        if not self.candidates.built:  # after an assignment: from the completions' entries the tables restored
            self.candidates.build(self.table.items())

    @contextmanager
    def holding(self, until_wall_ms: float) -> Iterator[None]:
        """Every key written meanwhile is held (``held``) until ``until_wall_ms``."""
        self._holding_until = until_wall_ms
        try:
            yield
        finally:
            self._holding_until = None

    def hold(self, skey: bytes) -> None:
        if self._holding_until is not None:
            self.held[skey] = max(self.held.get(skey, 0.0), self._holding_until)

    # -- an entry in, a matcher or joiner out, and back -----------------------------------------------------

    def matcher_for(self, key: tuple) -> PromptMatcher:
        """The matcher of a prompt (or reuse) key: its candidates are the completions' (``candidates``, in
        memory) and any its entry keeps (moved from an old stage); its waiting feedback is the entry's."""
        entry = self.table[prompt_state_key(key)]
        kept = entry.get("candidates", [])
        known = {c["completion_id"] for c in kept}
        indexed = [c for cid, c in self.candidates.of(key).items() if cid not in known]
        return PromptMatcher(self.config, candidates={key: kept + indexed}, waiting={key: entry.get("waiting", [])},
                             stream_time=entry.get("t", 0), reuse=key[2].startswith(REUSE_MARK))

    def save_matcher(self, key: tuple, m: PromptMatcher, partition: int, also_keep: set = frozenset()) -> None:
        """Write a prompt key's waiting feedback, and the candidates its entry keeps (old stages'; the
        completions' own are in ``candidates``) with ``also_keep`` among them."""
        skey = prompt_state_key(key)
        kept = {c["completion_id"] for c in self.table[skey].get("candidates", [])} | also_keep
        kept_candidates = [c for c in m.candidates.get(key, []) if c["completion_id"] in kept]
        waiting = m.waiting.get(key, [])
        if kept_candidates or waiting:
            entry = {"candidates": kept_candidates, "waiting": waiting, "t": m.stream_time, "p": partition}
            self.table[skey] = entry
            self.hold(skey)
            self.due.schedule(partition, skey, prompt_deadline(entry, self.config))
        elif skey in self.table:
            del self.table[skey]
            self.due.schedule(partition, skey, None)

    def joiner_for(self, cid: str) -> EpisodeJoiner:
        return self.joiner_from(self.table[completion_state_key(cid)], cid)

    def joiner_from(self, entry: dict, cid: str) -> EpisodeJoiner:
        j = EpisodeJoiner(self.specs, self.config, counts=self.counts, stream_time=entry.get("t", 0))
        if entry.get("completion") and not entry.get("closed"):
            j.open[entry["completion"]["completion_id"]] = entry["completion"]
        if entry.get("closed"):
            j.closed[cid] = entry.get("served_at", 0)
        if entry.get("early"):
            j.early[cid] = list(entry["early"])
        j.seen_feedback = dict(entry.get("seen", {}))
        return j

    def save_joiner(self, cid: str, j: EpisodeJoiner, partition: int, cands: list | None = None) -> None:
        """Write a completion key's state; ``cands`` (the completion as a candidate of its prompt and reuse
        keys) once, when it comes: kept in its entry, open or closed, so ``candidates`` can be rebuilt."""
        skey = completion_state_key(cid)
        entry = {"t": j.stream_time, "seen": j.seen_feedback, "p": partition}
        if cands := cands or self.table[skey].get("cands"):
            entry["cands"] = cands
        if cid in j.open:
            entry["completion"] = j.open[cid]
        elif cid in j.closed:
            entry["closed"] = True
            entry["served_at"] = j.closed[cid]
        if j.early.get(cid):
            entry["early"] = j.early[cid]
        self.table[skey] = entry
        self.hold(skey)
        self.due.schedule(partition, skey, completion_deadline(entry, self.config))

    def cands_of(self, rec: dict) -> list:
        """[key, candidate] of a completion for its prompt key and (a FIM prompt) its reuse key: what each
        matcher keeps of it (``PromptMatcher.on_completion`` decides)."""
        out = []
        for reuse in (False, True):
            m = PromptMatcher(self.config, reuse=reuse)
            if reuse and reuse_key(rec) is None:
                continue
            m.on_completion(rec)
            (key, [candidate]), = m.candidates.items()
            out.append([list(key), candidate])
        return out

    # -- a record of the partition ---------------------------------------------------------------------------

    async def on_completion(self, rec: dict, partition: int) -> None:
        cid = rec["completion_id"]
        j = self.joiner_for(cid)
        episodes = j.on_completion(rec)
        cands = self.cands_of(rec)
        self.save_joiner(cid, j, partition, cands)
        self.candidates.add(cid, cands)
        for ep in episodes:
            await self.emit(ep)
        for k, _ in cands:
            await self.match_completion(tuple(k), rec, partition)

    async def on_feedback(self, fb: dict, partition: int) -> None:
        if fb.get("completion_id") is None and fb.get("prompt_sha256") is None:
            self.counts["no_code"] += 1  # level: noCode — analytics only, never trained on
        elif fb.get("cache_hit"):
            await self.join_unmatched(fb, "cache_hits", partition)
        elif fb.get("completion_id"):
            # Our id, from the same project and user (the key): feedback naming a completion served to
            # someone else lands on that one's partition only by chance, waits there in vain, and closes
            # as unmatched: one user's decision never labels another's completion.
            await self.join_feedback(fb["completion_id"], fb, partition)
        else:
            await self.match_feedback(_prompt_tuple_of(fb), fb, partition)

    async def join_feedback(self, cid: str, fb: dict, partition: int) -> None:
        j = self.joiner_for(cid)
        ep = j.on_feedback(cid, fb)
        self.save_joiner(cid, j, partition)
        if ep is not None:
            await self.emit(ep)

    async def join_unmatched(self, fb: dict, why: str, partition: int) -> None:
        """Feedback no completion of ours matched (or a cache hit), under its identity: repeats dedupe."""
        ident = _identity(fb)
        j = self.joiner_for(ident)
        ep = j.unmatched(fb, why)
        j.closed[ident] = millis(fb["received_at"])
        self.save_joiner(ident, j, partition)
        if ep is not None:
            await self.emit(ep)

    async def match_completion(self, key: tuple, rec: dict, partition: int) -> None:
        """A completion as a candidate of a prompt (or reuse) key: feedback that waited for it joins.
        Nothing waiting (the usual case): nothing to write, the candidate is in ``candidates`` already."""
        if not self.table[prompt_state_key(key)].get("waiting"):
            return
        m = self.matcher_for(key)
        resolved = m.on_completion(rec)
        self.save_matcher(key, m, partition)
        for cid, fb in resolved:
            await self.join_feedback(cid, fb, partition)

    async def match_feedback(self, key: tuple, fb: dict, partition: int) -> None:
        m = self.matcher_for(key)
        match = m.on_feedback(fb)
        if match is None:  # it waits (a match changes nothing here that is kept: no write)
            self.save_matcher(key, m, partition)
        else:
            await self.join_feedback(*match, partition)

    # -- time -------------------------------------------------------------------------------------------------

    async def expire_due(self, partition: int, now: int, wall_ms: float) -> None:
        """Close what time has closed among this partition's keys, at event time ``now`` (a table write is
        logged to the partition being processed: the tick's)."""
        if partition not in self.due.built:
            for skey, entry in self.table.items():
                if entry.get("p") == partition:
                    self.due.schedule(partition, skey, (prompt_deadline if is_prompt_state_key(skey)
                                                        else completion_deadline)(entry, self.config))
            self.due.built.add(partition)
        for skey in self.due.pop_due(partition, now):
            if self.held.get(skey, 0) > wall_ms:
                self.due.schedule(partition, skey, now + 1)  # moved moments ago: looked at again on a later tick
            elif skey in self.table:
                self.held.pop(skey, None)
                expire = self.expire_prompt if is_prompt_state_key(skey) else self.expire_completion
                await expire(skey, partition, now)

    async def expire_prompt(self, skey: bytes, partition: int, now: int) -> None:
        key = prompt_tuple(skey)
        m = self.matcher_for(key)
        m.stream_time = max(m.stream_time, now)
        gone = m.expire()
        self.save_matcher(key, m, partition)
        for fb in gone:
            if not m.reuse and (reuse := reuse_key(fb)) is not None:
                # No completion had its prompt: one more try, as feedback on a reused suggestion.
                await self.match_feedback(reuse, fb, partition)
            else:
                await self.join_unmatched(fb, "unmatched", partition)

    async def expire_completion(self, skey: bytes, partition: int, now: int) -> None:
        entry, cid = self.table[skey], completion_of_state_key(skey)
        if entry.get("closed"):
            if entry.get("served_at", now) < now - 2 * self.config.completion_ttl_ms:
                self.candidates.remove(cid, entry.get("cands"))
                del self.table[skey]
            else:
                self.due.schedule(partition, skey, completion_deadline(entry, self.config))
            return
        j = self.joiner_from(entry, cid)
        j.stream_time = max(j.stream_time, now)
        episodes = j.expire()
        self.save_joiner(cid, j, partition)
        for ep in episodes:
            await self.emit(ep)
