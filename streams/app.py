"""The streams worker's topology, all in one place: topics, tables, agents (``build_app``, ``Topology``).

    tabloop.completions ─┐  (key: project/user)
    tabloop.feedback ────┼─▶ join ─┬──────────────────────────────▶ tabloop.episodes
    {app}-rekeyed ───────┘    ▲    ├─▶ {app}-to-score ─▶ score ─▶ tabloop.episodes  (specs that weigh judge or tests)
                              └────┘ input off its home partition, moved there once; the clock's ticks (tick)
    {app}-by-prompt, {app}-by-completion ─▶ drain_… ─▶ {app}-rekeyed  (what a worker from before issue 32 left)

The join takes one partition (one project and user) at a time: it matches feedback to its completion by id,
by prompt, by reuse; what an agent cannot decode or process goes to tabloop.deadletter.

The rules live in ``streams.join`` (pure, tested by hand); ``streams.join_state`` feeds them one partition's
records and keeps their state in one Faust table with a changelog topic, so a restarted worker resumes where
it stopped. Completions and feedback are keyed by project and user (``schemas.events.user_key``), so every
rule is decided where the records land: an episode costs its two inputs, three writes of its completion's
state (open, closed, forgotten) and itself. A worker from before issue 32 re-keyed input through two
stages (``by-prompt``, ``by-completion``) with a table each; what they still hold is moved here once
(``streams.legacy``). Episode ids are derived from what they join, so anything processed twice after a
crash produces the same event ids (consumers deduplicate by event_id). The Faust workarounds this relies on
are in ``streams.upstream``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from datetime import datetime, timezone

import faust
from confluent_kafka import Producer

from infra.bus import ensure_topics, make_codec
from infra.settings import Settings
from schemas.codec import Codec, EventDecodeError
from schemas.events import Event, new_event, user_key
from schemas.token_ids import packed_text
from schemas.topics import (CATALOG, COMPLETIONS, DEADLETTER, EPISODES, FEEDBACK, TICK_KEY, TOPIC_BY_NAME, Topic,
                            home_partition)
from streams.clock import PartitionClock
from streams.join import EpisodeJoiner, JoinConfig, millis
from streams.join_state import JoinState
from streams.legacy import LEGACY_KEY, LEGACY_STAGES, LegacyMove
from rewards.spec import RewardSpecs
from rewards.scoring import Scorers, rescored
from streams.upstream import (ChangelogWrites, MarkerAwareTables, StreamsApp, TransactionalTable, dead_producers,
                              leave_group, send_raw)

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
TICK_S = 1.0


def plain(record: dict) -> dict:
    """A record as JSON-friendly values (datetimes as epoch ms, packed token ids as base64 text: Faust's
    JSON would write the bytes' repr) for internal topics and tables."""
    return {k: millis(v) if isinstance(v, datetime) else packed_text(v) if isinstance(v, bytes) else v
            for k, v in record.items()}


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
        Table=TransactionalTable, TableManager=MarkerAwareTables,
        # Few, full produce requests: writing them is the largest cost of the worker (aiokafka's sender
        # was 28 % of its CPU in a py-spy profile of `tabloop bench pipeline`, most of it socket writes).
        # With exactly-once, each transactional producer (one per source partition) sent a request every
        # two or three events at Faust's 16 KB batches and a 5 ms linger. 50 ms is small beside the commit
        # interval that already bounds each hop's latency (``streams_commit_interval_s``).
        producer_linger_ms=PRODUCER_LINGER_MS, producer_max_batch_size=PRODUCER_MAX_BATCH_BYTES,
        broker_commit_interval=settings.streams_commit_interval_s,
        # Static membership where the worker has an id (`tabloop up` gives its worker one): the successor of
        # a SIGKILLed worker takes its place at once instead of waiting for the dead member's session.
        consumer_group_instance_id=settings.streams_instance_id or None,
    )
    app.tabloop_processing = asyncio.Lock()
    app.tabloop_changes = ChangelogWrites(app)
    t = Topology(app, settings, specs, config, scorers, codec, app_id)

    # Each agent: its input ─▶ its output. Every agent may also write tabloop.deadletter (``each_event``).
    # The agents' names are the ones Faust gave them when they were functions of this module: they stay.
    app.on_partitions_assigned.connect(t.start_partitions_afresh)
    # tabloop.completions, tabloop.feedback, {app}-rekeyed ─▶ tabloop.episodes, {app}-to-score, {app}-rekeyed
    # (input off its home partition); its state: table join-state.
    app.agent(t.join_input, name="streams.app.join")(t.join)
    # {app}-by-prompt, {app}-by-completion ─▶ {app}-rekeyed (and the old tables prompt-state, completion-state).
    for legacy_topic in t.legacy_topics:
        app.agent(legacy_topic, name=f"drain_{legacy_topic.get_topic_name()}")(t.drain)
    # {app}-to-score ─▶ tabloop.episodes
    app.agent(t.to_score, name="streams.app.score", concurrency=scorers.concurrency)(t.score)
    app.timer(interval=PRODUCER_CHECK_S)(t.exit_if_a_producer_died)
    # ─▶ {app}-rekeyed, every partition: the clock's ticks.
    app.timer(interval=TICK_S)(t.tick)
    return app


