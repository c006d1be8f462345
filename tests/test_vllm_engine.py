"""The vllm engine against real OpenAI-compatible servers: two other `tabloop serve` processes, and recording
stand-ins speaking the vLLM routes as vLLM 0.32 answers them (the engine is described under "Engines" in
docs/front-door.md). Against a real vLLM: tests/test_vllm_drill.py (`make vllm-drills`).
"""

from __future__ import annotations

import openai
import pytest

from infra.bus import ensure_topics
from schemas.token_ids import prompt_ids
from schemas.topics import COMPLETIONS
from infra.auth import KeyStore
from tests.conftest import make_settings
from tests.serving_helpers import ProcessServer, ThreadServer, find_events

pytestmark = pytest.mark.kafka


def test_round_robin_logprobs_and_failover(kafka, tiny_model, tmp_path):
    bootstrap = kafka.settings.kafka_bootstrap
    replicas = []
    for name in ("replica-a", "replica-b"):
        (tmp_path / name).mkdir()
        s = make_settings(tmp_path / name, kafka_bootstrap=bootstrap, model=tiny_model)
        replicas.append(ProcessServer(s, TABLOOP_AUTH="open", TABLOOP_REPLICA_ID=name))
    try:
        front = make_settings(tmp_path / "front", kafka_bootstrap=bootstrap, model=tiny_model, engine="vllm",
                              vllm_urls=",".join(r.completions_url for r in replicas), completions_port=0,
                              feedback_port=0, replica_id="front")
        ensure_topics(front)
        key = KeyStore(front.keys_file).add("acme", "ann")
        server = ThreadServer(front)
        try:
            client = openai.OpenAI(base_url=f"{server.completions_url}/v1", api_key=key, max_retries=0)
            ids = []
            for i in range(6):
                stream = client.completions.create(model="x", prompt=f"def g{i}():\n", max_tokens=8,
                                                   temperature=1.0, seed=i, stream=True)
                chunks = list(stream)
                ids.append(chunks[0].id)
            front_events = find_events(front, COMPLETIONS.name, lambda e: e.record["completion_id"] in ids, want=6)
            assert len(front_events) == 6
            # Each remote replica recorded its own completion of the same prompt: same tokens, same logprobs.
            remote = find_events(front, COMPLETIONS.name, lambda e: e.record["replica_id"] in ("replica-a", "replica-b"),
                                 want=6)
            assert {e.record["replica_id"] for e in remote} == {"replica-a", "replica-b"}  # round robin
            by_prompt = {e.record["prompt"]: e.record for e in remote}
            for e in front_events:
                r = e.record
                twin = by_prompt[r["prompt"]]
                assert r["completion_token_ids"] == twin["completion_token_ids"][:len(r["completion_token_ids"])]
                assert len(r["completion_token_ids"]) == len(r["completion_logprobs"]) >= 1
                assert r["completion_logprobs"] == pytest.approx(
                    twin["completion_logprobs"][:len(r["completion_logprobs"])], abs=1e-5)
                assert r["replica_id"] == "front" and r["project_id"] == "acme"
                # The replica tokenized the prompt text itself and said which ids it fed: those are recorded.
                assert prompt_ids(r) == prompt_ids(twin) != []

            replicas[1].stop()  # one replica dies: requests keep being answered by the other
            for i in range(4):
                c = client.completions.create(model="x", prompt=f"y{i} = ", max_tokens=4)
                assert c.choices[0].finish_reason in ("stop", "length")
        finally:
            server.stop()
    finally:
        for r in replicas:
            r.stop()


