"""The vllm engine against real OpenAI-compatible servers: two other `tabloop serve` processes.

(vLLM itself can't be installed here; the engine is described under "Engines" in docs/front-door.md.)
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
    """An HTTP server speaking the two vLLM routes the engine uses, recording every request: the dynamic
    LoRA route (``/v1/load_lora_adapter``, as ``vllm serve --enable-lora`` with
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` serves it) and a one-token streamed ``/v1/completions``."""

    def __init__(self, lora_status: int = 200, lora_text: str = "Success: LoRA adapter loaded"):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[str, dict]] = []
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                replica.requests.append((self.path, body))
                if self.path == "/v1/load_lora_adapter":
                    self._answer(lora_status, "text/plain", lora_text.encode())
                elif self.path == "/v1/completions":
                    chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [42], "prompt_token_ids": [1, 2],
                                          "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length"}]}
                    self._answer(200, "text/event-stream", f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
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
        assert asked == ["tabloop-v3", tiny_model]  # round robin: the adapter by name, then the base again
        assert [(s.token_id, s.logprob, s.policy_version) for s in steps] == [(42, -0.5, 3)]
        assert version_after_full == 3 and final_version == 0 and back_to_base[0].policy_version == 0

        bad = make_settings(tmp_path / "bad", model=tiny_model, engine="vllm", vllm_urls=failing.url)

        async def refused():
            engine = VLLMEngine(bad)
            try:
                with pytest.raises(RuntimeError, match=f"{failing.url} could not load adapter tabloop-v5: 500"):
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
