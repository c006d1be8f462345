"""The streams worker's topology, all in one place: topics, tables, agents.

    tabloop.completions ─┐            ┌─▶ by-prompt (key: project/user/prompt hash) ─ match ─┐
                         ├─ route ────┤                                                       ▼
    tabloop.feedback ────┘            └─▶ by-completion (key: completion id) ◀────────────────┘
                                                     │ join (one episode per completion)
                                                     ▼
                                               tabloop.episodes          (undecodable input → tabloop.deadletter)

The rules live in ``streams.join`` (pure, tested by hand); this module moves
records between partitions and keeps each stage's state in a Faust table with
a changelog topic, so a restarted worker resumes where it stopped. Episode ids
are derived from what they join, so anything processed twice after a crash
produces the same event ids (consumers deduplicate by event_id).
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
from schemas.events import Event, new_event
from schemas.token_ids import packed_text
from schemas.topics import CATALOG, COMPLETIONS, DEADLETTER, EPISODES, FEEDBACK, TICK_KEY, Topic
from streams.clock import PartitionClock
from streams.join import REUSE_MARK, EpisodeJoiner, JoinConfig, PromptMatcher, millis, reuse_key
from streams.rewards import RewardSpecs
from streams.scoring import Scorers, rescored
from streams.upstream import StreamsApp, TransactionalTable, dead_producers

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
    app.tabloop_pending = pending = []
    raw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    completions_in = app.topic(COMPLETIONS.name, **raw)
    feedback_in = app.topic(FEEDBACK.name, **raw)
    episodes_out = app.topic(EPISODES.name, **raw)
    deadletter_out = app.topic(DEADLETTER.name, **raw)
    by_prompt = app.topic(f"{app_id}-by-prompt", internal=True, key_serializer="raw", value_serializer="json")
    by_completion = app.topic(f"{app_id}-by-completion", internal=True, key_serializer="raw",
                              value_serializer="json")
    to_score = app.topic(f"{app_id}-to-score", internal=True, key_serializer="raw", value_serializer="json")
    table = dict(default=dict, partitions=settings.topic_partitions, key_type=bytes)  # values: JSON dicts
    prompt_state = app.Table("prompt-state", **table)
    completion_state = app.Table("completion-state", **table)
    due = {"prompt": ExpiryIndex(), "completion": ExpiryIndex()}
    app.tabloop_counts = counts = EpisodeJoiner().counts
    # Event time per partition of each stage: expiry follows the events, so a worker that lags behind
    # never closes a window early; an idle partition follows the wall clock after ``idle_close_ms``, once
    # it has caught up with what it held when assigned (the rules: ``streams.clock``).
    clocks = {"prompt": PartitionClock(config.idle_close_ms), "completion": PartitionClock(config.idle_close_ms)}
    stage_of_topic = {by_prompt.get_topic_name(): "prompt", by_completion.get_topic_name(): "completion"}

    @app.on_partitions_assigned.connect
    async def start_partitions_afresh(sender, assigned=(), *args, **kwargs) -> None:
        for index in due.values():
            index.reset()
        for tp in assigned:
            if tp.topic in stage_of_topic:
                clocks[stage_of_topic[tp.topic]].assigned(tp.partition)

    def learn_end_offset(clock: PartitionClock, tp) -> None:
        """The partition's end as the consumer last heard it from the broker (a fetch of this partition
        has come back, since one of its records is being processed): the offset to catch up with."""
        try:
            end = app.consumer.highwater(tp)
        except Exception:  # not known yet (a consumer between assignments): the next tick asks again
            log.debug("no end offset for %s yet", tp, exc_info=True)
            return
        if end is not None:  # -1 (no stable offset outside read_committed): nothing to wait for
            clock.set_end_offset(tp.partition, max(end, 0))
            log.info("%s[%d]: idle windows close by the wall clock once it is read up to offset %d, its end now",
                     tp.topic, tp.partition, max(end, 0))

    def reading_position(event) -> dict:
        """When a record was read and where its partition ended then (the consumer's last word on it): a
        record behind it means a backlog, not an idle partition (``streams.clock``)."""
        try:
            end = app.consumer.highwater(event.message.tp)
        except Exception:  # between assignments: not known
            end = None
        return {"wall_ms": time.time() * 1000, "end_offset": end}

    def advance(stage: str, event, record: dict, field: str) -> None:
        t = millis(record[field]) if record.get(field) is not None else 0
        clocks[stage].advance(event.message.partition, t, time.time() * 1000,
                              resent=bool(event.value.get("resent")))

    async def dead_letter(event, error: Exception) -> None:
        counts["dead_letters"] += 1
        msg = event.message
        dl = new_event("DeadLetter", source_topic=msg.topic, source_partition=msg.partition,
                       source_offset=msg.offset, raw=bytes(msg.value or b""), error=f"{type(error).__name__}: {error}",
                       consumer=app_id)
        await deadletter_out.send(key=dl.key.encode(), value=codec.encode(dl))

    def decoded(event, expected: str) -> dict | None:
        try:
            e = codec.decode(event.value)
        except EventDecodeError as exc:
            return exc
        if e.type != expected:
            return EventDecodeError(f"{e.type} on a topic of {expected}")
        return plain(e.record)

    async def emit(episode: Event) -> None:
        """Publish an episode, or first have it scored when its project's spec weighs judge or tests."""
        record = plain(episode.record)
        wanted = scorers.wanted(specs.for_project(record["project_id"]), record)
        if wanted:
            counts["to_score"] += 1
            await to_score.send(key=episode.key.encode(), value={"episode": record, "wanted": wanted})
            return
        counts["episodes_out"] += 1
        await episodes_out.send(key=episode.key.encode(), value=codec.encode(episode))

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
                for tbl, partition, key, value, value_serializer in pending:
                    await tbl.changelog_topic.send(key=key, value=value, partition=partition,
                                                   key_serializer=tbl.key_serializer,
                                                   value_serializer=value_serializer or tbl.value_serializer)
                pending.clear()
                event.ack()  # inside the unit: a commit takes its offset together with its effects

    # -- routing: decode, check, re-key ---------------------------------------------------------

    async def route_completion(event) -> None:
        rec = decoded(event, "CompletionServed")
        if isinstance(rec, Exception):
            return await dead_letter(event, rec)
        await by_completion.send(key=rec["completion_id"].encode(), value={"kind": "completion", "record": rec})
        # The matcher needs only who, when and what text: not the token ids and logprobs.
        await by_prompt.send(key=_prompt_key(rec), value={"kind": "completion", "record": {
            k: rec[k] for k in ("completion_id", "served_at", "completion_text", "project_id", "user_id",
                                "prompt_sha256")}})
        if (reuse := reuse_key(rec)) is not None:  # a candidate for feedback on a reused suggestion
            await by_prompt.send(key=_key_bytes(reuse), value={"kind": "completion", "record": {
                k: rec[k] for k in ("completion_id", "served_at", "completion_text", "project_id", "user_id",
                                    "prefix", "suffix", "filepath")}})

    async def route_one_feedback(event) -> None:
        fb = decoded(event, "FeedbackReceived")
        if isinstance(fb, Exception):
            return await dead_letter(event, fb)
        if fb.get("completion_id") is None and fb.get("prompt_sha256") is None:
            counts["no_code"] += 1  # level: noCode — analytics only, never trained on
        elif fb.get("cache_hit"):
            await by_completion.send(key=_identity_key(fb), value={"kind": "unmatched", "record": fb,
                                                                   "why": "cache_hits"})
        elif fb.get("completion_id"):
            await by_completion.send(key=fb["completion_id"].encode(), value={"kind": "feedback", "record": fb})
        else:
            await by_prompt.send(key=_prompt_key(fb), value={"kind": "feedback", "record": fb})

    @app.agent(completions_in)
    async def route_completions(stream):
        await each_event(stream, route_completion)

    @app.agent(feedback_in)
    async def route_feedback(stream):
        await each_event(stream, route_one_feedback)

    def time_field(value: dict) -> str:
        return "served_at" if value["kind"] == "completion" else "received_at"

    async def on_tick(stage: str, state_table, event, expire_key) -> None:
        """Expire the keys of this partition that are due (the tick's partition: a table write is
        logged to the partition being processed)."""
        partition, clock = event.message.partition, clocks[stage]
        if clock.end_offset(partition) is None:
            learn_end_offset(clock, event.message.tp)
        index = due[stage]
        if partition not in index.built:
            deadline_of = prompt_deadline if stage == "prompt" else completion_deadline
            for key, state in state_table.items():
                if state.get("p") == partition:
                    index.schedule(partition, key, deadline_of(state, config))
            index.built.add(partition)
        now = clock.now(partition, event.value["now"])
        for key in index.pop_due(partition, now):
            if key in state_table:
                await expire_key(key, partition, now)

    # -- stage A: match feedback without our id to a completion --------------------------------------

    def matcher_for(key) -> PromptMatcher:
        """The matcher for one prompt key, from its table entry (the key is the matcher's own key)."""
        state, k = prompt_state[key], _prompt_tuple(key)
        return PromptMatcher(config, candidates={k: state.get("candidates", [])},
                             waiting={k: state.get("waiting", [])}, stream_time=state.get("t", 0),
                             reuse=k[2].startswith(REUSE_MARK))

    def save_matcher(key, m: PromptMatcher, partition: int) -> None:
        k = _prompt_tuple(key)
        candidates, waiting = m.candidates.get(k, []), m.waiting.get(k, [])
        if candidates or waiting:
            state = {"candidates": candidates, "waiting": waiting, "t": m.stream_time, "p": partition}
            prompt_state[key] = state
            due["prompt"].schedule(partition, key, prompt_deadline(state, config))
        elif key in prompt_state:
            del prompt_state[key]
            due["prompt"].schedule(partition, key, None)

    async def match_one(event) -> None:
        key, value, partition = event.key, event.value, event.message.partition
        clocks["prompt"].consumed(partition, event.message.offset, **reading_position(event))
        if value["kind"] == "tick":
            return await on_tick("prompt", prompt_state, event, expire_prompt)
        m = matcher_for(key)
        rec = value["record"]
        advance("prompt", event, rec, time_field(value))
        if value["kind"] == "completion":
            for cid, fb in m.on_completion(rec):
                await by_completion.send(key=cid.encode(), value={"kind": "feedback", "record": fb})
        elif (match := m.on_feedback(rec)) is not None:
            cid, fb = match
            await by_completion.send(key=cid.encode(), value={"kind": "feedback", "record": fb})
        save_matcher(key, m, partition)

    async def expire_prompt(key: bytes, partition: int, now: int) -> None:
        m = matcher_for(key)
        m.stream_time = max(m.stream_time, now)
        for fb in m.expire():
            if not m.reuse and (reuse := reuse_key(fb)) is not None:
                # No completion had its prompt: one more try, as feedback on a reused suggestion. Marked as
                # the worker's own re-send: its time was counted here, it is no news where it lands.
                await by_prompt.send(key=_key_bytes(reuse), value={"kind": "feedback", "record": fb,
                                                                   "resent": True})
                continue
            await by_completion.send(key=_identity_key(fb), value={"kind": "unmatched", "record": fb,
                                                                   "why": "unmatched", "resent": True})
        save_matcher(key, m, partition)

    @app.agent(by_prompt)
    async def match(stream):
        await each_event(stream, match_one)

    # -- stage B: one episode per completion ----------------------------------------------------------

    def joiner_for(key) -> EpisodeJoiner:
        state = completion_state[key]
        j = EpisodeJoiner(specs, config, counts=counts, stream_time=state.get("t", 0))
        if state.get("completion") and not state.get("closed"):
            j.open[state["completion"]["completion_id"]] = state["completion"]
        if state.get("closed"):
            j.closed[key.decode()] = state.get("served_at", 0)
        if state.get("early"):
            j.early[key.decode()] = list(state["early"])
        j.seen_feedback = dict(state.get("seen", {}))
        return j

    def save_joiner(key, j: EpisodeJoiner, partition: int) -> None:
        cid = key.decode()
        state = {"t": j.stream_time, "seen": j.seen_feedback, "p": partition}
        if cid in j.open:
            state["completion"] = j.open[cid]
        elif cid in j.closed:
            state["closed"] = True
            state["served_at"] = j.closed[cid]
        if j.early.get(cid):
            state["early"] = j.early[cid]
        completion_state[key] = state
        due["completion"].schedule(partition, key, completion_deadline(state, config))

    async def join_one(event) -> None:
        key, value, partition = event.key, event.value, event.message.partition
        clocks["completion"].consumed(partition, event.message.offset, **reading_position(event))
        if value["kind"] == "tick":
            return await on_tick("completion", completion_state, event, expire_completion)
        j = joiner_for(key)
        rec = value["record"]
        advance("completion", event, rec, time_field(value))
        if value["kind"] == "completion":
            episodes = j.on_completion(rec)
        elif value["kind"] == "feedback":
            episodes = [ep] if (ep := j.on_feedback(key.decode(), rec)) else []
        else:  # unmatched / cache hit, keyed by the feedback's identity so repeats dedupe here
            episodes = [ep] if (ep := j.unmatched(rec, value["why"])) else []
            j.closed[key.decode()] = millis(rec["received_at"])
        save_joiner(key, j, partition)
        for ep in episodes:
            await emit(ep)

    async def expire_completion(key: bytes, partition: int, now: int) -> None:
        state = completion_state[key]
        if state.get("closed"):
            if state.get("served_at", now) < now - 2 * config.completion_ttl_ms:
                del completion_state[key]
            else:
                due["completion"].schedule(partition, key, completion_deadline(state, config))
            return
        j = joiner_for(key)
        j.stream_time = max(j.stream_time, now)
        episodes = j.expire()
        save_joiner(key, j, partition)
        for ep in episodes:
            await emit(ep)

    @app.agent(by_completion)
    async def join(stream):
        await each_event(stream, join_one)

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
        await episodes_out.send(key=scored.key.encode(), value=codec.encode(scored))

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
        for topic in (by_prompt, by_completion):
            for partition in range(settings.topic_partitions):
                ticker.produce(topic.get_topic_name(), value, key=TICK_KEY, partition=partition)
        ticker.poll(0)

    return app


def _prompt_key(record: dict) -> bytes:
    return f"{record['project_id']}\x1f{record['user_id']}\x1f{record['prompt_sha256']}".encode()


def _key_bytes(key: tuple) -> bytes:
    return "\x1f".join(key).encode()


def _prompt_tuple(key: bytes) -> tuple:
    return tuple(key.decode().split("\x1f"))


def _identity_key(fb: dict) -> bytes:
    ident = fb.get("client_completion_id")
    return (f"fb:{fb['project_id']}/{ident}" if ident else f"fb:{fb['event_id']}").encode()


def internal_topics(app_id: str = APP_ID) -> tuple[Topic, ...]:
    """The worker's own topics: repartitions and table changelogs (``{app_id}-{table}-changelog``)."""
    repartition = {"cleanup.policy": "delete", "retention.ms": str(7 * 24 * 3600 * 1000)}
    return tuple([Topic(f"{app_id}-{name}", "(internal)", repartition) for name in ("by-prompt", "by-completion",
                                                                                       "to-score")]
                 + [Topic(f"{app_id}-{table}-changelog", "(internal)", {"cleanup.policy": "compact"})
                    for table in ("prompt-state", "completion-state")])


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
