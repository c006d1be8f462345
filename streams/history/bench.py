"""`tabloop bench history`: the sink's rows/s (broker → embedded ClickHouse) and the time of the
acceptance-by-version query over a million episodes. Last line: one JSON object."""

from __future__ import annotations

import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid

from infra.bus import EventProducer, admin_client, ensure_topics
from infra.settings import Settings
from schemas.examples import example_event
from schemas.topics import KEEP_FOREVER, Topic
from streams.history.sink import EVENT_FOR_TABLE, HistorySink, HistoryStore, open_client

SINK_MIX = {"completions": "CompletionServed", "feedback": "FeedbackReceived", "episodes": "Episode"}


def _synthetic_episodes_sql(db: str, n: int, days: int = 30) -> str:
    """``n`` episodes made by the engine itself: 8 policy versions, 10 projects, 50 users, ``days`` days,
    outcomes about 30 % accepted, 5 % partial, 55 % rejected, 10 % ignored; short prompts, 16 tokens."""
    return f"""
INSERT INTO {db}.episodes (event_id, joined_at, completion_id, project_id, user_id, policy_version, prompt,
  completion_text, completion_token_ids, behaviour_logprobs, outcome, reward, reward_components, scorer, matched,
  feedback_event_id, _topic, _partition, _offset)
SELECT toString(generateUUIDv4(number)), now64(3) - toIntervalSecond(rand(1) % ({days} * 86400)),
  concat('cmpl-', toString(number)), concat('project-', toString(number % 10)), concat('user-', toString(number % 50)),
  toInt64(number % 8), concat('<|fim_prefix|>def f', toString(number), '():<|fim_suffix|><|fim_middle|>'),
  '    return 1\\n', arrayMap(i -> toInt32((number * 7 + i) % 151000), range(16)),
  arrayMap(i -> toFloat32(-((number + i) % 300) / 100), range(16)),
  multiIf(rand(2) % 100 < 30, 'ACCEPTED', rand(2) % 100 < 35, 'PARTIAL', rand(2) % 100 < 90, 'REJECTED', 'IGNORED')
    AS outcome,
  multiIf(outcome = 'ACCEPTED', 0.75, outcome = 'REJECTED', -0.25, outcome = 'PARTIAL', 0.25, 0.0),
  map('acceptance', multiIf(outcome = 'ACCEPTED', 0.75, outcome = 'REJECTED', -0.25, outcome = 'PARTIAL', 0.25, 0.0)),
  'acceptance', true, NULL, 'bench', 0, toInt64(number)
FROM numbers({n})"""


def bench_history(settings: Settings, n: int = 60_000, episodes: int = 1_000_000) -> dict:
    tag = uuid.uuid4().hex[:8]
    topics = {f"tabloop-bench-{tag}.{table}": table for table in SINK_MIX}
    ensure_topics(settings, [Topic(name, EVENT_FOR_TABLE[table], KEEP_FOREVER) for name, table in topics.items()])
    data_dir = tempfile.mkdtemp(prefix="tabloop-bench-history-")
    result: dict = {"bench": "history", "engine": "chdb", "events": n, "batch_size": settings.history_batch_size}
    try:
        print(f"producing {n} realistic events (2 KB prompts, 64 tokens) to {len(topics)} bench topics …",
              file=sys.stderr)
        rng = random.Random(0)
        names = list(topics)
        with EventProducer(settings) as producer:
            for i in range(n):
                name = names[i % len(names)]
                producer.publish(example_event(SINK_MIX[topics[name]], i, rng), topic=name)
        client = open_client(f"chdb://{data_dir}")
        store = HistoryStore(client, "bench", {})
        store.ensure_schema()
        result["engine"] = f"chdb {client.query('SELECT version()').result_rows[0][0]}"
        sink = HistorySink(settings, store, topics, group_id=f"bench-history-{tag}")
        print("sink: consuming into embedded ClickHouse …", file=sys.stderr)
        stop = threading.Event()
        first = 0
        while first == 0:  # the first batch waits for the consumer group to form: not the sink's speed
            first = sink.step(stop)
        stored, started = first, time.perf_counter()
        polling_before, storing_before = sink.stats.polling_s, sink.stats.storing_s
        while stored < n:
            stored += sink.step(stop)
        elapsed = time.perf_counter() - started
        sink.close()
        counts = {t: store.count(t) for t in SINK_MIX}
        assert sum(counts.values()) == n, counts
        timed = n - first
        result.update(sink_rows=timed, sink_seconds=round(elapsed, 3), sink_rows_per_s=round(timed / elapsed),
                      sink_batches=sink.stats.batches,
                      sink_polling_s=round(sink.stats.polling_s - polling_before, 3),
                      sink_storing_s=round(sink.stats.storing_s - storing_before, 3))
        print(f"  {timed} rows in {elapsed:.2f}s: {timed / elapsed:,.0f} rows/s (polling {result['sink_polling_s']}s, "
              f"storing {result['sink_storing_s']}s)", file=sys.stderr)

        print(f"making {episodes:,} synthetic episodes in the engine …", file=sys.stderr)
        store.command("TRUNCATE TABLE bench.episodes")
        t0 = time.perf_counter()
        store.command(_synthetic_episodes_sql("bench", episodes))
        result["episodes"] = store.count("episodes")
        result["episodes_insert_s"] = round(time.perf_counter() - t0, 2)
        timings, rows = [], None
        for _ in range(5):
            t0 = time.perf_counter()
            rows = store.query("SELECT * FROM bench.acceptance_by_version")
            timings.append(time.perf_counter() - t0)
        result.update(acceptance_by_version_query_s=round(statistics.median(timings), 4),
                      acceptance_by_version_first_s=round(timings[0], 4), acceptance_by_version_rows=len(rows.rows))
        total = sum(r[rows.columns.index("episodes")] for r in rows.rows)
        assert total == episodes, (total, episodes)
        print(f"  acceptance_by_version over {episodes:,} episodes: median {statistics.median(timings):.3f}s",
              file=sys.stderr)
    finally:
        admin_client(settings).delete_topics(list(topics))
        shutil.rmtree(data_dir, ignore_errors=True)
    print(json.dumps(result, sort_keys=True))
    return result