class RecordingReplica:
    """An HTTP server speaking the vLLM routes the engine uses, recording every request, and keeping what a vLLM
    replica keeps: its served name (``--served-model-name``) and its adapters, listed in ``/v1/models`` with a
    ``parent``. The dynamic LoRA routes (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, as ``vllm serve
    --enable-lora`` with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` serves them, answering 400 for a name already
    loaded and 404 for one it does not hold) and a one-token streamed ``/v1/completions`` (404 for a model it
    does not serve; ``usage_chunk``: ending as with ``stream_options.include_usage``, a chunk with no choices)."""

    def __init__(self, lora_status: int = 200, lora_text: str = "Success: LoRA adapter loaded",
                 served_name: str = "base-model", usage_chunk: bool = False, adapters: tuple[str, ...] = ()):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[str, dict]] = []
        self.served_name = served_name
        self.adapters: set[str] = set(adapters)
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                replica.requests.append((self.path, {}))
                if self.path == "/v1/models":
                    data = [{"id": replica.served_name, "object": "model", "parent": None}]
                    data += [{"id": a, "object": "model", "parent": replica.served_name}
                             for a in sorted(replica.adapters)]
                    self._answer(200, "application/json", json.dumps({"object": "list", "data": data}).encode())
                else:
                    self._answer(404, "text/plain", b"no such route")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                replica.requests.append((self.path, body))
                if self.path == "/v1/load_lora_adapter":
                    if lora_status == 200 and body["lora_name"] in replica.adapters:
                        self._answer(400, "text/plain", f"The lora adapter '{body['lora_name']}' has already been "
                                                        "loaded.".encode())
                        return
                    if lora_status == 200 or "already" in lora_text:
                        replica.adapters.add(body["lora_name"])
                    self._answer(lora_status, "text/plain", lora_text.encode())
                elif self.path == "/v1/unload_lora_adapter":
                    if body["lora_name"] not in replica.adapters:
                        self._answer(404, "text/plain", b"The lora adapter cannot be found.")
                        return
                    replica.adapters.discard(body["lora_name"])
                    self._answer(200, "text/plain", b"Success: LoRA adapter unloaded")
                elif self.path == "/v1/completions":
                    if body["model"] != replica.served_name and body["model"] not in replica.adapters:
                        self._answer(404, "application/json", json.dumps(
                            {"error": {"message": f"The model `{body['model']}` does not exist."}}).encode())
                        return
                    chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [42], "prompt_token_ids": [1, 2],
                                          "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length"}]}
                    events = [chunk]
                    if usage_chunk:
                        events.append({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1,
                                                                "total_tokens": 3}})
                    data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                    self._answer(200, "text/event-stream", data.encode())
                else:
                    self._answer(404, "text/plain", b"no such route")

            def _answer(self, status: int, kind: str, data: bytes):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def restart(self) -> None:
        """As a vLLM process restarted: the adapters loaded at run time are gone."""
        self.adapters.clear()

    def posted(self, path: str) -> list[dict]:
        return [body for p, body in self.requests if p == path]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_new_lora_version_is_loaded_on_every_replica_and_then_requested_by_name(tiny_model, tmp_path):
    import asyncio

    from serving.engines.base import GenerationRequest
    from serving.engines.vllm_engine import VLLMEngine

    # The second replica had the adapter already (a restart of the front door): vLLM answers 400 then.
    replicas = [RecordingReplica(), RecordingReplica(400, "The lora adapter 'tabloop-v3' has already been loaded.")]
    failing = RecordingReplica(500, "out of memory")
    try:
        settings = make_settings(tmp_path, model=tiny_model, engine="vllm",
                                 vllm_urls=",".join(r.url for r in replicas))
        request = GenerationRequest(prompt_ids=[], max_new_tokens=4, temperature=1.0, top_p=1.0, prompt_text="a = ")

        async def scenario():
            engine = VLLMEngine(settings)
            try:
                await engine.load_version(3, "file:///weights/base/v000003", "LORA")
                steps = [s async for s in engine.stream(request)]
                with pytest.raises(ValueError, match="LoRA"):
                    await engine.load_version(4, "file:///weights/base/v000004", "FULL")
                version_after_full = engine.policy_version
                await engine.load_version(0, "", "LORA")
                back_to_base = [s async for s in engine.stream(request)]
                return steps, version_after_full, back_to_base, engine.policy_version
            finally:
                await engine.close()

        steps, version_after_full, back_to_base, final_version = asyncio.run(scenario())
        for replica in replicas:
            loads = [body for path, body in replica.requests if path == "/v1/load_lora_adapter"]
            assert loads == [{"lora_name": "tabloop-v3", "lora_path": "/weights/base/v000003"}]
        asked = [body["model"] for r in replicas for path, body in r.requests if path == "/v1/completions"]
        assert asked == ["tabloop-v3", "base-model"]  # round robin: the adapter by name, then the base again
        assert [(s.token_id, s.logprob, s.policy_version) for s in steps] == [(42, -0.5, 3)]
        assert version_after_full == 3 and final_version == 0 and back_to_base[0].policy_version == 0

        bad = make_settings(tmp_path / "bad", model=tiny_model, engine="vllm", vllm_urls=failing.url)

        async def refused():
            engine = VLLMEngine(bad)
            try:
                with pytest.raises(RuntimeError, match=f"{failing.url} could not load adapter tabloop-v5 from /w/v5: 500"):
                    await engine.load_version(5, "file:///w/v5", "LORA")
                return engine.policy_version
            finally:
                await engine.close()

        assert asyncio.run(refused()) == 0  # a refused load leaves serving on what it had
    finally:
        for r in (*replicas, failing):
            r.stop()


