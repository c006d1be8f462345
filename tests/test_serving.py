"""The front door over real HTTP: the openai client, Continue-shaped requests, feedback, auth, events on Kafka."""

from __future__ import annotations

import hashlib
import json

import httpx
import openai
import pytest

from infra.bus import ensure_topics
from schemas.token_ids import prompt_ids
from schemas.topics import COMPLETIONS, FEEDBACK
from infra.auth import KeyStore
from tests.conftest import make_settings
from tests.serving_helpers import ThreadServer, find_events, unique
from tests.system_helpers import wait

pytestmark = pytest.mark.kafka

CONTINUE_STOPS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                  "<|repo_name|>", "<|file_sep|>", "<|im_start|>", "<|im_end|>", "\n\n", "\r\n\r\n", "/src/",
                  "#- coding: utf-8", "```"]
CONTINUE_PROMPT = ("<|repo_name|>tabloop\n<|file_sep|>util/strings.py\ndef shout(s):\n    return s.upper()\n"
                   "<|file_sep|>app/main.py\n<|fim_prefix|>from util.strings import shout\n\n"
                   "def greet(name):\n    return <|fim_suffix|>\n\nprint(greet('x'))\n<|fim_middle|>")


@pytest.fixture(scope="module")
def served(kafka, tiny_model, tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("serve"), kafka_bootstrap=kafka.settings.kafka_bootstrap,
                             model=tiny_model, completions_port=0, feedback_port=0)
    ensure_topics(settings)
    keys = KeyStore(settings.keys_file)
    server = ThreadServer(settings)
    server.keys = {"alice": keys.add("acme", "alice"), "bob": keys.add("globex", "bob"),
                   "slow": keys.add("acme", "slowpoke", rate_per_minute=2)}
    server.settings = settings
    yield server
    server.stop()


def client(served, who="alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.completions_url}/v1", api_key=served.keys[who], max_retries=0)


def continue_headers(key: str) -> dict:
    return {"Authorization": f"Bearer {key}", "api-key": key, "Content-Type": "application/json"}


def sse_chunks(text: str) -> list[dict]:
    lines = [line for line in text.split("\n") if line]
    assert lines[-1] == "data: [DONE]"
    assert not any(line.startswith(":") for line in lines), "SSE comments end Continue's stream"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_openai_client_non_streaming(served):
    raw = client(served).completions.with_raw_response.create(
        model="tiny", prompt="import os\n", max_tokens=12, temperature=0.8, seed=1)
    completion = raw.parse()
    assert completion.id.startswith("cmpl-")
    assert raw.headers["x-tabloop-completion-id"] == completion.id
    assert raw.headers["x-tabloop-policy-version"] == "0"
    assert completion.choices[0].finish_reason in ("stop", "length")
    [event] = find_events(served.settings, COMPLETIONS.name, lambda e: e.record["completion_id"] == completion.id)
    r = event.record
    assert r["completion_text"] == completion.choices[0].text
    assert len(r["completion_token_ids"]) == len(r["completion_logprobs"]) >= 1
    assert all(lp <= 0 for lp in r["completion_logprobs"])
    assert (r["project_id"], r["user_id"], r["policy_version"], r["aborted"]) == ("acme", "alice", 0, False)
    assert r["prompt_sha256"] == hashlib.sha256(b"import os\n").hexdigest()
    assert r["temperature"] == 0.8


def test_openai_client_streams_token_by_token(served):
    stream = client(served).completions.create(model="tiny", prompt="def main():\n", max_tokens=24,
                                               temperature=1.0, seed=3, stream=True)
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks]
    assert len([t for t in texts if t]) > 1, "a multi-token completion must arrive in more than one chunk"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert len({c.id for c in chunks}) == 1
    [event] = find_events(served.settings, COMPLETIONS.name, lambda e: e.record["completion_id"] == chunks[0].id)
    assert event.record["completion_text"] == "".join(texts)


def test_stop_strings_are_honoured(served):
    c = client(served)
    full = c.completions.create(model="tiny", prompt="class A:\n", max_tokens=30, temperature=1.0, seed=11)
    text = full.choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    cut = c.completions.create(model="tiny", prompt="class A:\n", max_tokens=30, temperature=1.0, seed=11,
                               stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="class A:\n", max_tokens=30, temperature=1.0, seed=11, stop=[stop], stream=True))
    assert streamed == cut.choices[0].text


