"""The streams worker's topology, all in one place: topics, table, agents.

    tabloop.completions ─┐  (key: project/user)
    tabloop.feedback ────┼─▶ join ── one partition per project/user: match by id, by prompt, by reuse ─┐
    {app}-rekeyed ───────┘     ▲ (input off its home partition, moved there once; the clock's ticks)  │
                               └──────────────────────────────────────────────────────────────────────┤
                                                                                                     ▼
                  {app}-to-score (specs that weigh judge or tests) ─ score ─▶ tabloop.episodes  (undecodable → deadletter)

The rules live in ``streams.join`` (pure, tested by hand); this module feeds them one partition's records
and keeps their state in one Faust table with a changelog topic, so a restarted worker resumes where it
stopped. Completions and feedback are keyed by project and user (``schemas.events.user_key``), so every
rule is decided where the records land: an episode costs its two inputs, three writes of its completion's
state (open, closed, forgotten) and itself. A worker from before issue 32 re-keyed input through two
stages (``by-prompt``, ``by-completion``) with a table each; what they still hold is moved here once.
Episode ids are derived from what they join, so anything processed twice after a crash produces the same
event ids (consumers deduplicate by event_id).
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import os
import time
from collections import defaultdict
from datetime import datetime, timezone

import faust
from confluent_kafka import Producer

from infra.bus import ensure_topics, make_codec
from infra.settings import Settings
from schemas.codec import EventDecodeError
from schemas.events import Event, new_event, user_key
from schemas.token_ids import packed_text
from schemas.topics import (CATALOG, COMPLETIONS, DEADLETTER, EPISODES, FEEDBACK, TICK_KEY, TOPIC_BY_NAME, Topic,
                            home_partition)
from streams.clock import PartitionClock
from streams.join import REUSE_MARK, EpisodeJoiner, JoinConfig, PromptMatcher, millis, reuse_key
from rewards.spec import RewardSpecs
from rewards.scoring import Scorers, rescored
from streams.upstream import ChangelogWrites, StreamsApp, TransactionalTable, dead_producers, send_raw

log = logging.getLogger("tabloop.streams")
APP_ID = "tabloop-streams"
PRODUCER_CHECK_S = 5.0
EXIT_PRODUCER_DIED = 75  # the worker's exit code when a Kafka producer of its died (see ``dead_producers``)
STOP_GRACE_S = 15.0
"""How long a stop signal gives Faust to stop cleanly (commit, close its clients) before the worker exits
anyway: under the supervisor's 20 s before SIGKILL and Kubernetes' 30 s default."""
EXIT_STOP_TIMEOUT = 143  # 128 + SIGTERM: what a process ended by SIGTERM reports
PRODUCER_LINGER_MS = 50  # see build_app
PRODUCER_MAX_BATCH_BYTES = 512 * 1024


def plain(record: dict) -> dict:
    """A record as JSON-friendly values (datetimes as epoch ms, packed token ids as base64 text: Faust's
    JSON would write the bytes' repr) for internal topics and tables."""
    return {k: millis(v) if isinstance(v, datetime) else packed_text(v) if isinstance(v, bytes) else v
            for k, v in record.items()}


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


def build_app(settings: Settings, specs: RewardSpecs | None = None, config: JoinConfig | None = None,
              *, app_id: str = APP_ID, guarantee: str = "exactly_once", scorers: Scorers | None = None) -> faust.App:
    specs = specs or RewardSpecs.from_settings(settings)
    config = config or JoinConfig.from_settings(settings)
    scorers = scorers or Scorers.from_settings(settings)
    codec = make_codec(settings)
    app = StreamsApp(
        app_id, broker=[f"kafka://{s}" for s in settings.kafka_bootstrap.split(",")], store="memory://",
        processing_guarantee=guarantee, topic_partitions=settings.topic_partitions,
        topic_replication_factor=settings.topic_replication, web_enabled=False, key_serializer="raw",
        value_serializer="json", consumer_auto_offset_reset="earliest", datadir=str(settings.state_dir / "streams"),
        Table=TransactionalTable,
        # Few, full produce requests: writing them is the largest cost of the worker (aiokafka's sender
        # was 28 % of its CPU in a py-spy profile of `tabloop bench pipeline`, most of it socket writes).
        # With exactly-once, each transactional producer (one per source partition) sent a request every
        # two or three events at Faust's 16 KB batches and a 5 ms linger. 50 ms is small beside the commit
        # interval that already bounds each hop's latency (``streams_commit_interval_s``).
        producer_linger_ms=PRODUCER_LINGER_MS, producer_max_batch_size=PRODUCER_MAX_BATCH_BYTES,
        broker_commit_interval=settings.streams_commit_interval_s,
    )
    app.tabloop_processing = processing = asyncio.Lock()
    app.tabloop_changes = changes = ChangelogWrites(app)
    raw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    deadletter_out = app.topic(DEADLETTER.name, **raw)
    # Input found off its home partition (another producer's partitioner, events keyed before issue 32, an
    # old worker's stages) goes on here, to the home partition, as do the clock's ticks.
    rekeyed = app.topic(f"{app_id}-rekeyed", internal=True, **raw)
    join_input = app.topic(COMPLETIONS.name, FEEDBACK.name, rekeyed.get_topic_name(), **raw)
    to_score = app.topic(f"{app_id}-to-score", internal=True, key_serializer="raw", value_serializer="json")
    table = dict(default=dict, partitions=settings.topic_partitions, key_type=bytes)  # values: JSON dicts
    # One table for the join, three kinds of keys (``_prompt_state_key`` and ``_completion_state_key``): a
    # prompt's waiting feedback, a completion's episode state (and what the matchers keep of it: the prompts'
    # candidates are an index in memory over these, ``CandidateIndex``), unmatched feedback's identity.
    state = app.Table("join-state", **table)
    # The two stages' tables of a worker from before issue 32: restored, moved into ``state``, emptied.
    legacy_tables = {"prompt": app.Table("prompt-state", **table), "completion": app.Table("completion-state", **table)}
    legacy_topics = [app.topic(f"{app_id}-{name}", internal=True, key_serializer="raw", value_serializer="json")
                     for name in LEGACY_STAGES]
    due = ExpiryIndex()
    candidates = CandidateIndex()
    app.tabloop_counts = counts = EpisodeJoiner().counts
    # Event time per partition: expiry follows the events, so a worker that lags behind never closes a
    # window early; an idle partition follows the wall clock after ``idle_close_ms``, once it has caught
    # up with what its sources held when assigned (the rules: ``streams.clock``).
    clock = PartitionClock(config.idle_close_ms)
    sources = (COMPLETIONS.name, FEEDBACK.name, rekeyed.get_topic_name())
    legacy_moved: set[int] = set()
    # Keys the move wrote, and until when (wall ms) time alone may not close them: what the old stages held
    # comes over from several partitions in no set order (a completion's state, its feedback on an old stage's
    # topic) and is old beside this partition's event time; without the hold, feedback would close as
    # unmatched in the moment before its completion's state arrived. In memory: the move is over in seconds.
    legacy_hold: dict[bytes, float] = {}
    legacy_taking: list[float] = []  # the hold's end while a moved record or entry is taken over

    @app.on_partitions_assigned.connect
    async def start_partitions_afresh(sender, assigned=(), *args, **kwargs) -> None:
        due.reset()
        candidates.reset()
        legacy_moved.clear()
        for partition in {tp.partition for tp in assigned if tp.topic in sources}:
            clock.assigned(partition)

    def end_of(tp) -> int | None:
        """The partition's end as the consumer last heard it from the broker (None: not known yet; -1, no
        stable offset outside read_committed, counts as 0)."""
        try:
            end = app.consumer.highwater(tp)
        except Exception:  # between assignments: not known
            return None
        return None if end is None else max(end, 0)

    def learn_end_offsets(partition: int, tp) -> None:
        """Where each source of the partition ends now (its fetches have come back: one of its records is
        being processed): the offsets to catch up with. Not all known yet: the next tick asks again."""
        ends = {source: end_of(tp._replace(topic=source)) for source in sources}
        if None in ends.values():
            return
        clock.set_end_offsets(partition, ends)
        log.info("partition %d: idle windows close by the wall clock once its sources are read up to %s, their "
                 "ends now", partition, ends)

    def reading_position(event) -> dict:
        """When a record was read and where its partition ended then: a record behind it means a backlog,
        not an idle partition (``streams.clock``)."""
        return {"wall_ms": time.time() * 1000, "end_offset": end_of(event.message.tp),
                "source": event.message.topic}

    def advance(partition: int, record: dict, field: str) -> None:
        t = millis(record[field]) if record.get(field) is not None else 0
        clock.advance(partition, t, time.time() * 1000)

    async def dead_letter(event, error: Exception) -> None:
        counts["dead_letters"] += 1
        msg = event.message
        dl = new_event("DeadLetter", source_topic=msg.topic, source_partition=msg.partition,
                       source_offset=msg.offset, raw=bytes(msg.value or b""), error=f"{type(error).__name__}: {error}",
                       consumer=app_id)
        await deadletter_out.send(key=dl.key.encode(), value=codec.encode(dl))

    def decoded(event) -> dict | Exception:
        """The record of a completion or feedback event (on the rekeyed topic: either), or why not."""
        try:
            e = codec.decode(event.value)
        except EventDecodeError as exc:
            return exc
        topic = TOPIC_BY_NAME.get(event.message.topic)  # None: the rekeyed topic, which carries either
        expected = topic.event_type if topic else e.type
        if e.type != expected:
            return EventDecodeError(f"{e.type} on a topic of {expected}")
        if e.type not in ("CompletionServed", "FeedbackReceived"):
            return EventDecodeError(f"{e.type} is neither a completion nor feedback")
        return plain(e.record)

    async def emit(episode: Event) -> None:
        """Publish an episode, or first have it scored when its project's spec weighs judge or tests."""
        spec = specs.for_project(episode.record["project_id"])
        if scorers.weighed(spec):  # else nothing to score: no copy of the record, no look at its prompt
            record = plain(episode.record)
            wanted = scorers.wanted(spec, record)
            if wanted:
                counts["to_score"] += 1
                await to_score.send(key=episode.key.encode(), value={"episode": record, "wanted": wanted})
                return
        counts["episodes_out"] += 1
        await send_raw(app, EPISODES.name, episode.key.encode(), codec.encode(episode))

    async def each_event(stream, handle, prepare=None) -> None:
        """Run ``handle`` on every event as one unit: its sends and table writes go out in the
        transaction of its source partition, the event is acked, and no commit cuts into it.

        ``prepare`` (slow work without side effects, such as asking the judge) runs first, outside
        the unit, so that other agents go on meanwhile; its result is handed to ``handle``.
        """
        async for event in stream.events():
            if app.consumer.stale(event.message):  # fetched before a seek: it comes again
                event.ack()
                continue
            prepared = await prepare(event) if prepare is not None else None
            async with processing:
                try:
                    await (handle(event) if prepare is None else handle(event, prepared))
                except Exception as exc:  # a bug or a poison record must not stall the stream
                    log.exception("could not process %s[%d]@%d", event.message.topic, event.message.partition,
                                  event.message.offset)
                    await dead_letter(event, exc)
                if not app.in_transaction:  # at least once: its state changes go before its offset can
                    await changes.send([None])
                event.ack()  # inside the unit: a commit takes its offset together with its effects

    # -- the join: every rule decided inside one partition (one project and user) ---------------------------
    # A prompt key's state: the feedback waiting for a completion of that prompt; a completion key's: the
    # joiner's open completion, closed mark, early feedback and seen decisions. Both live in ``state``,
    # written only while their home partition is processed, so one transactional producer owns each key.

    def matcher_for(key: tuple) -> PromptMatcher:
        """The matcher of a prompt (or reuse) key: its candidates are the completions' (``candidates``, in
        memory) and any its entry keeps (moved from an old stage); its waiting feedback is the entry's."""
        entry = state[_prompt_state_key(key)]
        kept = entry.get("candidates", [])
        known = {c["completion_id"] for c in kept}
        indexed = [c for cid, c in candidates.of(key).items() if cid not in known]
        return PromptMatcher(config, candidates={key: kept + indexed}, waiting={key: entry.get("waiting", [])},
                             stream_time=entry.get("t", 0), reuse=key[2].startswith(REUSE_MARK))

    def save_matcher(key: tuple, m: PromptMatcher, partition: int, also_keep: set = frozenset()) -> None:
        """Write a prompt key's waiting feedback, and the candidates its entry keeps (old stages'; the
        completions' own are in ``candidates``) with ``also_keep`` among them."""
        skey = _prompt_state_key(key)
        kept = {c["completion_id"] for c in state[skey].get("candidates", [])} | also_keep
        kept_candidates = [c for c in m.candidates.get(key, []) if c["completion_id"] in kept]
        waiting = m.waiting.get(key, [])
        if kept_candidates or waiting:
            entry = {"candidates": kept_candidates, "waiting": waiting, "t": m.stream_time, "p": partition}
            state[skey] = entry
            hold(skey)
            due.schedule(partition, skey, prompt_deadline(entry, config))
        elif skey in state:
            del state[skey]
            due.schedule(partition, skey, None)

    def joiner_for(cid: str) -> EpisodeJoiner:
        return joiner_from(state[_completion_state_key(cid)], cid)

    def joiner_from(entry: dict, cid: str) -> EpisodeJoiner:
        j = EpisodeJoiner(specs, config, counts=counts, stream_time=entry.get("t", 0))
        if entry.get("completion") and not entry.get("closed"):
            j.open[entry["completion"]["completion_id"]] = entry["completion"]
        if entry.get("closed"):
            j.closed[cid] = entry.get("served_at", 0)
        if entry.get("early"):
            j.early[cid] = list(entry["early"])
        j.seen_feedback = dict(entry.get("seen", {}))
        return j

    def save_joiner(cid: str, j: EpisodeJoiner, partition: int, cands: list | None = None) -> None:
        """Write a completion key's state; ``cands`` (the completion as a candidate of its prompt and reuse
        keys) once, when it comes: kept in its entry, open or closed, so ``candidates`` can be rebuilt."""
        skey = _completion_state_key(cid)
        entry = {"t": j.stream_time, "seen": j.seen_feedback, "p": partition}
        if cands := cands or state[skey].get("cands"):
            entry["cands"] = cands
        if cid in j.open:
            entry["completion"] = j.open[cid]
        elif cid in j.closed:
            entry["closed"] = True
            entry["served_at"] = j.closed[cid]
        if j.early.get(cid):
            entry["early"] = j.early[cid]
        state[skey] = entry
        hold(skey)
        due.schedule(partition, skey, completion_deadline(entry, config))

    def hold(skey: bytes) -> None:
        if legacy_taking:
            legacy_hold[skey] = max(legacy_hold.get(skey, 0.0), legacy_taking[-1])

    async def join_feedback(cid: str, fb: dict, partition: int) -> None:
        j = joiner_for(cid)
        ep = j.on_feedback(cid, fb)
        save_joiner(cid, j, partition)
        if ep is not None:
            await emit(ep)

    async def join_unmatched(fb: dict, why: str, partition: int) -> None:
        """Feedback no completion of ours matched (or a cache hit), under its identity: repeats dedupe."""
        ident = _identity(fb)
        j = joiner_for(ident)
        ep = j.unmatched(fb, why)
        j.closed[ident] = millis(fb["received_at"])
        save_joiner(ident, j, partition)
        if ep is not None:
            await emit(ep)

    async def match_completion(key: tuple, rec: dict, partition: int) -> None:
        """A completion as a candidate of a prompt (or reuse) key: feedback that waited for it joins.
        Nothing waiting (the usual case): nothing to write, the candidate is in ``candidates`` already."""
        if not state[_prompt_state_key(key)].get("waiting"):
            return
        m = matcher_for(key)
        resolved = m.on_completion(rec)
        save_matcher(key, m, partition)
        for cid, fb in resolved:
            await join_feedback(cid, fb, partition)

    async def match_feedback(key: tuple, fb: dict, partition: int) -> None:
        m = matcher_for(key)
        match = m.on_feedback(fb)
        if match is None:  # it waits (a match changes nothing here that is kept: no write)
            save_matcher(key, m, partition)
        else:
            await join_feedback(*match, partition)

    async def on_completion(rec: dict, partition: int) -> None:
        cid = rec["completion_id"]
        j = joiner_for(cid)
        episodes = j.on_completion(rec)
        cands = cands_of(rec)
        save_joiner(cid, j, partition, cands)
        candidates.add(cid, cands)
        for ep in episodes:
            await emit(ep)
        for k, _ in cands:
            await match_completion(tuple(k), rec, partition)

    async def on_feedback(fb: dict, partition: int) -> None:
        if fb.get("completion_id") is None and fb.get("prompt_sha256") is None:
            counts["no_code"] += 1  # level: noCode — analytics only, never trained on
        elif fb.get("cache_hit"):
            await join_unmatched(fb, "cache_hits", partition)
        elif fb.get("completion_id"):
            # Our id, from the same project and user (the key): feedback naming a completion served to
            # someone else lands on that one's partition only by chance, waits there in vain, and closes
            # as unmatched: one user's decision never labels another's completion.
            await join_feedback(fb["completion_id"], fb, partition)
        else:
            await match_feedback(_prompt_tuple_of(fb), fb, partition)

    async def expire_prompt(skey: bytes, partition: int, now: int) -> None:
        key = _prompt_tuple(skey)
        m = matcher_for(key)
        m.stream_time = max(m.stream_time, now)
        gone = m.expire()
        save_matcher(key, m, partition)
        for fb in gone:
            if not m.reuse and (reuse := reuse_key(fb)) is not None:
                # No completion had its prompt: one more try, as feedback on a reused suggestion.
                await match_feedback(reuse, fb, partition)
            else:
                await join_unmatched(fb, "unmatched", partition)

    async def expire_completion(skey: bytes, partition: int, now: int) -> None:
        entry, cid = state[skey], _completion_of_state_key(skey)
        if entry.get("closed"):
            if entry.get("served_at", now) < now - 2 * config.completion_ttl_ms:
                candidates.remove(cid, entry.get("cands"))
                del state[skey]
            else:
                due.schedule(partition, skey, completion_deadline(entry, config))
            return
        j = joiner_from(entry, cid)
        j.stream_time = max(j.stream_time, now)
        episodes = j.expire()
        save_joiner(cid, j, partition)
        for ep in episodes:
            await emit(ep)

    async def on_tick(partition: int, tick: dict, tp) -> None:
        """Expire the keys of this partition that are due (a table write is logged to the partition being
        processed: the tick's); first, once after an assignment, move a pre-issue-32 worker's state."""
        if partition not in legacy_moved:
            await move_legacy_state(partition)
            legacy_moved.add(partition)
        if not clock.ends_known(partition):
            learn_end_offsets(partition, tp)
        if clock.ends_known(partition) and not clock.caught_up(partition):
            # A source with nothing to read since the assignment (its committed offset at its end: a
            # restart after a quiet spell) gives no record to count: its commit says it was read.
            for source in sources:
                end, committed = clock.end_offset(partition, source), app.consumer.committed_offset(
                    tp._replace(topic=source))
                if committed is not None and end is not None and committed >= end:
                    clock.consumed(partition, committed - 1, source=source)
        if partition not in due.built:
            for skey, entry in state.items():
                if entry.get("p") == partition:
                    due.schedule(partition, skey, (prompt_deadline if _is_prompt_state_key(skey)
                                                   else completion_deadline)(entry, config))
            due.built.add(partition)
        now = clock.now(partition, tick["now"])
        for skey in due.pop_due(partition, now):
            if legacy_hold.get(skey, 0) > tick["now"]:
                due.schedule(partition, skey, now + 1)  # moved moments ago: looked at again on a later tick
            elif skey in state:
                legacy_hold.pop(skey, None)
                await (expire_prompt if _is_prompt_state_key(skey) else expire_completion)(skey, partition, now)

    async def forward(event, partition: int) -> None:
        """Input off its home partition: on to the home partition, as it came (processed there)."""
        counts["rekeyed"] += 1
        await rekeyed.send(key=event.key, value=event.value, partition=partition)

    def cands_of(rec: dict) -> list:
        """[key, candidate] of a completion for its prompt key and (a FIM prompt) its reuse key: what each
        matcher keeps of it (``PromptMatcher.on_completion`` decides)."""
        out = []
        for reuse in (False, True):
            m = PromptMatcher(config, reuse=reuse)
            if reuse and reuse_key(rec) is None:
                continue
            m.on_completion(rec)
            (key, [candidate]), = m.candidates.items()
            out.append([list(key), candidate])
        return out

    async def join_one(event) -> None:
        msg = event.message
        partition = msg.partition
        if not candidates.built:  # after an assignment: from the completions' entries the tables restored
            candidates.build(state.items())
        clock.consumed(partition, msg.offset, **reading_position(event))
        if event.key == TICK_KEY:
            return await on_tick(partition, json.loads(event.value), msg.tp)
        if event.key == LEGACY_KEY:
            return await on_legacy(json.loads(event.value), partition)
        rec = decoded(event)
        if isinstance(rec, Exception):
            return await dead_letter(event, rec)
        home = home_partition(_user_key(rec), settings.topic_partitions)
        if home != partition:
            if msg.topic == rekeyed.get_topic_name():  # a worker with another partition count put it here
                return await dead_letter(event, ValueError(
                    f"rekeyed to partition {partition}, whose home is {home}: do the workers agree on "
                    f"TABLOOP_TOPIC_PARTITIONS ({settings.topic_partitions})?"))
            return await forward(event, home)
        if "served_at" in rec:
            advance(partition, rec, "served_at")
            await on_completion(rec, partition)
        else:
            advance(partition, rec, "received_at")
            await on_feedback(rec, partition)

    @app.agent(join_input)
    async def join(stream):
        await each_event(stream, join_one)

    # -- moving a pre-issue-32 worker's stages: once, losing nothing, emitting nothing twice --------------------
    # That worker re-keyed input to by-prompt / by-completion and kept two tables. What its topics still hold
    # and what its tables still keep goes to the home partition of its project and user, where the join
    # above takes it as its own stages would have (legacy records: key ``LEGACY_KEY``, JSON).

    async def send_legacy(home: int | None, value: dict) -> None:
        body = json.dumps(value).encode()
        for partition in (range(settings.topic_partitions) if home is None else (home,)):
            await rekeyed.send(key=LEGACY_KEY, value=body, partition=partition)

    def legacy_home(user: tuple | None) -> int | None:
        return None if user is None else home_partition(f"{user[0]}/{user[1]}".encode(), settings.topic_partitions)

    async def move_legacy_state(partition: int) -> None:
        for stage, tbl in legacy_tables.items():
            for key, entry in [(k, v) for k, v in tbl.items() if v.get("p") == partition]:
                counts["legacy_state_moved"] += 1
                await send_legacy(legacy_home(_legacy_user(stage, key, entry)),
                                  {"state": stage, "key": key.decode(), "entry": entry})
                del tbl[key]

    async def drain_legacy(event) -> None:
        partition = event.message.partition
        if partition not in legacy_moved:  # the tables before the records: they go the same way, in order
            await move_legacy_state(partition)
            legacy_moved.add(partition)
        if event.key == TICK_KEY:
            return
        value, stage = event.value, event.message.topic.rsplit("-", 1)[-1]
        stage = "prompt" if stage == "prompt" else "completion"
        counts["legacy_records_moved"] += 1
        await send_legacy(legacy_home(_legacy_user(stage, event.key, value)),
                          {"record": stage, "key": event.key.decode(), "value": value})

    for legacy_topic in legacy_topics:
        app.agent(legacy_topic, name=f"drain_{legacy_topic.get_topic_name()}")(
            _draining(each_event, drain_legacy))

    async def on_legacy(value: dict, partition: int) -> None:
        """Take over one legacy record or table entry as the old stage it comes from would have."""
        legacy_taking.append(time.time() * 1000 + max(config.max_lateness_ms, LEGACY_HOLD_MIN_MS))
        try:
            await take_over_legacy(value, partition)
        finally:
            legacy_taking.clear()

    async def take_over_legacy(value: dict, partition: int) -> None:
        key = value["key"]
        if "record" in value:  # a record of an old stage's topic
            rec, kind = value["value"]["record"], value["value"]["kind"]
            if value["record"] == "prompt" and kind == "completion":
                # A candidate its completion's state may not carry (a decided one's does not): kept in the
                # prompt's entry, as the old stage kept it, until the window passes it.
                prompt = _prompt_tuple(key.encode(), legacy=True)
                m = matcher_for(prompt)
                resolved = m.on_completion(rec)
                save_matcher(prompt, m, partition, also_keep={rec["completion_id"]})
                for cid, fb in resolved:
                    await join_feedback(cid, fb, partition)
            elif value["record"] == "prompt":
                await match_feedback(_prompt_tuple(key.encode(), legacy=True), rec, partition)
            elif kind == "completion":
                await on_completion(rec, partition)
            elif kind == "feedback":
                await join_feedback(key, rec, partition)
            else:  # unmatched / cache hit
                await join_unmatched(rec, value["value"]["why"], partition)
        elif value["state"] == "prompt":
            # Its candidates join this partition's; its waiting feedback is matched now, as if it came.
            prompt = _prompt_tuple(key.encode(), legacy=True)
            m, old = matcher_for(prompt), value["entry"]
            have = {c["completion_id"] for c in m.candidates.get(prompt, [])}
            m.candidates.setdefault(prompt, []).extend(c for c in old.get("candidates", [])
                                                       if c["completion_id"] not in have)
            waiting = {fb["event_id"] for fb in m.waiting.get(prompt, [])}
            matches = [match for fb in old.get("waiting", []) if fb["event_id"] not in waiting
                       and (match := m.on_feedback(fb)) is not None]
            m.stream_time = max(m.stream_time, old.get("t", 0))
            save_matcher(prompt, m, partition, also_keep={c["completion_id"] for c in old.get("candidates", [])})
            for cid, fb in matches:
                await join_feedback(cid, fb, partition)
        else:  # a completion's state: the old one, then what this partition learned of it meanwhile
            skey = _completion_state_key(key)
            if skey in state and state[skey].get("p") != partition:
                return  # moved to every partition (its user unknown): the first to take it keeps it
            j, new = joiner_from(value["entry"], key), state[skey]
            j.seen_feedback.update(new.get("seen", {}))
            j.stream_time = max(j.stream_time, new.get("t", 0))
            episodes = []
            if new.get("closed") and key not in j.closed:
                j.open.pop(key, None)
                j.closed[key] = new.get("served_at", 0)
            elif new.get("completion"):  # it came here first: now its early feedback, old and new, joins it
                episodes += j.on_completion(new["completion"])
            episodes += [ep for fb in new.get("early", []) if (ep := j.on_feedback(key, fb)) is not None]
            cands = cands_of(value["entry"]["completion"]) if value["entry"].get("completion") else None
            save_joiner(key, j, partition, cands)
            candidates.add(key, cands)
            for ep in episodes:
                await emit(ep)

    # -- stage C (only for specs that weigh judge or tests): score, then publish ---------------------------

    async def score_one(event) -> tuple[dict, dict]:
        episode, wanted = event.value["episode"], event.value["wanted"]
        return await scorers.score(specs.for_project(episode["project_id"]), episode, wanted)

    async def publish_scored(event, scores: tuple[dict, dict]) -> None:
        episode = event.value["episode"]
        record = rescored(episode, specs.for_project(episode["project_id"]), *scores)
        record["joined_at"] = datetime.fromtimestamp(record["joined_at"] / 1000, timezone.utc)
        for component in scores[1]:
            counts[f"scoring_errors_{component}"] += 1
        counts["episodes_out"] += 1
        scored = Event("Episode", record)
        await send_raw(app, EPISODES.name, scored.key.encode(), codec.encode(scored))

    @app.agent(to_score, concurrency=scorers.concurrency)
    async def score(stream):
        await each_event(stream, publish_scored, prepare=score_one)

    # -- time: a tick into every partition, so expiry happens inside stream processing -------------------
    # Ticks go out through a plain (non-transactional) Kafka producer: a Faust send from a timer would run
    # outside any transaction and fence the exactly-once producers.

    ticker = Producer({"bootstrap.servers": settings.kafka_bootstrap, "linger.ms": 0})

    @app.timer(interval=PRODUCER_CHECK_S)
    async def exit_if_a_producer_died():
        # Exit at once, as a SIGKILL would: what was not committed is processed again by the worker the
        # supervisor starts next, in transactions, so nothing is lost or doubled (the kill drills check it).
        dead = dead_producers(app.producer)
        if dead:
            log.error("Kafka producer(s) %s died (aiokafka's sender routine ended); exiting with code %d for a "
                      "fresh worker to take over", ", ".join(dead), EXIT_PRODUCER_DIED)
            logging.shutdown()
            os._exit(EXIT_PRODUCER_DIED)

    @app.timer(interval=1.0)
    async def tick():
        value = json.dumps({"kind": "tick", "now": int(time.time() * 1000)}).encode()
        for partition in range(settings.topic_partitions):
            ticker.produce(rekeyed.get_topic_name(), value, key=TICK_KEY, partition=partition)
        ticker.poll(0)

    return app


LEGACY_STAGES = ("by-prompt", "by-completion")
"""The re-keying topics of the worker before issue 32 (its two stages), drained into the one join."""
LEGACY_HOLD_MIN_MS = 10_000
"""The least time (wall) a key the move wrote waits before time alone may close it (``legacy_hold``)."""
LEGACY_KEY = b"__legacy__"
"""The key of a legacy stage's record or table entry moved to its home partition (``streams.app``)."""


def _user_key(record: dict) -> bytes:
    return user_key(record).encode()


def _prompt_tuple_of(record: dict) -> tuple:
    return (record["project_id"], record["user_id"], record["prompt_sha256"])


def _prompt_state_key(key: tuple) -> bytes:
    return ("p\x1f" + "\x1f".join(key)).encode()


def _is_prompt_state_key(skey: bytes) -> bool:
    return skey.startswith(b"p\x1f")


def _prompt_tuple(skey: bytes, legacy: bool = False) -> tuple:
    """A prompt key from its state key (or, ``legacy``, from an old stage's key: no kind mark)."""
    return tuple(skey.decode().split("\x1f")[0 if legacy else 1:])


def _completion_state_key(cid: str) -> bytes:
    return ("c\x1f" + cid).encode()


def _completion_of_state_key(skey: bytes) -> str:
    return skey.decode()[2:]


def _identity(fb: dict) -> str:
    """The key of unmatched feedback: the IDE's id for it when there is one, so a repeat dedupes."""
    ident = fb.get("client_completion_id")
    return f"fb:{fb['project_id']}/{ident}" if ident else f"fb:{fb['event_id']}"


def _legacy_user(stage: str, key: bytes, value: dict) -> tuple | None:
    """(project, user) of an old stage's record or table entry; None where it does not say (a closed
    completion's state): that one goes to every partition, and its home keeps it."""
    if stage == "prompt":
        return tuple(key.decode().split("\x1f")[:2])
    record = value.get("record") or value.get("completion") or next(iter(value.get("early") or []), None)
    return None if record is None else (record["project_id"], record["user_id"])


def _draining(each_event, handle):
    async def drain(stream):
        await each_event(stream, handle)
    return drain


def internal_topics(app_id: str = APP_ID) -> tuple[Topic, ...]:
    """The worker's own topics: re-keying, scoring and table changelogs (``{app_id}-{table}-changelog``);
    the stages of a worker from before issue 32 too, while anything may be left on them."""
    repartition = {"cleanup.policy": "delete", "retention.ms": str(7 * 24 * 3600 * 1000)}
    return tuple([Topic(f"{app_id}-{name}", "(internal)", repartition)
                  for name in ("rekeyed", "to-score") + LEGACY_STAGES]
                 + [Topic(f"{app_id}-{table}-changelog", "(internal)", {"cleanup.policy": "compact"})
                    for table in ("join-state", "prompt-state", "completion-state")])


def run_worker(settings: Settings, **kwargs) -> None:
    """`tabloop streams`: run the worker until interrupted.

    Every topic it reads is created first: Faust creates its internal topics itself, but after it
    joins the group, and a topic missing then stays unassigned until the consumer's next metadata
    refresh (five minutes) — a worker that sat idle for its first five minutes.
    """
    ensure_topics(settings, CATALOG + internal_topics(kwargs.get("app_id", APP_ID)))
    app = build_app(settings, **kwargs)
    worker = StoppableWorker(app, loglevel=settings.log_level.lower())
    worker.execute_from_commandline()


class StoppableWorker(faust.Worker):
    """A Faust worker that exits within ``STOP_GRACE_S`` of SIGTERM or SIGINT, Kafka or not.

    With Kafka gone, Faust's stop waits on its clients — the last commit, the transaction's end, the
    producers' flush — and their retries, far past any grace a supervisor gives (issue 14: still running
    45 s after SIGTERM). A forced exit loses nothing: output and offsets are committed together in one
    transaction (or, at least once, offsets after output), so what was not committed is redone by the
    next worker, whose first act fences this one's transactional producers."""

    stop_grace_s = STOP_GRACE_S

    def _schedule_shutdown(self, signal) -> None:
        first = not self._signal_stop_time
        super()._schedule_shutdown(signal)
        if first:
            # A thread, not the event loop: the loop may be stuck in the very waits this guards against.
            import threading

            threading.Thread(target=self._exit_if_still_stopping, name="stop-deadline", daemon=True).start()

    def _exit_if_still_stopping(self) -> None:
        time.sleep(self.stop_grace_s)
        log.error("the worker did not stop within %.0fs of the stop signal (Kafka unreachable?); exiting with "
                  "code %d: nothing committed is lost, the next worker redoes the rest", self.stop_grace_s,
                  EXIT_STOP_TIMEOUT)
        logging.shutdown()
        os._exit(EXIT_STOP_TIMEOUT)
