"""Replay: the same episodes from ClickHouse and from Kafka, with the current reward spec."""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner

from infra.bus import EventProducer, ensure_topics, read_topic
from tabloop.cli import main
from schemas.events import new_event
from schemas.topics import COMPLETIONS, FEEDBACK
from streams.history.sink import HistorySink
from streams.history.sql import HistoryServer
from streams.join import JoinConfig
from streams.history.replay import canonical, derive_episodes, parse_offset
from rewards.spec import RewardSpec, RewardSpecs
from tests.conftest import make_settings
from tests.history_fixture import new_store
from tests.system_helpers import wait

pytestmark = pytest.mark.kafka
LOGPROBS = [-0.5, -0.25, -1.0, -0.125]  # exact in Avro's float, so in-memory and stored records agree


def replay_fixture(tag: str, n: int = 60):
    """Completions and feedback covering every way the join goes: our id, prompt-hash match,
    unmatched, cache hit, no feedback, and one feedback event published twice."""
    t0 = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(hours=2)
    completions, feedback = [], []
    for i in range(n):
        project = f"{tag}-p{i % 2}"
        prompt = f"<|fim_prefix|>def g{i}(x):<|fim_suffix|><|fim_middle|>"
        sha = hashlib.sha256(prompt.encode()).hexdigest()
        served = t0 + timedelta(seconds=30 * i)
        c = new_event("CompletionServed", served_at=served, completion_id=f"cmpl-{tag}-{i}", project_id=project,
                      user_id=f"u{i % 3}", model="tiny", policy_version=1 + i % 3, prompt=prompt, prompt_sha256=sha,
                      filepath="a.py", completion_text="    return x + 1\n", completion_token_ids=[5, 6, 7, 8],
                      completion_logprobs=LOGPROBS, finish_reason="stop", aborted=False, temperature=0.2, top_p=0.95,
                      max_tokens=16, ttft_ms=10.0, latency_ms=50.0 + i, replica_id="r0")
        completions.append(c)
        at = served + timedelta(seconds=3)
        kind = i % 6
        outcome = "ACCEPTED" if i % 4 == 0 else "REJECTED"
        common = dict(received_at=at, project_id=project, user_id=f"u{i % 3}", outcome=outcome, raw_payload="{}")
        if kind in (0, 1):  # our client: our id
            feedback.append(new_event("FeedbackReceived", source="api", completion_id=c.record["completion_id"],
                                      **common))
        elif kind == 2:  # Continue: no id, matched by prompt hash and the shown prefix
            feedback.append(new_event("FeedbackReceived", source="continue-fork", client_completion_id=str(uuid.uuid4()),
                                      prompt=prompt, prompt_sha256=sha, completion="    return x", **common))
        elif kind == 3:  # a prompt we never served
            feedback.append(new_event("FeedbackReceived", source="continue-fork", client_completion_id=str(uuid.uuid4()),
                                      prompt="other", prompt_sha256="f" * 64, completion="y", **common))
        elif kind == 4:  # Continue's cache answered
            feedback.append(new_event("FeedbackReceived", source="continue-fork", client_completion_id=str(uuid.uuid4()),
                                      prompt=prompt, prompt_sha256=sha, completion="z", cache_hit=True, **common))
        # kind 5: no feedback at all (IGNORED, no episode by default)
    return completions, feedback


def as_set(episodes) -> set[str]:
    return {json.dumps(e.to_json(), sort_keys=True) for e in episodes}


