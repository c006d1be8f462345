"""A history fixture with numbers worked out in plain Python, and helpers the history tests share.

The embedded engine opens one data directory per process, so every in-process
test shares ``shared_client()`` and keeps to a database of its own.
"""

from __future__ import annotations

import functools
import hashlib
import random
import tempfile
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from schemas.events import Event, new_event
from streams.history.sink import HistoryStore, TABLE_FOR_EVENT

# The fixture's files and the language the views must name for each, written out here rather than
# looked up in the product's extension table (which would make the expectation agree with any table).
LANGUAGE_OF = {"src/app.py": "python", "web/ui.ts": "typescript", "cmd/main.go": "go", "lib/util.rs": "rust",
               "notes/README": "other", None: "unknown"}
FILES = list(LANGUAGE_OF)


@functools.lru_cache(maxsize=1)
def shared_client():
    import atexit
    import shutil

    from streams.history.sink import open_client

    path = tempfile.mkdtemp(prefix="tabloop-chdb-")
    atexit.register(shutil.rmtree, path, True)
    return open_client(f"chdb://{path}")


def new_store(retention: dict | None = None) -> HistoryStore:
    store = HistoryStore(shared_client(), f"t_{uuid.uuid4().hex[:12]}", retention or {})
    store.ensure_schema()
    return store


def row(store: HistoryStore, event: Event, topic: str = "fixture", partition: int = 0, offset: int = 0) -> list:
    return store.row(TABLE_FOR_EVENT[event.type], event.record, topic, partition, offset)


def insert_events(store: HistoryStore, events: list[Event]) -> None:
    by_table = defaultdict(list)
    for i, e in enumerate(events):
        by_table[TABLE_FOR_EVENT[e.type]].append(row(store, e, offset=i))
    for table, rows in by_table.items():
        store.insert(table, rows)


