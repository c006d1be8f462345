"""The front door's show-gate: which gate a project is served (by hand), and on a real broker gate versions
published, hot-loaded, logged on every completion and rolled back, without a restart."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from infra.auth import KeyStore
from infra.bus import EventProducer, ensure_topics
from policy.show_gate import FEATURES, Gate, gate_for, serving_gates
from policy.shown import first_line
from schemas.events import new_event
from schemas.topics import COMPLETIONS
from tests.conftest import make_settings
from tests.serving_helpers import ThreadServer, find_events, unique
from tests.system_helpers import poll


def gate_event(version: int, status: str = "PROMOTED", *, project: str = "", threshold: float = 0.5,
               exploration: float = 0.0, features=FEATURES):
    gate = Gate(coef=(0.0,) * 7, intercept=0.0, mean=(0.0,) * 7, scale=(1.0,) * 7, threshold=threshold,
                exploration=exploration, version=version, project_id=project)
    record = {**gate.as_record(), "feature_names": list(features)}
    return new_event("GateVersion", **record, parent_version=None, episodes_used=60, metrics={}, status=status,
                     reason="test")


def test_which_gate_a_project_is_served_by_hand():
    records: list = []

    def served(project: str):
        return gate_for(serving_gates(records), project)

    def publish(event) -> None:
        records.append(event.record)

    assert served("p") is None  # no gate: everything shown
    publish(gate_event(1))
    assert served("p").version == 1 and served("").version == 1  # the shared gate
    publish(gate_event(1, project="p", threshold=0.9))
    assert served("p").threshold == 0.9 and served("q").version == 1
    publish(gate_event(2, project="p"))
    assert served("p").version == 2
    publish(gate_event(3, "CANDIDATE", project="p"))
    assert served("p").version == 2  # a candidate is not served
    publish(gate_event(2, "ROLLED_BACK", project="p"))
    assert served("p").version == 1 and served("p").threshold == 0.9  # the one before it
    publish(gate_event(1, "ROLLED_BACK", project="p"))
    assert served("p").project_id == ""  # the project's gates all rolled back: the shared one
    publish(gate_event(4, features=("log_tokens",)))
    assert served("p").version == 1  # a gate over features this build does not compute is never served


@pytest.mark.kafka
def test_gate_versions_are_hot_loaded_logged_on_every_completion_and_rolled_back(kafka, tiny_model, tmp_path):
    settings = make_settings(tmp_path / "state", kafka_bootstrap=kafka.settings.kafka_bootstrap, model=tiny_model,
                             completions_port=0, feedback_port=0, show_gate=True)
    ensure_topics(settings)
    project = unique("gated")
    key = KeyStore(settings.keys_file).add(project, "u", rate_per_minute=100_000)
    server = ThreadServer(settings)
    producer = EventProducer(settings)
    served: list[tuple[str, str | None, str]] = []  # (completion id, gate header, text the client got)

    def ask(n: int) -> list[tuple[str, str | None, str]]:
        out = []
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:
            for i in range(n):
                stream = i % 2 == 1
                r = http.post(f"{server.completions_url}/v1/completions",
                              json={"prompt": f"x_{i} = compute(", "max_tokens": 5, "temperature": 0.7,
                                    "stream": stream})
                assert r.status_code == 200
                if stream:
                    text = "".join(c["choices"][0]["text"] for c in _chunks(r.text))
                else:
                    text = r.json()["choices"][0]["text"]
                out.append((r.headers["x-tabloop-completion-id"], r.headers.get("x-tabloop-gate-version"), text))
        served.extend(out)
        return out

    def decided_by(got: list[tuple[str, str | None, str]], version: str) -> None:
        """Every completion was decided by gate ``version``, except those whose first line was empty
        (nothing to judge: no gate named, shown as generated). The tiny model samples one now and then: a
        clean-clone CI run (ci51, at b862d15) failed on an assert that all six named the gate."""
        for _, header, text in got:
            assert header == version or (header is None and not first_line(text).strip()), (header, text)

    def publish_and_wait(event, header: str | None) -> list:
        producer.publish(event)
        producer.flush()
        return poll(lambda: ask(2), lambda got: any(h == header for _, h, _ in got), 30, 0.2)

    try:
        before = ask(4)
        assert all(h is None for _, h, _ in before)
        # A gate that hides everything (threshold above any probability, no exploration), for this project.
        publish_and_wait(gate_event(1, project=project, threshold=1.01), "1")
        hidden = ask(6)
        decided_by(hidden, "1")
        gated = [(cid, text) for cid, h, text in hidden if h == "1"]
        assert len(gated) >= 3 and all(text == "" for _, text in gated)
        # A gate that shows everything replaces it without a restart...
        publish_and_wait(gate_event(2, project=project, threshold=0.0), "2")
        shown = ask(6)
        decided_by(shown, "2")
        # ...and the simulated users record the gate version the door says decided (bench loop's
        # feedback → policy counts a trained gate by it).
        served.extend(asyncio.run(simulated_streams(server, key, 4)))
        # ...and its rollback brings back the one before it.
        publish_and_wait(gate_event(2, "ROLLED_BACK", project=project), "1")
        publish_and_wait(gate_event(1, "ROLLED_BACK", project=project), None)

        ids = {cid for cid, _, _ in served}
        events = {e.record["completion_id"]: e.record
                  for e in find_events(settings, COMPLETIONS.name, lambda e: e.record["completion_id"] in ids,
                                       want=len(ids), timeout_s=60)}
        assert set(events) == ids  # every completion logged, whatever the gate did
        for cid, header, text in served:
            e = events[cid]
            if e["gate_version"] is None:
                # Not gated: no gate was served, or the line was empty (nothing to judge): shown as generated,
                # and the response names no gate.
                assert e["gate_shown"] and e["show_probability"] == 1.0 and e["completion_text"] == text
                assert header is None
                continue
            assert header == str(e["gate_version"]) and 0 < e["gate_score"] < 1
            if e["gate_version"] == 1:
                assert e["gate_threshold"] == 1.01 and not e["gate_shown"] and e["show_probability"] == 0.0
                assert text == "" and e["completion_text"].strip() and "\n" not in e["completion_text"]
                assert len(e["completion_token_ids"]) == len(e["completion_logprobs"]) >= 1
            else:
                assert e["gate_shown"] and e["show_probability"] == 1.0 and e["completion_text"] == text
        assert sum(1 for e in events.values() if e["gate_version"] == 1 and not e["gate_shown"]) >= len(gated)
    finally:
        producer.close()
        server.stop()


async def simulated_streams(server, key: str, n: int) -> list[tuple[str, str | None, str]]:
    """``n`` completions streamed by the simulator's own client code, as (id, the gate version it recorded,
    the text it read)."""
    from trainer.proof.simulate import SimConfig, Simulation
    from trainer.proof.tasks import FimTask

    sim = Simulation([FimTask("t", "x = ", "\n", "1")],
                     SimConfig(completions_url=server.completions_url, api_keys=(key,), temperature=0.7,
                               max_tokens=5))
    out = []
    async with httpx.AsyncClient(timeout=60) as http:
        for i in range(n):
            got = await sim._stream(http, 0, f"y_{i} = compute(")
            out.append((got.completion_id, None if got.gate_version is None else str(got.gate_version), got.text))
    return out


def _chunks(body: str) -> list[dict]:
    import json

    return [json.loads(line[6:]) for line in body.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]" and '"choices": [{' in line]