class Topology:
    """The worker's topics and tables (its fields) and its agents and timers (its methods, each wired to
    Faust in ``build_app``)."""

    def __init__(self, app: StreamsApp, settings: Settings, specs: RewardSpecs, config: JoinConfig,
                 scorers: Scorers, codec: Codec, app_id: str) -> None:
        self.app, self.settings, self.specs, self.scorers, self.codec = app, settings, specs, scorers, codec
        self.app_id = app_id
        raw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
        self.deadletter = app.topic(DEADLETTER.name, **raw)
        # Input found off its home partition (another producer's partitioner, events keyed before issue 32, an
        # old worker's stages) goes on here, to the home partition, as do the clock's ticks.
        self.rekeyed = app.topic(f"{app_id}-rekeyed", internal=True, **raw)
        self.join_input = app.topic(COMPLETIONS.name, FEEDBACK.name, self.rekeyed.get_topic_name(), **raw)
        self.to_score = app.topic(f"{app_id}-to-score", internal=True, key_serializer="raw", value_serializer="json")
        table = dict(default=dict, partitions=settings.topic_partitions, key_type=bytes)  # values: JSON dicts
        # One table for the join, three kinds of keys (``streams.join_state.prompt_state_key`` and
        # ``completion_state_key``): a prompt's waiting feedback, a completion's episode state (and what the
        # matchers keep of it: the prompts' candidates are an index in memory over these, ``CandidateIndex``),
        # unmatched feedback's identity.
        self.state = app.Table("join-state", **table)
        # The two stages' tables of a worker from before issue 32: restored, moved into ``state``, emptied.
        self.legacy_tables = {"prompt": app.Table("prompt-state", **table),
                              "completion": app.Table("completion-state", **table)}
        self.legacy_topics = [app.topic(f"{app_id}-{name}", internal=True, key_serializer="raw",
                                        value_serializer="json") for name in LEGACY_STAGES]
        app.tabloop_counts = self.counts = EpisodeJoiner().counts
        self.join_state = JoinState(self.state, specs, config, self.counts, emit=self.emit)
        self.legacy = LegacyMove(self.legacy_tables, self.rekeyed, self.join_state, settings.topic_partitions)
        # Event time per partition: expiry follows the events, so a worker that lags behind never closes a
        # window early; an idle partition follows the wall clock after ``idle_close_ms``, once it has caught
        # up with what its sources held when assigned (the rules: ``streams.clock``).
        self.clock = PartitionClock(config.idle_close_ms)
        self.sources = (COMPLETIONS.name, FEEDBACK.name, self.rekeyed.get_topic_name())
        # Ticks go out through a plain (non-transactional) Kafka producer: a Faust send from a timer would run
        # outside any transaction and fence the exactly-once producers.
        self.ticker = Producer({"bootstrap.servers": settings.kafka_bootstrap, "linger.ms": 0})

    async def start_partitions_afresh(self, sender, assigned=(), *args, **kwargs) -> None:
        self.join_state.reset()
        self.legacy.moved.clear()
        for partition in {tp.partition for tp in assigned if tp.topic in self.sources}:
            self.clock.assigned(partition)

    async def each_event(self, stream, handle, prepare=None) -> None:
        """Run ``handle`` on every event as one unit: its sends and table writes go out in the
        transaction of its source partition, the event is acked, and no commit cuts into it.

        ``prepare`` (slow work without side effects, such as asking the judge) runs first, outside
        the unit, so that other agents go on meanwhile; its result is handed to ``handle``.
        """
        app = self.app
        async for event in stream.events():
            if app.consumer.stale(event.message):  # fetched before a seek: it comes again
                event.ack()
                continue
            prepared = await prepare(event) if prepare is not None else None
            async with app.tabloop_processing:
                try:
                    await (handle(event) if prepare is None else handle(event, prepared))
                except Exception as exc:  # a bug or a poison record must not stall the stream
                    log.exception("could not process %s[%d]@%d", event.message.topic, event.message.partition,
                                  event.message.offset)
                    await self.dead_letter(event, exc)
                if not app.in_transaction:  # at least once: its state changes go before its offset can
                    await app.tabloop_changes.send([None])
                event.ack()  # inside the unit: a commit takes its offset together with its effects

    async def dead_letter(self, event, error: Exception) -> None:
        self.counts["dead_letters"] += 1
        msg = event.message
        dl = new_event("DeadLetter", source_topic=msg.topic, source_partition=msg.partition,
                       source_offset=msg.offset, raw=bytes(msg.value or b""), error=f"{type(error).__name__}: {error}",
                       consumer=self.app_id)
        await self.deadletter.send(key=dl.key.encode(), value=self.codec.encode(dl))

    async def emit(self, episode: Event) -> None:
        """Publish an episode, or first have it scored when its project's spec weighs judge or tests."""
        spec = self.specs.for_project(episode.record["project_id"])
        if self.scorers.weighed(spec):  # else nothing to score: no copy of the record, no look at its prompt
            record = plain(episode.record)
            wanted = self.scorers.wanted(spec, record)
            if wanted:
                self.counts["to_score"] += 1
                await self.to_score.send(key=episode.key.encode(), value={"episode": record, "wanted": wanted})
                return
        self.counts["episodes_out"] += 1
        await send_raw(self.app, EPISODES.name, episode.key.encode(), self.codec.encode(episode))

    # -- the join: every rule decided inside one partition (one project and user) ---------------------------

    async def join(self, stream) -> None:
        await self.each_event(stream, self.join_one)

    async def join_one(self, event) -> None:
        msg = event.message
        partition = msg.partition
        self.join_state.index_candidates()
        self.clock.consumed(partition, msg.offset, **self.reading_position(event))
        if event.key == TICK_KEY:
            return await self.on_tick(partition, json.loads(event.value), msg.tp)
        if event.key == LEGACY_KEY:
            return await self.legacy.take_over(json.loads(event.value), partition)
        rec = self.decoded(event)
        if isinstance(rec, Exception):
            return await self.dead_letter(event, rec)
        home = home_partition(user_key(rec).encode(), self.settings.topic_partitions)
        if home != partition:
            if msg.topic == self.rekeyed.get_topic_name():  # a worker with another partition count put it here
                return await self.dead_letter(event, ValueError(
                    f"rekeyed to partition {partition}, whose home is {home}: do the workers agree on "
                    f"TABLOOP_TOPIC_PARTITIONS ({self.settings.topic_partitions})?"))
            return await self.forward(event, home)
        if "served_at" in rec:
            self.advance(partition, rec, "served_at")
            await self.join_state.on_completion(rec, partition)
        else:
            self.advance(partition, rec, "received_at")
            await self.join_state.on_feedback(rec, partition)

    def decoded(self, event) -> dict | Exception:
        """The record of a completion or feedback event (on the rekeyed topic: either), or why not."""
        try:
            e = self.codec.decode(event.value)
        except EventDecodeError as exc:
            return exc
        topic = TOPIC_BY_NAME.get(event.message.topic)  # None: the rekeyed topic, which carries either
        expected = topic.event_type if topic else e.type
        if e.type != expected:
            return EventDecodeError(f"{e.type} on a topic of {expected}")
        if e.type not in ("CompletionServed", "FeedbackReceived"):
            return EventDecodeError(f"{e.type} is neither a completion nor feedback")
        return plain(e.record)

    async def forward(self, event, partition: int) -> None:
        """Input off its home partition: on to the home partition, as it came (processed there)."""
        self.counts["rekeyed"] += 1
        await self.rekeyed.send(key=event.key, value=event.value, partition=partition)

    async def drain(self, stream) -> None:
        """A pre-issue-32 worker's stage topic (and tables), moved to the join (``streams.legacy``)."""
        await self.each_event(stream, self.legacy.drain)

    # -- stage C (only for specs that weigh judge or tests): score, then publish ---------------------------

    async def score(self, stream) -> None:
        await self.each_event(stream, self.publish_scored, prepare=self.score_one)

    async def score_one(self, event) -> tuple[dict, dict]:
        episode, wanted = event.value["episode"], event.value["wanted"]
        return await self.scorers.score(self.specs.for_project(episode["project_id"]), episode, wanted)

    async def publish_scored(self, event, scores: tuple[dict, dict]) -> None:
        episode = event.value["episode"]
        record = rescored(episode, self.specs.for_project(episode["project_id"]), *scores)
        record["joined_at"] = datetime.fromtimestamp(record["joined_at"] / 1000, timezone.utc)
        for component in scores[1]:
            self.counts[f"scoring_errors_{component}"] += 1
        self.counts["episodes_out"] += 1
        scored = Event("Episode", record)
        await send_raw(self.app, EPISODES.name, scored.key.encode(), self.codec.encode(scored))

    # -- time: a tick into every partition, so expiry happens inside stream processing -------------------

    async def tick(self) -> None:
        value = json.dumps({"kind": "tick", "now": int(time.time() * 1000)}).encode()
        for partition in range(self.settings.topic_partitions):
            self.ticker.produce(self.rekeyed.get_topic_name(), value, key=TICK_KEY, partition=partition)
        self.ticker.poll(0)

    async def on_tick(self, partition: int, tick: dict, tp) -> None:
        """Expire the keys of this partition that are due; first, once after an assignment, move a
        pre-issue-32 worker's state."""
        await self.legacy.move_state_once(partition)
        if not self.clock.ends_known(partition):
            self.learn_end_offsets(partition, tp)
        if self.clock.ends_known(partition) and not self.clock.caught_up(partition):
            self.count_committed_as_read(partition, tp)
        await self.join_state.expire_due(partition, self.clock.now(partition, tick["now"]), tick["now"])

    def end_of(self, tp) -> int | None:
        """The partition's end as the consumer last heard it from the broker (None: not known yet; -1, no
        stable offset outside read_committed, counts as 0)."""
        try:
            end = self.app.consumer.highwater(tp)
        except Exception:  # between assignments: not known
            return None
        return None if end is None else max(end, 0)

    def learn_end_offsets(self, partition: int, tp) -> None:
        """Where each source of the partition ends now (its fetches have come back: one of its records is
        being processed): the offsets to catch up with. Not all known yet: the next tick asks again."""
        ends = {source: self.end_of(tp._replace(topic=source)) for source in self.sources}
        if None in ends.values():
            return
        self.clock.set_end_offsets(partition, ends)
        log.info("partition %d: idle windows close by the wall clock once its sources are read up to %s, their "
                 "ends now", partition, ends)

    def count_committed_as_read(self, partition: int, tp) -> None:
        # A source with nothing to read since the assignment (its committed offset at its end: a
        # restart after a quiet spell) gives no record to count: its commit says it was read.
        for source in self.sources:
            end, committed = self.clock.end_offset(partition, source), self.app.consumer.committed_offset(
                tp._replace(topic=source))
            if committed is not None and end is not None and committed >= end:
                self.clock.consumed(partition, committed - 1, source=source)

    def reading_position(self, event) -> dict:
        """When a record was read and where its partition ended then: a record behind it means a backlog,
        not an idle partition (``streams.clock``)."""
        return {"wall_ms": time.time() * 1000, "end_offset": self.end_of(event.message.tp),
                "source": event.message.topic}

    def advance(self, partition: int, record: dict, field: str) -> None:
        t = millis(record[field]) if record.get(field) is not None else 0
        self.clock.advance(partition, t, time.time() * 1000)

    async def exit_if_a_producer_died(self) -> None:
        # Exit at once, as a SIGKILL would: what was not committed is processed again by the worker the
        # supervisor starts next, in transactions, so nothing is lost or doubled (the kill drills check it).
        dead = dead_producers(self.app.producer)
        if dead:
            log.error("Kafka producer(s) %s died (aiokafka's sender routine ended); exiting with code %d for a "
                      "fresh worker to take over", ", ".join(dead), EXIT_PRODUCER_DIED)
            leave_group(self.app.consumer)
            logging.shutdown()
            os._exit(EXIT_PRODUCER_DIED)


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
            threading.Thread(target=self._exit_if_still_stopping, name="stop-deadline", daemon=True).start()

    def _exit_if_still_stopping(self) -> None:
        time.sleep(self.stop_grace_s)
        log.error("the worker did not stop within %.0fs of the stop signal (Kafka unreachable?); exiting with "
                  "code %d: nothing committed is lost, the next worker redoes the rest", self.stop_grace_s,
                  EXIT_STOP_TIMEOUT)
        logging.shutdown()
        os._exit(EXIT_STOP_TIMEOUT)
