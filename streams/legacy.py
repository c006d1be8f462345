"""Moving a pre-issue-32 worker's stages into the one join: once, losing nothing, emitting nothing twice.

That worker re-keyed input to by-prompt / by-completion and kept two tables. What its topics still hold and
what its tables still keep goes to the home partition of its project and user (on the worker's rekeyed
topic, key ``LEGACY_KEY``, JSON), where the join (``streams.join_state``) takes it as its own stages would
have.
"""

from __future__ import annotations

import json
import time

import faust

from schemas.topics import TICK_KEY, home_partition
from streams.join_state import JoinState, completion_state_key, prompt_tuple

LEGACY_STAGES = ("by-prompt", "by-completion")
"""The re-keying topics of the worker before issue 32 (its two stages), drained into the one join."""
LEGACY_HOLD_MIN_MS = 10_000
"""The least time (wall) a key the move wrote waits before time alone may close it (``JoinState.held``)."""
LEGACY_KEY = b"__legacy__"
"""The key of a legacy stage's record or table entry moved to its home partition (on the rekeyed topic)."""


def legacy_user(stage: str, key: bytes, value: dict) -> tuple | None:
    """(project, user) of an old stage's record or table entry; None where it does not say (a closed
    completion's state): that one goes to every partition, and its home keeps it."""
    if stage == "prompt":
        return tuple(key.decode().split("\x1f")[:2])
    record = value.get("record") or value.get("completion") or next(iter(value.get("early") or []), None)
    return None if record is None else (record["project_id"], record["user_id"])


class LegacyMove:
    """The move: ``drain`` sends an old stage's records on (its partition's table entries first), ``take_over``
    takes one of them into the join where it lands."""

    def __init__(self, tables: dict[str, faust.Table], rekeyed: faust.TopicT, join_state: JoinState,
                 partitions: int) -> None:
        self.tables, self.rekeyed, self.join_state, self.partitions = tables, rekeyed, join_state, partitions
        self.counts = join_state.counts
        self.moved: set[int] = set()
        """The partitions whose old table entries went on since the last assignment."""

    # -- out of the old stages ------------------------------------------------------------------------------

    async def send(self, home: int | None, value: dict) -> None:
        body = json.dumps(value).encode()
        for partition in (range(self.partitions) if home is None else (home,)):
            await self.rekeyed.send(key=LEGACY_KEY, value=body, partition=partition)

    def home(self, user: tuple | None) -> int | None:
        return None if user is None else home_partition(f"{user[0]}/{user[1]}".encode(), self.partitions)

    async def move_state_once(self, partition: int) -> None:
        """The old tables' entries of this partition, once after an assignment."""
        if partition not in self.moved:
            await self.move_state(partition)
            self.moved.add(partition)

    async def move_state(self, partition: int) -> None:
        for stage, tbl in self.tables.items():
            for key, entry in [(k, v) for k, v in tbl.items() if v.get("p") == partition]:
                self.counts["legacy_state_moved"] += 1
                await self.send(self.home(legacy_user(stage, key, entry)),
                                {"state": stage, "key": key.decode(), "entry": entry})
                del tbl[key]

    async def drain(self, event) -> None:
        """One record of an old stage's topic, on to its home partition."""
        # The tables before the records: they go the same way, in order.
        await self.move_state_once(event.message.partition)
        if event.key == TICK_KEY:
            return
        value, stage = event.value, event.message.topic.rsplit("-", 1)[-1]
        stage = "prompt" if stage == "prompt" else "completion"
        self.counts["legacy_records_moved"] += 1
        await self.send(self.home(legacy_user(stage, event.key, value)),
                        {"record": stage, "key": event.key.decode(), "value": value})

    # -- into the join ----------------------------------------------------------------------------------------

    async def take_over(self, value: dict, partition: int) -> None:
        """Take over one legacy record or table entry as the old stage it comes from would have."""
        with self.join_state.holding(time.time() * 1000 + max(self.join_state.config.max_lateness_ms,
                                                              LEGACY_HOLD_MIN_MS)):
            key = value["key"]
            if "record" in value:  # a record of an old stage's topic
                await self.take_over_record(value["record"], key, value["value"], partition)
            elif value["state"] == "prompt":
                await self.take_over_prompt_state(key, value["entry"], partition)
            else:  # a completion's state: the old one, then what this partition learned of it meanwhile
                await self.take_over_completion_state(key, value["entry"], partition)

    async def take_over_record(self, stage: str, key: str, value: dict, partition: int) -> None:
        js = self.join_state
        rec, kind = value["record"], value["kind"]
        if stage == "prompt" and kind == "completion":
            # A candidate its completion's state may not carry (a decided one's does not): kept in the
            # prompt's entry, as the old stage kept it, until the window passes it.
            prompt = prompt_tuple(key.encode(), legacy=True)
            m = js.matcher_for(prompt)
            resolved = m.on_completion(rec)
            js.save_matcher(prompt, m, partition, also_keep={rec["completion_id"]})
            for cid, fb in resolved:
                await js.join_feedback(cid, fb, partition)
        elif stage == "prompt":
            await js.match_feedback(prompt_tuple(key.encode(), legacy=True), rec, partition)
        elif kind == "completion":
            await js.on_completion(rec, partition)
        elif kind == "feedback":
            await js.join_feedback(key, rec, partition)
        else:  # unmatched / cache hit
            await js.join_unmatched(rec, value["why"], partition)

    async def take_over_prompt_state(self, key: str, old: dict, partition: int) -> None:
        """Its candidates join this partition's; its waiting feedback is matched now, as if it came."""
        js = self.join_state
        prompt = prompt_tuple(key.encode(), legacy=True)
        m = js.matcher_for(prompt)
        have = {c["completion_id"] for c in m.candidates.get(prompt, [])}
        m.candidates.setdefault(prompt, []).extend(c for c in old.get("candidates", [])
                                                   if c["completion_id"] not in have)
        waiting = {fb["event_id"] for fb in m.waiting.get(prompt, [])}
        matches = [match for fb in old.get("waiting", []) if fb["event_id"] not in waiting
                   and (match := m.on_feedback(fb)) is not None]
        m.stream_time = max(m.stream_time, old.get("t", 0))
        js.save_matcher(prompt, m, partition, also_keep={c["completion_id"] for c in old.get("candidates", [])})
        for cid, fb in matches:
            await js.join_feedback(cid, fb, partition)

    async def take_over_completion_state(self, key: str, old: dict, partition: int) -> None:
        js = self.join_state
        skey = completion_state_key(key)
        if skey in js.table and js.table[skey].get("p") != partition:
            return  # moved to every partition (its user unknown): the first to take it keeps it
        j, new = js.joiner_from(old, key), js.table[skey]
        j.seen_feedback.update(new.get("seen", {}))
        j.stream_time = max(j.stream_time, new.get("t", 0))
        episodes = []
        if new.get("closed") and key not in j.closed:
            j.open.pop(key, None)
            j.closed[key] = new.get("served_at", 0)
        elif new.get("completion"):  # it came here first: now its early feedback, old and new, joins it
            episodes += j.on_completion(new["completion"])
        episodes += [ep for fb in new.get("early", []) if (ep := j.on_feedback(key, fb)) is not None]
        cands = js.cands_of(old["completion"]) if old.get("completion") else None
        js.save_joiner(key, j, partition, cands)
        js.candidates.add(key, cands)
        for ep in episodes:
            await js.emit(ep)