def exact_quantile(values: list[float], q: float) -> float:
    """ClickHouse's quantileExact: the element at index floor(q·n) of the sorted values."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class Fixture:
    completions: list[Event] = field(default_factory=list)
    feedback: list[Event] = field(default_factory=list)
    episodes: list[Event] = field(default_factory=list)

    @property
    def events(self) -> list[Event]:
        return self.completions + self.feedback + self.episodes


REWARD = {"ACCEPTED": 0.75, "REJECTED": -0.25, "IGNORED": 0.0}


def analytics_fixture(seed: int = 7, per_day: int = 120, days: int = 4, prefix: str = "") -> Fixture:
    """Completions over ``days`` days (ending today) across versions, projects, users and languages,
    with an episode for most and feedback for the decided ones, plus a few off-policy episodes."""
    rng = random.Random(seed)
    gate_rng = random.Random(seed + 1)  # its own stream: the other draws stay what they were
    today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    fx = Fixture()
    for d in range(days):
        day = today - timedelta(days=days - 1 - d)
        for i in range(per_day):
            # Hours 1..20 keep the episode (a few seconds later) on the same day.
            served = day + timedelta(hours=rng.randrange(1, 20), minutes=rng.randrange(60), seconds=rng.randrange(60),
                                     milliseconds=rng.randrange(1000))
            version = rng.choice([1, 2, 3]) if d < 2 else rng.choice([2, 3, 4])
            project, user = rng.choice([f"{prefix}p-a", f"{prefix}p-b"]), rng.choice(["u1", "u2", "u3"])
            prompt = f"<|fim_prefix|>def f{d}_{i}():<|fim_suffix|><|fim_middle|>"
            aborted = rng.random() < 0.1
            hidden = not aborted and gate_rng.random() < 0.1  # the show-gate hid it: an episode at once, no feedback
            gate = {"gate_version": 1, "gate_score": 0.05, "gate_threshold": 0.2, "gate_shown": False,
                    "show_probability": 0.1} if hidden else {}
            c = new_event("CompletionServed", served_at=served, completion_id=f"cmpl-{prefix}{d}-{i}-{seed}",
                          project_id=project, user_id=user, model="tiny", policy_version=version, prompt=prompt,
                          prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(), filepath=rng.choice(FILES),
                          completion_text="    return 1\n", completion_token_ids=[1, 2, 3],
                          completion_logprobs=[-0.5, -0.25, -1.0], finish_reason="stop", aborted=aborted,
                          temperature=0.2, top_p=0.95, max_tokens=16,
                          ttft_ms=round(rng.uniform(5, 80), 3), latency_ms=round(rng.lognormvariate(4.5, 0.6), 3),
                          replica_id="r0", **gate)
            fx.completions.append(c)
            if aborted:
                continue
            if hidden:
                fx.episodes.append(new_event(
                    "Episode", joined_at=served, completion_id=c.record["completion_id"], project_id=project,
                    user_id=user, policy_version=version, prompt=prompt, completion_text="    return 1",
                    completion_token_ids=[1, 2, 3], behaviour_logprobs=[-0.5, -0.25, -1.0], outcome="IGNORED",
                    reward=0.0, reward_components={"acceptance": 0.0}, scorer="acceptance", matched=True, **gate))
                continue
            outcome = rng.choices(["ACCEPTED", "REJECTED", "IGNORED"], weights=[0.2 + 0.1 * version, 0.6, 0.2])[0]
            joined = served + timedelta(seconds=rng.randrange(1, 30))
            if outcome != "IGNORED":
                fx.feedback.append(new_event(
                    "FeedbackReceived", received_at=joined, project_id=project, user_id=user, source="api",
                    completion_id=c.record["completion_id"], outcome=outcome, raw_payload="{}"))
            fx.episodes.append(new_event(
                "Episode", joined_at=joined, completion_id=c.record["completion_id"], project_id=project,
                user_id=user, policy_version=version, prompt=prompt, completion_text="    return 1\n",
                completion_token_ids=[1, 2, 3], behaviour_logprobs=[-0.5, -0.25, -1.0], outcome=outcome,
                reward=REWARD[outcome], reward_components={"acceptance": REWARD[outcome]}, scorer="acceptance",
                matched=True))
        for j in range(3):  # off-policy: feedback on completions we never served (cache hits)
            joined = day + timedelta(hours=21, minutes=j)
            fx.episodes.append(new_event(
                "Episode", joined_at=joined, completion_id=f"unmatched-{prefix}{d}-{j}", project_id=f"{prefix}p-a",
                user_id="u1", policy_version=None, prompt="x", completion_token_ids=[], behaviour_logprobs=[],
                outcome="ACCEPTED", reward=0.75, reward_components={"acceptance": 0.75}, scorer="acceptance",
                matched=False))
    return fx


def expected_analytics(fx: Fixture) -> dict:
    """The views' numbers, computed here without SQL."""
    served_at = {c.record["completion_id"]: c for c in fx.completions}

    def day(t: datetime) -> str:
        return t.date().isoformat()

    def counts(group: list[Event]) -> dict:
        outcomes = [e.record["outcome"] for e in group]
        acc, part, rej = outcomes.count("ACCEPTED"), outcomes.count("PARTIAL"), outcomes.count("REJECTED")
        hidden = sum(1 for e in group if not e.record["gate_shown"])
        return {"episodes": len(group), "accepted": acc, "rejected": rej,
                "ignored": outcomes.count("IGNORED") - hidden, "gate_hidden": hidden,
                "acceptance_rate": round((acc + part) / (acc + part + rej), 6) if acc + part + rej else None}

    by_version, breakdown, reward = defaultdict(list), defaultdict(list), defaultdict(list)
    for e in fx.episodes:
        r = e.record
        by_version[(r["policy_version"], day(r["joined_at"]))].append(e)
        c = served_at.get(r["completion_id"])
        lang = LANGUAGE_OF[c.record["filepath"]] if c else "unknown"
        breakdown[(r["policy_version"], day(r["joined_at"]), lang, r["project_id"], r["user_id"])].append(e)
        reward[(r["policy_version"], day(r["joined_at"]))].append(r["reward"])
    shown: dict = defaultdict(lambda: {"served": 0, "shown": 0, "accepted": 0, "rejected": 0, "gate_hidden": 0})
    outcome_of = {e.record["completion_id"]: e.record["outcome"] for e in fx.episodes if e.record["matched"]}
    latency = defaultdict(list)
    for c in fx.completions:
        r = c.record
        s = shown[(day(r["served_at"]), r["project_id"], r["policy_version"])]
        s["served"] += 1
        s["shown"] += not r["aborted"] and r["gate_shown"]
        s["gate_hidden"] += not r["gate_shown"]
        s["accepted"] += outcome_of.get(r["completion_id"]) in ("ACCEPTED", "PARTIAL")
        s["rejected"] += outcome_of.get(r["completion_id"]) == "REJECTED"
        latency[day(r["served_at"])].append((r["latency_ms"], r["ttft_ms"]))
    latency_by_day = {
        d: {"completions": len(v),
            "latency_p50": exact_quantile([x for x, _ in v], 0.5), "latency_p90": exact_quantile([x for x, _ in v], 0.9),
            "latency_p99": exact_quantile([x for x, _ in v], 0.99), "ttft_p50": exact_quantile([t for _, t in v], 0.5)}
        for d, v in latency.items()}
    return {
        "acceptance_by_version": {k: counts(v) for k, v in by_version.items()},
        "acceptance": {k: counts(v) for k, v in breakdown.items()},
        "shown_vs_accepted": dict(shown),
        "latency_by_day": latency_by_day,
        "reward_by_version": {k: {"episodes": len(v), "reward_mean": round(sum(v) / len(v), 6)}
                              for k, v in reward.items()},
    }