def test_continue_shaped_request(served):
    key = served.keys["alice"]
    body = {"model": "qwen2.5-coder-1.5b", "prompt": CONTINUE_PROMPT, "max_tokens": 40, "temperature": 0.01,
            "top_p": 1, "frequency_penalty": 0, "presence_penalty": 0, "stop": CONTINUE_STOPS, "stream": True}
    resp = httpx.post(f"{served.completions_url}/v1/completions", json=body, headers=continue_headers(key),
                      timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(resp.text)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert not any(s in text for s in CONTINUE_STOPS)
    cid = resp.headers["x-tabloop-completion-id"]
    [event] = find_events(served.settings, COMPLETIONS.name, lambda e: e.record["completion_id"] == cid)
    r = event.record
    assert r["completion_text"] == text
    assert r["filepath"] == "app/main.py"
    assert r["prefix"].endswith("def greet(name):\n    return ") and r["suffix"] == "\n\nprint(greet('x'))\n"
    # Older Continue's near-greedy 0.01 is served greedily, or sampled at the exploration temperature when the
    # exploration coin (a hash of the completion id) names it; recorded, both.
    from policy.exploration import explores

    explored = explores(cid, served.settings.exploration_share, served.settings.exploration_seed)
    assert r["prompt"] == CONTINUE_PROMPT and r["requested_temperature"] == 0.01
    assert (r["temperature"], r["explored"], r["exploration_share"]) == (0.7 if explored else 0.0, explored, 0.1)
    # The ids the model was fed (the prompt was not trimmed: the same as encoding it), packed (v5), the
    # array left empty.
    assert r["prompt_token_ids"] == [] and prompt_ids(r) == served.server.engine.tokenizer.encode(CONTINUE_PROMPT, add_special_tokens=False)
    assert len(r["completion_token_ids"]) == len(r["completion_logprobs"]) >= 1


def test_suffix_builds_the_fim_prompt(served):
    resp = httpx.post(f"{served.completions_url}/v1/completions", headers=continue_headers(served.keys["alice"]),
                      json={"prompt": "def f(x):\n    return ", "suffix": "\n", "max_tokens": 4}, timeout=30)
    assert resp.status_code == 200
    cid = resp.json()["id"]
    [event] = find_events(served.settings, COMPLETIONS.name, lambda e: e.record["completion_id"] == cid)
    assert event.record["prompt"] == "<|fim_prefix|>def f(x):\n    return <|fim_suffix|>\n<|fim_middle|>"
    assert event.record["prefix"] == "def f(x):\n    return " and event.record["suffix"] == "\n"


def test_disconnect_stops_generation_and_records_abort(served):
    body = {"prompt": "import sys\n", "max_tokens": 256, "temperature": 1.0, "seed": 5, "stream": True,
            "stop": []}
    received = ""
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{served.completions_url}/v1/completions", json=body,
                         headers=continue_headers(served.keys["alice"])) as resp:
            cid = resp.headers["x-tabloop-completion-id"]
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    received += json.loads(line[6:])["choices"][0]["text"]
                    if received:
                        break  # the user kept typing: Continue drops the request
    [event] = find_events(served.settings, COMPLETIONS.name, lambda e: e.record["completion_id"] == cid)
    r = event.record
    assert r["aborted"] is True and r["finish_reason"] == "abort"
    assert r["completion_text"].startswith(received)
    assert 1 <= len(r["completion_token_ids"]) < 256


def fork_payload(prompt: str, accepted: bool = True) -> dict:
    return {"completionId": unique("continue"), "filepath": "/repo/a.py", "prefix": "x = ", "suffix": "\n",
            "prompt": prompt, "completion": "1", "modelProvider": "openai", "modelName": "qwen2.5-coder",
            "accepted": accepted, "timestamp": "2026-11-30T00:00:00Z", "time": 1234, "uniqueId": "machine-1",
            "numLines": 1, "cacheHit": False}


