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

import json
import logging
import time
from datetime import datetime

import faust
from confluent_kafka import Producer

from infra.bus import make_codec
from infra.settings import Settings
from schemas.codec import EventDecodeError
from schemas.events import Event, new_event
from schemas.topics import COMPLETIONS, DEADLETTER, EPISODES, FEEDBACK
from streams.join import EpisodeJoiner, JoinConfig, PromptMatcher, millis
from streams.rewards import RewardSpecs

log = logging.getLogger("tabloop.streams")
APP_ID = "tabloop-streams"


def plain(record: dict) -> dict:
    """A record as JSON-friendly values (datetimes as epoch ms) for internal topics and tables."""
    return {k: millis(v) if isinstance(v, datetime) else v for k, v in record.items()}


def build_app(settings: Settings, specs: RewardSpecs | None = None, config: JoinConfig | None = None,
              *, app_id: str = APP_ID, guarantee: str = "exactly_once") -> faust.App:
    specs = specs or (RewardSpecs.from_yaml(settings.reward_spec_file) if settings.reward_spec_file else RewardSpecs())
    config = config or JoinConfig.from_settings(settings)
    codec = make_codec(settings)
    app = faust.App(
        app_id, broker=[f"kafka://{s}" for s in settings.kafka_bootstrap.split(",")], store="memory://",
        processing_guarantee=guarantee, topic_partitions=settings.topic_partitions,
        topic_replication_factor=settings.topic_replication, web_enabled=False, key_serializer="raw",
        value_serializer="json", consumer_auto_offset_reset="earliest", datadir=str(settings.state_dir / "streams"),
    )
    raw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    completions_in = app.topic(COMPLETIONS.name, **raw)
    feedback_in = app.topic(FEEDBACK.name, **raw)
    episodes_out = app.topic(EPISODES.name, **raw)
    deadletter_out = app.topic(DEADLETTER.name, **raw)
    by_prompt = app.topic(f"{app_id}-by-prompt", internal=True, key_serializer="raw", value_serializer="json")
    by_completion = app.topic(f"{app_id}-by-completion", internal=True, key_serializer="raw",
                              value_serializer="json")
    table = dict(default=dict, partitions=settings.topic_partitions, key_type=bytes)  # values: JSON dicts
    prompt_state = app.Table("prompt-state", **table)
    completion_state = app.Table("completion-state", **table)
    app.tabloop_counts = counts = EpisodeJoiner().counts
    # Event time per (stage, partition): expiry follows the events, so a worker that lags behind never
    # closes a window early. After ``idle_close_ms`` without events, a partition's clock moves on with
    # the wall clock, so the last windows close even when nothing new arrives.
    clocks: dict[tuple[str, int], tuple[int, float]] = {}

    def advance(stage: str, partition: int, record: dict, field: str) -> None:
        t = millis(record[field]) if record.get(field) is not None else 0
        event_time, _ = clocks.get((stage, partition), (0, 0.0))
        clocks[(stage, partition)] = (max(event_time, t), time.time() * 1000)

    def now_for(stage: str, partition: int, wall_ms: int) -> int:
        event_time, last_event_wall = clocks.get((stage, partition), (0, 0.0))
        if event_time == 0:  # nothing seen since start: state restored from the changelog ages by the wall
            return wall_ms - config.idle_close_ms
        return event_time + max(0, int(wall_ms - last_event_wall) - config.idle_close_ms)

    async def dead_letter(event, error: Exception) -> None:
        counts["dead_letters"] += 1
        msg = event.message
        dl = new_event("DeadLetter", source_topic=msg.topic, source_partition=msg.partition,
                       source_offset=msg.offset, raw=bytes(event.value or b""), error=f"{type(error).__name__}: {error}",
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
        counts["episodes_out"] += 1
        await episodes_out.send(key=episode.key.encode(), value=codec.encode(episode))

    # -- routing: decode, check, re-key ---------------------------------------------------------

    @app.agent(completions_in)
    async def route_completions(stream):
        async for event in stream.events():
            rec = decoded(event, "CompletionServed")
            if isinstance(rec, Exception):
                await dead_letter(event, rec)
                continue
            await by_completion.send(key=rec["completion_id"].encode(), value={"kind": "completion", "record": rec})
            await by_prompt.send(key=_prompt_key(rec), value={"kind": "completion", "record": rec})

    @app.agent(feedback_in)
    async def route_feedback(stream):
        async for event in stream.events():
            fb = decoded(event, "FeedbackReceived")
            if isinstance(fb, Exception):
                await dead_letter(event, fb)
                continue
            if fb.get("completion_id") is None and fb.get("prompt_sha256") is None:
                counts["no_code"] += 1  # level: noCode — analytics only, never trained on
            elif fb.get("cache_hit"):
                await by_completion.send(key=_identity_key(fb), value={"kind": "unmatched", "record": fb,
                                                                       "why": "cache_hits"})
            elif fb.get("completion_id"):
                await by_completion.send(key=fb["completion_id"].encode(), value={"kind": "feedback", "record": fb})
            else:
                await by_prompt.send(key=_prompt_key(fb), value={"kind": "feedback", "record": fb})

    # -- stage A: match feedback without our id to a completion --------------------------------------

    def matcher_for(key) -> PromptMatcher:
        """The matcher for one prompt key, from its table entry (the key is the matcher's own key)."""
        state, k = prompt_state[key], _prompt_tuple(key)
        return PromptMatcher(config, candidates={k: state.get("candidates", [])},
                             waiting={k: state.get("waiting", [])}, stream_time=state.get("t", 0))

    def save_matcher(key, m: PromptMatcher, partition: int) -> None:
        k = _prompt_tuple(key)
        candidates, waiting = m.candidates.get(k, []), m.waiting.get(k, [])
        if candidates or waiting:
            prompt_state[key] = {"candidates": candidates, "waiting": waiting, "t": m.stream_time, "p": partition}
        elif key in prompt_state:
            del prompt_state[key]

    @app.agent(by_prompt)
    async def match(stream):
        async for event in stream.events():
            key, value, partition = event.key, event.value, event.message.partition
            if value["kind"] == "tick":
                await expire_prompts(partition, now_for("prompt", partition, value["now"]))
                continue
            m = matcher_for(key)
            rec = value["record"]
            advance("prompt", partition, rec, "served_at" if value["kind"] == "completion" else "received_at")
            if value["kind"] == "completion":
                for cid, fb in m.on_completion(rec):
                    await by_completion.send(key=cid.encode(), value={"kind": "feedback", "record": fb})
            else:
                cid = m.on_feedback(rec)
                if cid is not None:
                    await by_completion.send(key=cid.encode(), value={"kind": "feedback", "record": rec})
            save_matcher(key, m, partition)

    async def expire_prompts(partition: int, now: int) -> None:
        # Only this partition's keys: a table write is logged to the partition being processed.
        for key, state in [(k, v) for k, v in prompt_state.items() if v.get("p") == partition]:
            m = matcher_for(key)
            m.stream_time = max(m.stream_time, now)
            k = _prompt_tuple(key)
            sizes = (len(m.candidates.get(k, [])), len(m.waiting.get(k, [])))
            for fb in m.expire():
                await by_completion.send(key=_identity_key(fb), value={"kind": "unmatched", "record": fb,
                                                                       "why": "unmatched"})
            # Write only what changed: every write is a changelog record a restart must replay.
            if (len(m.candidates.get(k, [])), len(m.waiting.get(k, []))) != sizes:
                save_matcher(key, m, partition)

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

    @app.agent(by_completion)
    async def join(stream):
        async for event in stream.events():
            key, value, partition = event.key, event.value, event.message.partition
            if value["kind"] == "tick":
                await expire_completions(partition, now_for("completion", partition, value["now"]))
                continue
            j = joiner_for(key)
            rec = value["record"]
            advance("completion", partition, rec, "served_at" if value["kind"] == "completion" else "received_at")
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

    async def expire_completions(partition: int, now: int) -> None:
        horizon = now - 2 * config.completion_ttl_ms
        for key, state in [(k, v) for k, v in completion_state.items() if v.get("p") == partition]:
            if state.get("closed"):
                if state.get("served_at", now) < horizon:
                    del completion_state[key]
                continue
            j = joiner_for(key)
            j.stream_time = max(j.stream_time, now)
            sizes = (len(j.open), len(j.early))
            episodes = j.expire()
            if (len(j.open), len(j.early)) != sizes:  # only changes reach the changelog
                save_joiner(key, j, partition)
            for ep in episodes:
                await emit(ep)

    # -- time: a tick into every partition, so expiry happens inside stream processing -------------------
    # Ticks go out through a plain (non-transactional) Kafka producer: a Faust send from a timer would run
    # outside any transaction and fence the exactly-once producers.

    ticker = Producer({"bootstrap.servers": settings.kafka_bootstrap, "linger.ms": 0})

    @app.timer(interval=1.0)
    async def tick():
        value = json.dumps({"kind": "tick", "now": int(time.time() * 1000)}).encode()
        for topic in (by_prompt, by_completion):
            for partition in range(settings.topic_partitions):
                ticker.produce(topic.get_topic_name(), value, key=b"__tick__", partition=partition)
        ticker.poll(0)

    return app


def _prompt_key(record: dict) -> bytes:
    return f"{record['project_id']}\x1f{record['user_id']}\x1f{record['prompt_sha256']}".encode()


def _prompt_tuple(key: bytes) -> tuple:
    return tuple(key.decode().split("\x1f"))


def _identity_key(fb: dict) -> bytes:
    ident = fb.get("client_completion_id")
    return (f"fb:{fb['project_id']}/{ident}" if ident else f"fb:{fb['event_id']}").encode()


def run_worker(settings: Settings, **kwargs) -> None:
    """`tabloop streams`: run the worker until interrupted."""
    app = build_app(settings, **kwargs)
    worker = faust.Worker(app, loglevel=settings.log_level.lower())
    worker.execute_from_commandline()
