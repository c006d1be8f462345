"""The HTTP API against hostile callers: its OpenAPI description fuzzed with schemathesis on a live front door
(tiny model, real Kafka), authentication and tenancy probes, size limits.

Already covered elsewhere and not repeated here: key storage and rate limits (test_auth.py), 401/403/429 on
the feedback routes and a 5 MB body (test_serving.py::test_auth_and_rate_limits, ::test_bad_json_and_oversized_
bodies), prompt trimming (test_serving.py::test_server_side_caps…), the scorer's sandbox (test_sandbox.py).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import negative_data_rejection
from hypothesis import HealthCheck

from infra.bus import ensure_topics
from schemas.events import new_event
from schemas.topics import FEEDBACK
from infra.auth import KeyStore
from streams.join import EpisodeJoiner
from tests.conftest import make_settings
from tests.serving_helpers import ThreadServer, find_events, unique

pytestmark = pytest.mark.kafka
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def front(kafka, tiny_model, tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("api"), kafka_bootstrap=kafka.settings.kafka_bootstrap,
                             model=tiny_model, completions_port=0, feedback_port=0, max_new_tokens=4,
                             rate_limit_per_minute=100_000, max_body_bytes=MAX_BODY, max_prompt_tokens=64)
    ensure_topics(settings)
    keys = KeyStore(settings.keys_file)
    server = ThreadServer(settings)
    server.settings = settings
    server.keys = {"acme": keys.add("acme", "alice"), "globex": keys.add("globex", "bob")}
    revoked = keys.add("acme", "mallory")
    keys.revoke(revoked.split("_")[1])
    server.keys["revoked"] = revoked
    yield server
    server.stop()


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


# -- the description ------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["completions", "feedback"])
def test_each_app_describes_exactly_its_routes(front, which):
    base = front.completions_url if which == "completions" else front.feedback_url
    doc = httpx.get(f"{base}/openapi.json").json()
    assert doc["openapi"].startswith("3.") and doc["servers"] == [{"url": base}]
    app = front.server.front_door.completions_app() if which == "completions" else \
        front.server.front_door.feedback_app()
    routes = {r.path: {m.lower() for m in r.methods} - {"head"} for r in app.routes}
    described = {path: set(ops) for path, ops in doc["paths"].items()}
    assert described == routes
    schema = schemathesis.openapi.from_dict(doc)  # parses, resolves every $ref
    assert len([op for op in schema.get_all_operations()]) == sum(len(m) for m in routes.values())


def _fuzz(base_url: str, key: str, max_examples: int) -> tuple[int, dict]:
    """Every operation of the description at ``base_url``, positive and negative cases, with schemathesis'
    default checks (no 5xx; status codes, content types and bodies as described; valid requests accepted)
    but one: the server is lenient in ways the description does not spell out (null is the same as absent,
    `outcome` in any case, unknown fields ignored), so some schema-violating requests are rightly accepted.
    Returns (cases sent, statuses seen)."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    sent, statuses, failures = 0, {}, []
    for result in schema.get_all_operations():
        operation = result.ok()
        strategy = operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(GenerationMode.NEGATIVE)

        @hypothesis.given(case=strategy)
        @hypothesis.settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
                             suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
        def run(case):
            nonlocal sent
            if case.headers and "X-Project-ID" in case.headers:
                # Fuzz the header's handling with the key's own project; a wrong one is the 403 probe below.
                case.headers["X-Project-ID"] = "acme"
            response = case.call_and_validate(base_url=base_url, headers=bearer(key), timeout=60,
                                              excluded_checks=[negative_data_rejection])
            sent += 1
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        try:
            run()
        except Exception as exc:  # collect, so one report shows every operation that failed
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
    return sent, statuses


def test_fuzzing_the_completions_api_finds_no_server_error(front):
    sent, statuses = _fuzz(front.completions_url, front.keys["acme"], max_examples=50)
    print(f"{sent} cases: {statuses}")
    assert sent >= 40 and not any(s >= 500 and s != 503 for s in statuses)
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses  # real work and real refusals


def test_fuzzing_the_feedback_api_finds_no_server_error(front):
    sent, statuses = _fuzz(front.feedback_url, front.keys["acme"], max_examples=25)
    print(f"{sent} cases: {statuses}")
    assert sent >= 40 and not any(s >= 500 and s != 503 for s in statuses)
    assert statuses.get(202, 0) > 0 and statuses.get(400, 0) > 0, statuses
    assert httpx.get(f"{front.completions_url}/readyz").status_code == 200  # still standing


# -- authentication and tenancy -------------------------------------------------------------------------


PROTECTED = [("completions", "POST", "/v1/completions", {"prompt": "x = ", "max_tokens": 2}),
             ("completions", "GET", "/v1/models", None),
             ("feedback", "POST", "/api/training/submit", {"accepted": True, "completion": "1", "prompt": "p"}),
             ("feedback", "POST", "/api/continue/events",
              {"name": "autocomplete", "data": {"accepted": False, "completion": "1"}}),
             ("feedback", "POST", "/v1/feedback", {"completion_id": "cmpl-x", "accepted": True})]