def test_every_feedback_shape_lands_once_on_kafka(served):
    key = served.keys["alice"]
    post = lambda path, body, **kw: httpx.post(f"{served.feedback_url}{path}", json=body,  # noqa: E731
                                               headers={**continue_headers(key), **kw.get("headers", {})})
    prompt = unique("<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>")
    fork = post("/api/training/submit", fork_payload(prompt, accepted=False), headers={"X-Project-ID": "acme"})
    data_event = {"name": "autocomplete", "schema": "0.2.0", "level": "all", "profileId": "local",
                  "data": {**fork_payload(prompt), "eventName": "autocomplete", "userId": "u1",
                           "gitRepo": "git@x:y.git"}}
    stock = post("/api/continue/events", data_event)
    no_code = post("/api/continue/events", {**data_event, "level": "noCode", "data": {
        k: v for k, v in data_event["data"].items() if k not in ("prefix", "suffix", "prompt", "completion")}})
    other = post("/api/continue/events", {"name": "chatInteraction", "data": {"x": 1}, "schema": "0.2.0"})
    ours = post("/v1/feedback", {"completion_id": "cmpl-123", "outcome": "partial", "accepted_text": "ab"})
    for resp in (fork, stock, no_code, ours):
        assert resp.status_code == 202, resp.text
    assert other.status_code == 202 and other.json()["event_id"] is None
    ids = {resp.json()["event_id"]: resp for resp in (fork, stock, no_code, ours)}
    events = find_events(served.settings, FEEDBACK.name, lambda e: e.event_id in ids, want=4)
    assert sorted(e.event_id for e in events) == sorted(ids)  # each exactly once
    by_id = {e.event_id: e.record for e in events}
    f, s, n, o = (by_id[r.json()["event_id"]] for r in (fork, stock, no_code, ours))
    assert (f["source"], f["outcome"], f["prompt_sha256"]) == ("continue-fork", "REJECTED",
                                                               hashlib.sha256(prompt.encode()).hexdigest())
    assert (s["source"], s["outcome"], s["accepted_chars"]) == ("continue-data", "ACCEPTED", 1)
    assert n["prompt"] is None and n["completion"] is None and n["outcome"] == "ACCEPTED"
    assert (o["source"], o["completion_id"], o["outcome"], o["accepted_chars"]) == ("api", "cmpl-123", "PARTIAL", 2)
    assert all(r["project_id"] == "acme" and r["user_id"] == "alice" for r in by_id.values())
    assert json.loads(f["raw_payload"])["completionId"] == json.loads(fork.request.content)["completionId"]


@pytest.mark.parametrize("path,body,status,names", [
    ("/api/training/submit", {"completion": "x"}, 400, "accepted"),
    ("/api/training/submit", {"accepted": "yes"}, 400, "accepted"),
    ("/api/training/submit", {"accepted": True, "time": "soon"}, 400, "time"),
    ("/api/training/submit", [1, 2], 400, "object"),
    ("/api/continue/events", {"name": "autocomplete"}, 400, "data"),
    ("/api/continue/events", {"name": "autocomplete", "data": {"accepted": 1}}, 400, "data.accepted"),
    ("/v1/feedback", {"accepted": True}, 400, "completion_id"),
    ("/v1/feedback", {"completion_id": "c", "outcome": "MAYBE"}, 400, "outcome"),
    ("/v1/feedback", {"completion_id": "c", "outcome": "PARTIAL"}, 400, "accepted_text"),
])
def test_malformed_feedback_gets_4xx_naming_the_field(served, path, body, status, names):
    resp = httpx.post(f"{served.feedback_url}{path}", json=body, headers=continue_headers(served.keys["alice"]))
    assert resp.status_code == status
    assert names in resp.json()["error"]["message"]


def test_bad_json_and_oversized_bodies(served):
    headers = continue_headers(served.keys["alice"])
    bad = httpx.post(f"{served.feedback_url}/v1/feedback", content=b"{not json", headers=headers)
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    big = httpx.post(f"{served.feedback_url}/api/training/submit", headers=headers,
                     content=json.dumps({"accepted": True, "prompt": "x" * 5_000_000}).encode())
    assert big.status_code == 413
    bad_completion = httpx.post(f"{served.completions_url}/v1/completions", headers=headers,
                                json={"prompt": "x", "max_tokens": "many"})
    assert bad_completion.status_code == 400 and bad_completion.json()["error"]["param"] == "max_tokens"


def test_auth_and_rate_limits(served):
    url = f"{served.feedback_url}/v1/feedback"
    body = {"completion_id": "c", "accepted": True}
    assert httpx.post(url, json=body).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer tlk_00000000_nope"}).status_code == 401
    other = httpx.post(url, json=body, headers={**continue_headers(served.keys["alice"]), "X-Project-ID": "globex"})
    assert other.status_code == 403
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.completions_url}/v1", api_key="wrong", max_retries=0).completions.create(
            model="x", prompt="x", max_tokens=1)
    slow = continue_headers(served.keys["slow"])
    statuses = [httpx.post(url, json=body, headers=slow).status_code for _ in range(3)]
    assert statuses[:2] == [202, 202] and statuses[2] == 429
    limited = httpx.post(url, json=body, headers=slow)
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1