@pytest.fixture(scope="module")
def history(kafka, tmp_path_factory):
    """The fixture published to the catalog topics, stored by a sink, served over HTTP."""
    tmp = tmp_path_factory.mktemp("replay")
    tag = f"r{uuid.uuid4().hex[:8]}"
    store = new_store()
    settings = make_settings(tmp, kafka_bootstrap=kafka.settings.kafka_bootstrap, history_database=store.database,
                             history_batch_interval_s=0.2)
    completions, feedback = replay_fixture(tag)
    ensure_topics(settings)
    with EventProducer(settings) as producer:
        for e in completions + feedback:
            producer.publish(e)
        producer.publish(feedback[0])  # the same event twice (a spool replay): one fact
    sink = HistorySink(settings, store, group_id=f"replay-{tag}")
    projects = f"project_id IN ('{tag}-p0', '{tag}-p1')"

    def stored(table: str) -> int:
        return store.query(f"SELECT uniqExact(event_id) FROM {store.database}.{table} WHERE {projects}").rows[0][0]

    def all_stored() -> bool:
        if stored("completions") >= len(completions) and stored("feedback") >= len(feedback):
            return True
        sink.step()
        return False

    wait(all_stored, 120, "the sink to store the fixture", poll_s=0)
    sink.close()
    server = HistoryServer(store, "tlh_replay", "127.0.0.1", 0).start()
    env = {"TABLOOP_KAFKA_BOOTSTRAP": settings.kafka_bootstrap, "TABLOOP_STATE_DIR": str(tmp),
           "TABLOOP_HISTORY_PORT": str(server.port), "TABLOOP_HISTORY_TOKEN": "tlh_replay",
           "TABLOOP_HISTORY_DATABASE": store.database, "TABLOOP_TOPIC_PARTITIONS": "3"}
    yield {"tag": tag, "settings": settings, "store": store, "env": env, "completions": completions,
           "feedback": feedback, "projects": (f"{tag}-p0", f"{tag}-p1"), "tmp": tmp}
    server.stop()