def test_each_project_asks_the_replicas_for_its_own_adapter(tiny_model, tmp_path):
    import asyncio
    from dataclasses import replace

    from serving.engines.base import GenerationRequest
    from serving.engines.vllm_engine import VLLMEngine

    replica = RecordingReplica()
    try:
        settings = make_settings(tmp_path, model=tiny_model, engine="vllm", vllm_urls=replica.url)
        request = GenerationRequest(prompt_ids=[], max_new_tokens=4, temperature=1.0, top_p=1.0, prompt_text="a = ")

        async def scenario():
            engine = VLLMEngine(settings)
            try:
                await engine.load_version(3, "file:///w/v3", "LORA", project="alpha")
                await engine.load_version(5, "file:///w/v5", "LORA")  # the shared policy
                served = []
                for project in ("alpha", "beta"):
                    served += [s.policy_version async for s in engine.stream(replace(request, project_id=project))]
                await engine.drop_project("alpha")
                served += [s.policy_version async for s in engine.stream(replace(request, project_id="alpha"))]
                with pytest.raises(ValueError, match="shared policy cannot be dropped"):
                    await engine.drop_project("")
                return served, engine.policy_version
            finally:
                await engine.close()

        served, shared_version = asyncio.run(scenario())
        assert served == [3, 5, 5] and shared_version == 5
        asked = [body["model"] for path, body in replica.requests if path == "/v1/completions"]
        assert asked == ["tabloop-v3", "tabloop-v5", "tabloop-v5"]
    finally:
        replica.stop()


def _engine_scenario(settings, scenario):
    """Run ``scenario(engine)`` on a VLLMEngine over ``settings`` and close it."""
    import asyncio

    from serving.engines.vllm_engine import VLLMEngine

    async def run():
        engine = VLLMEngine(settings)
        try:
            return await scenario(engine)
        finally:
            await engine.close()

    return asyncio.run(run())


def _request(**kw):
    from serving.engines.base import GenerationRequest

    return GenerationRequest(**{"prompt_ids": [], "max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0,
                                "prompt_text": "a = ", **kw})


def test_requests_ask_for_the_name_the_replica_serves_not_the_local_model_path(tiny_model, tmp_path):
    # A replica started with `--served-model-name coder` answers 404 for anything else, the door's model path
    # included; the engine asks the replica's /v1/models what it serves.
    replica = RecordingReplica(served_name="coder")
    try:
        settings = make_settings(tmp_path, model=tiny_model, engine="vllm", vllm_urls=replica.url)

        async def scenario(engine):
            return [s async for s in engine.stream(_request())], [s async for s in engine.stream(_request())]

        first, second = _engine_scenario(settings, scenario)
        assert [(s.token_id, s.logprob) for s in first + second] == [(42, -0.5), (42, -0.5)]
        assert [b["model"] for b in replica.posted("/v1/completions")] == ["coder", "coder"]
        assert [p for p, _ in replica.requests].count("/v1/models") == 1  # asked once, not per request
    finally:
        replica.stop()


