"""Continue, end to end, with Continue's own code (issue 14): the Node harness in tests/continue/ drives a live
front door with @continuedev/openai-adapters and @continuedev/fetch's streamSse, validates the config tabloop
prints (whole, and merged into the file Continue creates) with @continuedev/config-yaml's parser and validator,
and builds `data:` payloads with its dev-data schemas; the episodes they make come from the join's own
pipeline over the events the front door put on Kafka. `make test` installs the Node packages (`npm ci`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from infra.bus import ensure_topics
from infra.local import ContinueConfigError, continue_config, endpoints, merge_continue_config
from schemas.topics import COMPLETIONS, FEEDBACK
from serving import feedback
from infra.auth import KeyStore
from streams.join import JoinPipeline
from tests.conftest import make_settings
from tests.serving_helpers import ThreadServer, find_events

HARNESS = Path(__file__).parent / "continue"
# The file Continue writes on its first start (core/config/yaml/default.ts), before anyone edits it.
CONTINUE_FIRST_CONFIG = "name: Local Config\nversion: 1.0.0\nschema: v1\nmodels: []\n"


def node(mode: str, payload: dict, tmp_path: Path) -> dict | list:
    """Run one mode of tests/continue/contract.mjs; its stdout's JSON."""
    if shutil.which("node") is None:
        pytest.fail("node is not on PATH: the Continue contract tests need Node.js (>= 20)")
    if not (HARNESS / "node_modules" / "@continuedev" / "openai-adapters").is_dir():
        pytest.fail("Continue's packages are not installed: `make test` installs them "
                    "(or `npm ci --prefix tests/continue`)")
    arg = tmp_path / f"{mode}-{uuid.uuid4().hex[:6]}.json"
    arg.write_text(json.dumps(payload))
    # No proxy: the harness only talks to the front door on the loopback.
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    done = subprocess.run(["node", str(HARNESS / "contract.mjs"), mode, str(arg)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"contract.mjs {mode} failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def door(kafka, tiny_model, tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("continue"), kafka_bootstrap=kafka.settings.kafka_bootstrap,
                             model=tiny_model, completions_port=0, feedback_port=0)
    ensure_topics(settings)
    server = ThreadServer(settings)
    server.settings = settings
    server.user = f"dev-{uuid.uuid4().hex[:6]}"
    server.key = KeyStore(settings.keys_file).add("acme", server.user)
    yield server
    server.stop()


# -- the config ------------------------------------------------------------------------------------------

ADDRESSES = {"completions": "http://127.0.0.1:8081/v1", "feedback": "http://127.0.0.1:8082", "auth": "keys"}


def test_printed_and_merged_configs_load_in_continue(tmp_path):
    whole = tmp_path / "printed.yaml"
    cli = subprocess.run([sys.executable, "-m", "tabloop.cli", "continue", "config"], capture_output=True, text=True,
                         env={**os.environ, "TABLOOP_STATE_DIR": str(tmp_path / "state")}, timeout=60)
    assert cli.returncode == 0, cli.stderr
    whole.write_text(cli.stdout)
    merged = tmp_path / "config.yaml"
    merged.write_text(CONTINUE_FIRST_CONFIG)
    backup = merge_continue_config(merged, ADDRESSES, "sk-test")
    assert backup.read_text() == CONTINUE_FIRST_CONFIG
    # A config of someone's own: their models and data stay, a previous tabloop entry is replaced.
    own = tmp_path / "own.yaml"
    own.write_text("name: Mine\nversion: 0.0.1\nschema: v1\nmodels:\n  - name: chat\n    provider: ollama\n"
                   "    model: llama3\n  - name: tabloop\n    provider: openai\n    model: old\n"
                   "context:\n  - provider: code\n")
    merge_continue_config(own, ADDRESSES, "sk-test")
    result = node("config", {"files": [str(whole), str(merged), str(own)]}, tmp_path)
    for path in (whole, merged, own):
        assert result[str(path)]["parsed"] and result[str(path)]["errors"] == [], result[str(path)]
        assert result[str(path)]["data"] == ["tabloop"]
    assert result[str(whole)]["models"] == result[str(merged)]["models"] == ["tabloop"]
    assert result[str(own)]["models"] == ["chat", "tabloop"] and "context:" in own.read_text()


def test_merge_refuses_a_file_it_cannot_read_and_leaves_it(tmp_path):
    broken = tmp_path / "config.yaml"
    broken.write_text("models: [\n")
    with pytest.raises(ContinueConfigError, match="not YAML"):
        merge_continue_config(broken, ADDRESSES, None)
    assert broken.read_text() == "models: [\n" and not list(tmp_path.glob("*.bak*"))
    broken.write_text("models: {a: 1}\n")
    with pytest.raises(ContinueConfigError, match="'models' is a dict, not a list"):
        merge_continue_config(broken, ADDRESSES, None)


# -- the client ------------------------------------------------------------------------------------------

FIM_SUFFIX = "\n\nprint(add(1, 2))\n"


def test_openai_adapters_and_stream_sse_against_the_front_door(door, tmp_path):
    out = node("client", {"base": f"{door.completions_url}/v1/", "key": door.key, "badKey": "sk-wrong",
                          "prompt": "def add(a, b):\n    return", "suffix": FIM_SUFFIX}, tmp_path)
    assert out["stream"]["finish"] in ("stop", "length") and len(out["stream"]["ids"]) == 1
    assert out["nonStream"]["id"].startswith("cmpl-")
    usage = out["nonStream"]["usage"]
    assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # fimStream: 404 before issue 14; now one completion, read as Continue reads it (delta.content).
    assert "error" not in out["fim"], out["fim"]
    assert len(out["fim"]["ids"]) == 1 and out["fim"]["objects"] == ["chat.completion.chunk"]
    assert out["abort"]["id"]  # the adapter ends the stream quietly when aborted; the server's event says it
    assert not out["wrongKey"]["ok"] and out["wrongKey"]["status"] == 401
    for name in ("sseCompletions", "sseFim"):
        sse = out[name]
        assert sse["status"] == 200 and sse["usage"]["total_tokens"] >= sse["usage"]["prompt_tokens"] > 0, sse
    # The FIM route is the same run as /v1/completions: its event, the prompt built from prefix and suffix.
    fim_id = out["sseFim"]["completionId"]
    [event] = find_events(door.settings, COMPLETIONS.name, lambda e: e.record["completion_id"] == fim_id)
    r = event.record
    assert (r["prefix"], r["suffix"], r["user_id"]) == ("def add(a, b):\n    return", FIM_SUFFIX, door.user)
    assert r["completion_text"] == out["sseFim"]["text"]
    [aborted] = find_events(door.settings, COMPLETIONS.name,
                            lambda e: e.record["completion_id"] == out["abort"]["id"])
    assert aborted.record["aborted"] and aborted.record["finish_reason"] == "abort"


def test_openai_python_sees_complete_usage(door):
    c = openai.OpenAI(base_url=f"{door.completions_url}/v1", api_key=door.key, max_retries=0)
    usage = c.completions.create(model="tiny", prompt="import os\n", max_tokens=6).usage
    assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    chunks = list(c.completions.create(model="tiny", prompt="import os\n", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == usage.prompt_tokens


# -- feedback: Continue's data: destination ------------------------------------------------------------------

def continue_prompt(prefix: str, path: str) -> str:
    """The prompt Continue writes for a Qwen coder model (its FIM template, the current file's header)."""
    return f"<|repo_name|>demo\n<|file_sep|>{path}\n<|fim_prefix|>{prefix}<|fim_suffix|>{FIM_SUFFIX}<|fim_middle|>"


def serve(door, prompt: str) -> tuple[str, str]:
    """(completion id, text) of a completion with at least 3 characters of text, as Continue requests one."""
    for seed in range(40):
        resp = httpx.post(f"{door.completions_url}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {door.key}"},
                          json={"model": "qwen2.5-coder-1.5b", "prompt": prompt, "max_tokens": 12, "seed": seed,
                                "temperature": 1.0, "stream": True})
        chunks = [json.loads(line[6:]) for line in resp.text.split("\n") if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        if len(text) >= 3:
            return resp.headers["x-tabloop-completion-id"], text
    pytest.fail("the tiny model gave no completion of 3 characters in 40 seeds")


def autocomplete(prompt: str, completion: str, accepted: bool, path: str, client_id: str) -> dict:
    """What Continue's AutocompleteLoggingService logs for one suggestion; `time` is its generation time."""
    from policy.fim import parse_prompt

    parsed = parse_prompt(prompt)
    return {"accepted": accepted, "time": 180, "prefix": parsed.prefix, "suffix": parsed.suffix, "prompt": prompt,
            "completion": completion, "modelProvider": "openai", "modelName": "qwen2.5-coder-1.5b",
            "cacheHit": False, "filepath": f"file:///work/{path}", "gitRepo": "demo", "completionId": client_id,
            "uniqueId": f"u-{client_id}"}


def test_data_payloads_built_by_continue_become_the_right_episodes(door, tmp_path):
    run = uuid.uuid4().hex[:6]
    served = {}
    for case in ("accepted", "rejected", "nocode", "reuse"):
        prefix = f"# {case} {run}\ndef add(a, b):\n"
        prompt = continue_prompt(prefix, f"{case}.py")
        served[case] = (prompt, prefix, *serve(door, prompt))
    events = []
    for case, accepted in (("accepted", True), ("rejected", False)):
        prompt, _, _, text = served[case]
        events.append({"name": "autocomplete", "level": "all",
                       "fields": autocomplete(prompt, text, accepted, f"{case}.py", f"{case}-{run}")})
    prompt, _, _, text = served["nocode"]
    events.append({"name": "autocomplete", "level": "noCode",
                   "fields": autocomplete(prompt, text, True, "nocode.py", f"nocode-{run}")})
    events.append({"name": "tokensGenerated", "level": "all",
                   "fields": {"model": "qwen2.5-coder-1.5b", "provider": "openai", "promptTokens": 40,
                              "generatedTokens": 12}})
    # Generator reuse: the user typed the suggestion's first two characters; Continue made no request, and
    # logs the prompt rebuilt for the longer prefix with the rest of the suggestion.
    _, prefix, _, text = served["reuse"]
    typed = text[:2]
    events.append({"name": "autocomplete", "level": "all",
                   "fields": autocomplete(continue_prompt(prefix + typed, "reuse.py"), text[2:], True, "reuse.py",
                                          f"reuse-{run}")})
    sent = node("devdata", {"destination": f"{door.feedback_url}/api/continue/events", "apiKey": door.key,
                            "events": events}, tmp_path)
    assert [s["built"] for s in sent] == [True] * 5, sent
    assert [s["status"] for s in sent] == [202] * 5, sent
    assert sent[3]["body"] == {"event_id": None, "ignored": "tokensGenerated"}
    assert "prompt" not in sent[2]["sentKeys"] and "completion" not in sent[2]["sentKeys"]

    ids = {s["body"]["event_id"] for s in sent if s["body"]["event_id"]}
    feedbacks = find_events(door.settings, FEEDBACK.name, lambda e: e.event_id in ids, want=len(ids))
    assert len(feedbacks) == 4
    assert {f.record["client_time_ms"] for f in feedbacks} == {180}  # Continue's time: not a decision time
    assert {f.record["time_to_decision_ms"] for f in feedbacks} == {None}
    cids = {case: cid for case, (_, _, cid, _) in served.items()}
    completions = find_events(door.settings, COMPLETIONS.name, lambda e: e.record["completion_id"] in cids.values(),
                              want=4)
    # The join's own pipeline, in the order the worker would see these events.
    pipe = JoinPipeline()
    episodes = []
    for e in sorted(completions, key=lambda e: e.record["served_at"]):
        episodes += pipe.completion(e.record)
    for f in sorted(feedbacks, key=lambda e: e.record["received_at"]):
        episodes += pipe.feedback(f.record)
    last = max(f.record["received_at"] for f in feedbacks)
    pipe.matcher.stream_time = int(last.timestamp() * 1000) + pipe.config.max_lateness_ms + 1  # let waits end
    episodes += pipe.tick()
    by_completion = {ep.record["completion_id"]: ep.record for ep in episodes}
    assert pipe.counts["no_code"] == 1 and pipe.counts["unmatched"] == 0, pipe.counts
    expect = {"accepted": ("ACCEPTED", 0.75), "rejected": ("REJECTED", -0.25), "reuse": ("ACCEPTED", 0.75)}
    for case, (outcome, reward) in expect.items():
        ep = by_completion[cids[case]]
        assert (ep["outcome"], ep["reward"], ep["matched"], ep["policy_version"]) == (outcome, reward, True, 0), case
        assert ep["time_to_decision_ms"] is not None and ep["time_to_decision_ms"] >= 0
    assert by_completion[cids["reuse"]]["completion_text"] == served["reuse"][3]
    assert cids["nocode"] not in by_completion


def test_continue_time_is_stored_as_generation_time():
    body = {"name": "autocomplete", "data": {"accepted": True, "time": 250, "prompt": "p", "completion": "c"}}
    r = feedback.from_continue_data(body, project_id="p", user_id="u").record
    assert (r["client_time_ms"], r["time_to_decision_ms"]) == (250, None)


def test_endpoints_in_the_config_are_the_systems(tmp_path):
    s = make_settings(tmp_path, completions_port=9181, feedback_port=9182)
    text = continue_config(endpoints(s), "sk-x")
    assert "apiBase: http://127.0.0.1:9181/v1" in text
    assert "destination: http://127.0.0.1:9182/api/continue/events" in text and "apiKey: sk-x" in text


# -- generator reuse through the real worker ---------------------------------------------------------------

@pytest.mark.timeout(300)  # a broker and a worker starting on shared cores
def test_the_streams_worker_joins_a_reused_suggestion(own_kafka, tmp_path):
    """The Faust worker's path (prompt stage, then the reuse key, then the episode stage), not only the pure
    pipeline: a Continue acceptance of a reused suggestion, as the front door stores it, becomes a matched
    episode credited to the version that served it."""
    from datetime import datetime, timezone

    from infra.bus import EventProducer, read_topic
    from schemas.events import new_event
    from tests.test_streams import start_worker, stop
    from tests.system_helpers import wait

    settings = make_settings(tmp_path, kafka_bootstrap=own_kafka.settings.kafka_bootstrap, join_window_s=60,
                             join_lateness_s=2, idle_close_s=3)
    ensure_topics(settings)
    prefix, text = "def add(a, b):\n", "    return a + b"
    prompt = continue_prompt(prefix, "src/m.py")
    now = datetime.now(timezone.utc)
    served = new_event(
        "CompletionServed", completion_id="cmpl-reuse", served_at=now, project_id="acme", user_id="dev",
        model="tiny", policy_version=3, prompt=prompt, prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(),
        prefix=prefix, suffix=FIM_SUFFIX, filepath="src/m.py", completion_text=text,
        completion_token_ids=[11, 12, 13], completion_logprobs=[-0.1, -0.2, -0.3], completion_token_ends=[6, 12, 16],
        finish_reason="stop", aborted=False, temperature=0.7, top_p=1.0, max_tokens=16, ttft_ms=1.0,
        latency_ms=2.0, replica_id="r")
    body = {"name": "autocomplete", "schema": "0.2.0", "level": "all",
            "data": autocomplete(continue_prompt(prefix + "    ret", "src/m.py"), "urn a + b", True, "src/m.py",
                                 "reuse-1")}
    fb = feedback.from_continue_data(body, project_id="acme", user_id="dev")
    worker = start_worker(settings, "streams.log")
    try:
        with EventProducer(settings) as producer:
            producer.publish(served)
            producer.publish(fb)

        def episode():
            found = [r.event.record for r in read_topic(settings, "tabloop.episodes") if r.event]
            return found or None

        [ep] = wait(episode, 150, "the reused suggestion's episode")
    finally:
        stop(worker)
    assert (ep["completion_id"], ep["matched"], ep["policy_version"], ep["outcome"], ep["reward"]) == (
        "cmpl-reuse", True, 3, "ACCEPTED", 0.75)
    assert ep["completion_text"] == text and ep["completion_token_ids"] == [11, 12, 13]