def run_replay(history, *args: str) -> tuple[dict, set[str]]:
    """`tabloop replay … --to <fresh topic>`; returns its summary and the episodes on the topic."""
    topic = f"tabloop.replay.{uuid.uuid4().hex[:10]}"
    project_args = [a for p in history["projects"] for a in ("--project", p)]
    result = CliRunner().invoke(main, ["replay", "--to", topic, *project_args, *args], env=history["env"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    episodes = [r.event for r in read_topic(history["settings"], topic)]
    assert all(e is not None for e in episodes)
    assert summary["episodes"] == len(episodes)
    return summary, as_set(episodes)


def test_replay_from_clickhouse_and_kafka_gives_the_same_episodes(history, tmp_path):
    spec = tmp_path / "rewards.yaml"
    spec.write_text("default: {accepted: 1.0, rejected: -0.5}\n")  # the *current* spec, not what was live
    from_ch, eps_ch = run_replay(history, "--source", "clickhouse", "--reward-spec", str(spec))
    from_kafka, eps_kafka = run_replay(history, "--source", "kafka", "--reward-spec", str(spec))
    assert eps_ch == eps_kafka
    assert from_ch["completions"] == from_kafka["completions"] == 60
    assert from_ch["feedback"] == from_kafka["feedback"] == 50  # the duplicate folded in both

    # ... and they are what the join makes of the fixture itself, worked out without any store.
    records = [("CompletionServed", canonical("CompletionServed", e.record)) for e in history["completions"]] + \
              [("FeedbackReceived", canonical("FeedbackReceived", e.record)) for e in history["feedback"]]
    specs = RewardSpecs(RewardSpec(accepted=1.0, rejected=-0.5))
    assert eps_ch == as_set(derive_episodes(records, specs, JoinConfig.from_settings(history["settings"])))

    episodes = [json.loads(e)["event"] for e in eps_ch]
    by_kind = {"matched": sum(e["matched"] for e in episodes), "unmatched": sum(not e["matched"] for e in episodes)}
    # 20 by our id + 10 by prompt hash matched; 10 never served + 10 cache hits off-policy; 10 ignored: none
    assert by_kind == {"matched": 30, "unmatched": 20}
    assert {e["reward"] for e in episodes} == {1.0, -0.5}
    assert sum(e["outcome"] == "ACCEPTED" for e in episodes) == sum(
        f.record["outcome"] == "ACCEPTED" for f in history["feedback"])


def test_replay_selections_agree_across_sources(history):
    _, v2_ch = run_replay(history, "--source", "clickhouse", "--policy-version", "2")
    _, v2_kafka = run_replay(history, "--source", "kafka", "--policy-version", "2")
    assert v2_ch == v2_kafka and v2_ch
    assert {json.loads(e)["event"]["policy_version"] for e in v2_ch} == {2}

    since = (history["completions"][30].record["served_at"]).isoformat()
    s_ch, late_ch = run_replay(history, "--source", "clickhouse", "--since", since)
    s_kafka, late_kafka = run_replay(history, "--source", "kafka", "--since", since)
    assert late_ch == late_kafka and s_ch["completions"] == s_kafka["completions"] == 30

    store = history["store"]
    projects = f"project_id IN ('{history['projects'][0]}', '{history['projects'][1]}')"
    # The partition holding most of the fixture's completions (keyed by project and user: not every
    # partition holds some), from the middle of its share on.
    partition = store.query(f"SELECT _partition FROM {store.database}.completions WHERE {projects} "
                            "GROUP BY _partition ORDER BY count() DESC, _partition LIMIT 1").rows[0][0]
    rows = store.query(f"SELECT _partition, _offset FROM {store.database}.completions WHERE {projects} "
                       f"AND _partition = {partition} ORDER BY _offset").rows
    assert len(rows) >= 2, rows
    middle = rows[len(rows) // 2][1]
    start = f"{COMPLETIONS.name}:{partition}:{middle}"
    o_ch, off_ch = run_replay(history, "--source", "clickhouse", "--offset", start)
    o_kafka, off_kafka = run_replay(history, "--source", "kafka", "--offset", start)
    assert off_ch == off_kafka
    assert o_ch["completions"] == o_kafka["completions"] == 60 - len(rows) // 2


def test_replay_refuses_what_it_cannot_do(history):
    env = history["env"]
    r = CliRunner().invoke(main, ["replay", "--to", "tabloop.episodes"], env=env)
    assert r.exit_code == 1 and "live system" in r.output
    r = CliRunner().invoke(main, ["replay"], env=env)
    assert r.exit_code == 1 and "--to TOPIC" in r.output
    r = CliRunner().invoke(main, ["replay", "--dry-run", "--offset", "tabloop.weights:0:1"], env=env)
    assert r.exit_code == 1 and "not 'tabloop.weights'" in r.output
    with pytest.raises(ValueError, match="TOPIC:PARTITION:OFFSET"):
        parse_offset("nonsense")
    assert parse_offset(f"{FEEDBACK.name}:2:40") == ((FEEDBACK.name, 2), 40)


def test_replay_scores_with_the_tests_its_spec_weighs(tmp_path):
    """With a spec that weighs unit tests, replayed episodes get the tests component as the worker's do."""
    from policy.fim import build_fim_prompt
    from streams.history.replay import score_episodes
    from rewards.scoring import Scorers, UnitTestsScorer, UnitTestsIndex

    prefix, suffix = "def add(a, b):\n    return ", "\n"
    prompt = build_fim_prompt(prefix, suffix)
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    records = []
    for i, text in enumerate(["a + b", "a - b"]):
        cid = f"cmpl-score-{i}"
        records.append(("CompletionServed", canonical("CompletionServed", new_event(
            "CompletionServed", served_at=t0 + timedelta(seconds=i), completion_id=cid, project_id="p", user_id="u",
            model="tiny", policy_version=1, prompt=prompt, prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(),
            completion_text=text, completion_token_ids=[1], completion_logprobs=[-0.5], finish_reason="stop",
            aborted=False, temperature=0.2, top_p=0.95, max_tokens=8, ttft_ms=1.0, latency_ms=2.0,
            replica_id="r").record)))
        records.append(("FeedbackReceived", canonical("FeedbackReceived", new_event(
            "FeedbackReceived", received_at=t0 + timedelta(seconds=i + 1), project_id="p", user_id="u", source="api",
            completion_id=cid, outcome="ACCEPTED", raw_payload="{}").record)))
    specs = RewardSpecs(RewardSpec(weights={"acceptance": 0.5, "tests": 0.5}))
    episodes = derive_episodes(records, specs)
    index = UnitTestsIndex({hashlib.sha256(prompt.encode()).hexdigest(): "assert add(2, 3) == 5\n"})
    scored = {e.record["completion_text"]: e.record for e in score_episodes(episodes, specs, Scorers.of(UnitTestsScorer(index)))}
    assert scored["a + b"]["reward_components"] == {"acceptance": 0.75, "tests": 0.75}
    assert scored["a - b"]["reward_components"] == {"acceptance": 0.75, "tests": -0.25}
    assert scored["a - b"]["reward"] == pytest.approx(0.25) and scored["a - b"]["scorer"] == "acceptance+tests"