def test_the_usage_chunk_with_no_choices_ends_the_stream_cleanly(tiny_model, tmp_path):
    from serving.engines.vllm_engine import _steps

    # vLLM ends a stream with `stream_options.include_usage` (or `--enable-force-include-usage`) so.
    usage = {"id": "cmpl-1", "object": "text_completion", "choices": [],
             "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
    assert _steps(usage, 0) == [] and _steps(usage, 0, greedy=True) == []
    replica = RecordingReplica(usage_chunk=True)
    try:
        settings = make_settings(tmp_path, model=tiny_model, engine="vllm", vllm_urls=replica.url)

        async def scenario(engine):
            return [s async for s in engine.stream(_request())]

        steps = _engine_scenario(settings, scenario)
        assert [(s.token_id, s.logprob, s.finish_reason, s.prompt_token_ids) for s in steps] == \
            [(42, -0.5, "length", (1, 2))]
    finally:
        replica.stop()


def test_versions_no_longer_served_are_unloaded_and_a_restarted_replica_gets_the_served_set(tiny_model, tmp_path):
    # One replica still holds adapters from an earlier front door's life: tabloop-v1 (ours, not served any more)
    # and another team's adapter (not ours: left alone).
    replicas = [RecordingReplica(adapters=("tabloop-v1", "someone-elses")), RecordingReplica()]
    try:
        settings = make_settings(tmp_path, model=tiny_model, engine="vllm",
                                 vllm_urls=",".join(r.url for r in replicas))

        async def scenario(engine):
            held = []
            await engine.load_version(3, "file:///w/v3", "LORA")
            await engine.load_version(3, "file:///w/v3", "LORA", project="alpha")  # alpha on the same version
            held.append([sorted(r.adapters) for r in replicas])
            await engine.load_version(4, "file:///w/v4", "LORA")  # shared moves on; alpha still serves v3
            held.append([sorted(r.adapters) for r in replicas])
            await engine.drop_project("alpha")  # nobody is served v3 any more
            held.append([sorted(r.adapters) for r in replicas])
            for _ in replicas:  # each replica used once: the first is brought to the served set on first use
                [s async for s in engine.stream(_request())]
            held.append([sorted(r.adapters) for r in replicas])
            await engine.load_version(0, "", "LORA")  # rolled back to the base: no adapter served
            held.append([sorted(r.adapters) for r in replicas])
            await engine.load_version(5, "file:///w/v5", "LORA")
            replicas[0].restart()  # comes back with no adapters; the door saw no failure
            replicas[1].restart()
            after_restart = [s.policy_version for _ in replicas async for s in engine.stream(_request())]
            held.append([sorted(r.adapters) for r in replicas])
            return held, after_restart

        held, after_restart = _engine_scenario(settings, scenario)
        assert held[0] == [["someone-elses", "tabloop-v1", "tabloop-v3"], ["tabloop-v3"]]
        assert held[1] == [["someone-elses", "tabloop-v1", "tabloop-v3", "tabloop-v4"], ["tabloop-v3", "tabloop-v4"]]
        assert held[2] == [["someone-elses", "tabloop-v1", "tabloop-v4"], ["tabloop-v4"]]
        assert held[3] == [["someone-elses", "tabloop-v4"], ["tabloop-v4"]]  # the old door's v1 unloaded
        assert held[4] == [["someone-elses"], []]
        assert held[5] == [["tabloop-v5"], ["tabloop-v5"]]  # a restart loses every run-time adapter
        assert after_restart == [5, 5]  # each answered by the adapter, reloaded after a 404, not by the base
        for r in replicas:
            unloads = [b["lora_name"] for b in r.posted("/v1/unload_lora_adapter")]
            assert "someone-elses" not in unloads and unloads.count("tabloop-v3") == 1
    finally:
        for r in replicas:
            r.stop()


def test_an_adapter_is_unloaded_only_after_the_requests_using_it_finish(tiny_model, tmp_path):
    import asyncio

    replica = RecordingReplica()
    try:
        settings = make_settings(tmp_path, model=tiny_model, engine="vllm", vllm_urls=replica.url)

        async def scenario(engine):
            await engine.load_version(3, "file:///w/v3", "LORA")
            stream = engine.stream(_request())
            first = await stream.__anext__()  # a request on v3 is in flight ...
            await engine.load_version(4, "file:///w/v4", "LORA")  # ... when v4 replaces it
            during = sorted(replica.adapters)
            rest = [s async for s in stream]
            await asyncio.sleep(0.2)  # the unload it left behind runs on the loop
            return first, rest, during, sorted(replica.adapters)

        first, rest, during, after = _engine_scenario(settings, scenario)
        assert first.policy_version == 3 and rest == []
        assert during == ["tabloop-v3", "tabloop-v4"] and after == ["tabloop-v4"]
    finally:
        replica.stop()