def test_health_ready_metrics(served):
    for base in (served.completions_url, served.feedback_url):
        assert httpx.get(f"{base}/healthz").json() == {"ok": True}
        ready = httpx.get(f"{base}/readyz")
        assert ready.status_code == 200 and ready.json()["model"] is True
    client(served).completions.create(model="tiny", prompt="x", max_tokens=2)
    metrics = httpx.get(f"{served.completions_url}/metrics").text
    count = [line for line in metrics.splitlines() if line.startswith("tabloop_completion_latency_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1
    assert "tabloop_spool_depth 0.0" in metrics and "tabloop_policy_version 0.0" in metrics
    assert "tabloop_completion_ttft_seconds_bucket" in metrics


def test_kafka_outage_loses_nothing_acknowledged(served, kafka):
    """Kafka stops: completions are still served, feedback still gets 202; after it returns every
    acknowledged event is on its topic exactly once."""
    headers = continue_headers(served.keys["alice"])
    kafka.stop()
    try:
        acked, completion_ids = [], []
        for i in range(20):
            resp = httpx.post(f"{served.feedback_url}/v1/feedback", headers=headers, timeout=30,
                              json={"completion_id": f"cmpl-outage-{i}", "accepted": i % 2 == 0})
            assert resp.status_code == 202, resp.text
            acked.append(resp.json()["event_id"])
            c = httpx.post(f"{served.completions_url}/v1/completions", headers=headers, timeout=30,
                           json={"prompt": f"x{i} = ", "max_tokens": 3})
            assert c.status_code == 200
            completion_ids.append(c.json()["id"])
        assert served.server.publisher.depth() > 0
    finally:
        kafka.start()
    feedback = find_events(served.settings, FEEDBACK.name, lambda e: e.event_id in set(acked), want=len(acked),
                           timeout_s=60)
    assert sorted(e.event_id for e in feedback) == sorted(acked)  # all there, none twice
    completions = find_events(served.settings, COMPLETIONS.name,
                              lambda e: e.record["completion_id"] in set(completion_ids), want=20, timeout_s=60)
    assert sorted(e.record["completion_id"] for e in completions) == sorted(completion_ids)
    wait(lambda: served.server.publisher.depth() == 0, 30, "the publisher's queue to drain", poll_s=0.2)
    assert served.server.publisher.kafka_ok()


def test_server_side_caps_and_exploration_temperature(kafka, tiny_model, tmp_path):
    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap, model=tiny_model,
                             completions_port=0, feedback_port=0, auth="open", max_prompt_tokens=40,
                             max_new_tokens=5, exploration_temperature=0.0)
    ensure_topics(settings)
    server = ThreadServer(settings)
    try:
        long_prefix = "".join(f"value_{i} = compute({i})\n" for i in range(60))
        prompt = f"<|fim_prefix|>{long_prefix}<|fim_suffix|>\nprint(done)\n<|fim_middle|>"
        resp = httpx.post(f"{server.completions_url}/v1/completions", timeout=30,
                          json={"prompt": prompt, "max_tokens": 500, "temperature": 0.9})
        assert resp.status_code == 200
        [event] = find_events(settings, COMPLETIONS.name, lambda e: e.record["completion_id"] == resp.json()["id"])
        r = event.record
        assert r["temperature"] == 0.0 and r["max_tokens"] == 5 and len(r["completion_token_ids"]) <= 5
        assert (r["explored"], r["exploration_share"]) == (False, None)  # the override flips no coin
        seen = r["prompt"]
        assert len(server.server.engine.tokenizer.encode(seen, add_special_tokens=False)) <= 40
        # The top of the prefix went; the FIM tokens, the end of the prefix and the suffix stayed.
        assert seen.startswith("<|fim_prefix|>") and seen.endswith("<|fim_suffix|>\nprint(done)\n<|fim_middle|>")
        assert "value_59 = compute(59)\n" in seen and "value_0 = " not in seen
        assert r["prompt_sha256"] == hashlib.sha256(prompt.encode()).hexdigest()  # the client's prompt
    finally:
        server.stop()


def test_engines_are_made_by_their_registered_name(tmp_path, tiny_model):
    import asyncio

    from serving.engines import ENGINES, UnknownEngine, make_engine
    from serving.engines.transformers_engine import TransformersEngine
    from serving.engines.vllm_engine import VLLMEngine

    assert set(ENGINES) == {"transformers", "vllm"}
    with pytest.raises(UnknownEngine, match="no engine named 'tgi'.*transformers, vllm"):
        make_engine(make_settings(tmp_path, engine="tgi"))
    vllm = make_engine(make_settings(tmp_path, engine="vllm", vllm_urls="http://127.0.0.1:9", model=tiny_model))
    assert type(vllm) is VLLMEngine
    asyncio.run(vllm.close())
    local = make_engine(make_settings(tmp_path, model=tiny_model, device="auto"))
    assert type(local) is TransformersEngine and local.device == "cpu"
    asyncio.run(local.close())