@pytest.mark.parametrize("app,method,path,body", PROTECTED, ids=[p[2] for p in PROTECTED])
def test_every_protected_route_refuses_strangers(front, app, method, path, body):
    url = (front.completions_url if app == "completions" else front.feedback_url) + path
    call = lambda **headers: httpx.request(method, url, json=body, headers=headers, timeout=30)  # noqa: E731
    acme = front.keys["acme"]
    no_key = call()
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    secret = acme.split("_", 2)[2]
    forged = f"tlk_{acme.split('_')[1]}_{secret[::-1]}"  # a real key id, a wrong secret
    for headers in ({"Authorization": "Bearer nope"}, bearer(forged), bearer(front.keys["revoked"]),
                    {"api-key": forged}, {"Authorization": f"Basic {acme}"}):
        assert call(**headers).status_code == 401, headers
    # A key speaks for its own project only: naming another one is refused, either way round.
    assert call(**bearer(acme), **{"X-Project-ID": "globex"}).status_code == 403
    assert call(**bearer(front.keys["globex"]), **{"X-Project-ID": "acme"}).status_code == 403
    ok = call(**bearer(acme), **{"X-Project-ID": "acme"})
    assert ok.status_code in (200, 202), ok.text


def test_feedback_on_another_projects_completion_is_refused(front):
    acme, globex = bearer(front.keys["acme"]), bearer(front.keys["globex"])
    served = httpx.post(f"{front.completions_url}/v1/completions", headers=acme, timeout=30,
                        json={"prompt": unique("acme secret"), "max_tokens": 2})
    assert served.status_code == 200
    cid = served.json()["id"]
    replay = httpx.post(f"{front.feedback_url}/v1/feedback", headers=globex,
                        json={"completion_id": cid, "accepted": True})
    assert replay.status_code == 403 and replay.json()["error"]["param"] == "completion_id"
    own = httpx.post(f"{front.feedback_url}/v1/feedback", headers=acme, json={"completion_id": cid,
                                                                               "accepted": False})
    assert own.status_code == 202
    [event] = find_events(front.settings, FEEDBACK.name, lambda e: e.record["completion_id"] == cid)
    assert event.record["project_id"] == "acme" and event.event_id == own.json()["event_id"]  # only acme's


def test_the_join_never_lets_another_project_label_a_completion():
    """What no front door can see (feedback through another replica, or after a restart) the join refuses:
    the feedback becomes an unmatched episode of its own project, and the completion stays open for its owner."""
    t0 = datetime(2026, 11, 30, tzinfo=timezone.utc)
    completion = new_event("CompletionServed", completion_id="cmpl-a", served_at=t0, project_id="acme",
                           user_id="alice", model="m", policy_version=3, prompt="secret", prompt_sha256="s",
                           completion_text="x", completion_token_ids=[1], completion_logprobs=[-0.1],
                           finish_reason="stop", aborted=False, temperature=1.0, top_p=1.0, max_tokens=4,
                           ttft_ms=1.0, latency_ms=2.0, replica_id="r").record

    def feedback(project: str, seconds: int) -> dict:
        return new_event("FeedbackReceived", received_at=t0 + timedelta(seconds=seconds), project_id=project,
                         user_id="u", source="api", completion_id="cmpl-a", outcome="ACCEPTED",
                         raw_payload="{}").record

    joiner = EpisodeJoiner()
    joiner.on_completion(completion)
    foreign = joiner.on_feedback("cmpl-a", feedback("globex", 1))
    assert foreign.record["project_id"] == "globex" and foreign.record["matched"] is False
    assert foreign.record["completion_id"] != "cmpl-a" and foreign.record["prompt"] == ""
    assert foreign.record["policy_version"] is None and joiner.counts["foreign_feedback"] == 1
    own = joiner.on_feedback("cmpl-a", feedback("acme", 2))
    assert own.record["completion_id"] == "cmpl-a" and own.record["matched"] is True
    assert own.record["project_id"] == "acme" and own.record["policy_version"] == 3
    # Early foreign feedback (before its completion) is refused the same way once the completion arrives.
    joiner = EpisodeJoiner()
    assert joiner.on_feedback("cmpl-a", feedback("globex", 1)) is None
    [late] = joiner.on_completion(completion)
    assert late.record["project_id"] == "globex" and late.record["matched"] is False
    assert "cmpl-a" in joiner.open


# -- sizes ------------------------------------------------------------------------------------------


def test_request_size_limits_hold_without_content_length(front):
    headers = {**bearer(front.keys["acme"]), "Content-Type": "application/json"}
    big = b'{"prompt": "' + b"x" * (MAX_BODY + 1) + b'"}'
    declared = httpx.post(f"{front.completions_url}/v1/completions", headers=headers, content=big)
    assert declared.status_code == 413 and str(MAX_BODY) in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    for base, path in ((front.completions_url, "/v1/completions"), (front.feedback_url, "/v1/feedback")):
        streamed = httpx.post(f"{base}{path}", headers=headers, content=chunks())
        assert streamed.status_code == 413, (path, streamed.text)


def test_a_prompt_just_under_the_body_limit_is_served_trimmed(front):
    prompt = "".join(f"v{i} = {i}; " for i in range(9000))[: MAX_BODY - 200]
    resp = httpx.post(f"{front.completions_url}/v1/completions", headers=bearer(front.keys["acme"]), timeout=60,
                      json={"prompt": prompt, "max_tokens": 100})
    assert resp.status_code == 200, resp.text
    cid = resp.json()["id"]
    from schemas.topics import COMPLETIONS

    [event] = find_events(front.settings, COMPLETIONS.name, lambda e: e.record["completion_id"] == cid)
    seen = front.server.engine.tokenizer.encode(event.record["prompt"], add_special_tokens=False)
    assert len(seen) <= 64 and len(event.record["completion_token_ids"]) <= 4  # both server-side caps
    assert prompt.endswith(event.record["prompt"])  # the top went, the text at the cursor stayed
