"""The front door: two Starlette apps (completions on 8081, feedback on 8082) around one engine.

Route tables are at the bottom of this file; everything a route needs hangs
off ``FrontDoor``.
"""

from __future__ import annotations

import math
import os
import random
import socket
from collections import OrderedDict

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from infra.auth import MAX_NAME, KeyStore, Principal, RateLimiter
from infra.settings import Settings
from serving import feedback, openapi
from serving.completions import CompletionRun, parse_completion_request, parse_fim_request
from serving.engines.base import Engine
from serving.http import HTTPProblem, SSEResponse, check_length, read_json
from serving.publisher import EventPublisher, EventTooLarge

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
SERVED_TO_REMEMBERED = 100_000
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
PER_TOKEN_FIELD_BYTES = 32
"""What the event's per-token arrays (ids, logprobs, text ends…) take for one token, rounded up: an Avro
int or long is a varint of at most 5 or 10 bytes, a double 8."""


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram("tabloop_completion_latency_seconds", "Completion latency", buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.ttft = Histogram("tabloop_completion_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.tokens = Counter("tabloop_completion_tokens", "Completion tokens generated", registry=r)
        self.tokens_per_s = Gauge("tabloop_completion_tokens_per_second", "Tokens/s of the last completion",
                                  registry=r)
        self.completions = Counter("tabloop_completions", "Completions served", ["finish_reason"], registry=r)
        self.feedback = Counter("tabloop_feedback", "Feedback accepted", ["source"], registry=r)
        self.events = Counter("tabloop_events_published", "Events handed to Kafka or the spool", ["route"],
                              registry=r)
        self.spool_depth = Gauge("tabloop_spool_depth", "Events in the local spool waiting for Kafka", registry=r)
        self.policy_version = Gauge("tabloop_policy_version", "Policy version now serving", registry=r)


class FrontDoor:
    def __init__(self, settings: Settings, engine: Engine, publisher: EventPublisher, keys: KeyStore | None = None,
                 gates=None):
        if settings.auth == "open" and settings.serve_host not in LOOPBACK:
            raise ValueError(f"TABLOOP_AUTH=open serves without keys: only on a loopback address, "
                             f"not TABLOOP_SERVE_HOST={settings.serve_host}")
        if settings.candidate_samples and not engine.reads_candidates:
            raise ValueError(f"TABLOOP_CANDIDATE_SAMPLES={settings.candidate_samples} needs an engine that reads "
                             f"candidates (transformers); the {engine.name} engine does not: set it to 0")
        self.settings = settings
        self.engine = engine
        self.publisher = publisher
        self.keys = keys or KeyStore(settings.keys_file)
        self.limiter = RateLimiter(settings.rate_limit_per_minute)
        self.metrics = Metrics()
        self.replica_id = settings.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        # completion id -> project, for the completions this replica served lately: feedback from another
        # project naming one of them is refused here (the streams join refuses it for every replica).
        self.served_to: OrderedDict[str, str] = OrderedDict()
        self._longest_token_chars: int | None = None
        self.gates = gates
        """Where a request finds its show-gate (``serving.gates.GateWatcher``); None: everything is shown."""
        self.gate_rng = random.Random()

    # -- auth -----------------------------------------------------------------------

    def authenticate(self, request: Request) -> Principal:
        claimed = request.headers.get("x-project-id")
        if self.settings.auth == "open":
            # The headers name the project and user in events: capped like names in the key store.
            project = check_length(claimed or "local", "X-Project-ID", MAX_NAME)
            user = check_length(request.headers.get("x-user-id") or "local", "X-User-ID", MAX_NAME)
            caller = Principal("open", project, user, None)
        else:
            presented = _presented_key(request)
            if not presented:
                raise HTTPProblem(401, "an API key is required: Authorization: Bearer <key>",
                                  kind="authentication_error")
            caller = self.keys.verify(presented)
            if caller is None:
                raise HTTPProblem(401, "unknown or revoked API key", kind="authentication_error")
            if claimed is not None and claimed != caller.project_id:
                raise HTTPProblem(403, f"this key belongs to project {caller.project_id!r}, not {claimed!r}",
                                  kind="permission_error")
        wait = self.limiter.check(caller.key_id, caller.rate_per_minute)
        if wait > 0:
            raise HTTPProblem(429, f"rate limit exceeded; retry in {wait:.1f}s", kind="rate_limit_error",
                              headers={"Retry-After": str(math.ceil(wait))})
        return caller

    # -- completions ----------------------------------------------------------------

    async def completions(self, request: Request, parse=parse_completion_request) -> Response:
        caller = self.authenticate(request)
        params = parse(await self._body(request), self.settings)
        run = CompletionRun(params, self.engine, self.settings, caller.project_id, caller.user_id, self.replica_id)
        if self.gates is not None:  # the server makes a watcher only with TABLOOP_SHOW_GATE on
            run.gate, run.rng = self.gates.for_project(caller.project_id), self.gate_rng
        run.prepare()  # a prompt we can't serve is a 400 now, not a broken stream later
        self._check_event_fits(run)

        def headers() -> dict[str, str]:
            # Known once the first token exists: a request runs start to end on one version.
            version = run.policy_version if run.policy_version is not None else self.engine.policy_version
            out = {"X-Tabloop-Completion-Id": run.completion_id, "X-Tabloop-Policy-Version": str(version)}
            if run.deciding_gate is not None:  # known by then: nothing is sent before the gate decides
                out["X-Tabloop-Gate-Version"] = str(run.deciding_gate.version)
            return out

        if not params.stream:
            try:
                body = await run.complete()
            finally:
                self._record(run)
            return JSONResponse(body, headers=headers())

        async def payloads():
            try:
                async for payload in run.sse_payloads():
                    yield payload
            finally:
                self._record(run)

        return SSEResponse(payloads(), headers=headers)

    async def fim_completions(self, request: Request) -> Response:
        """Mistral's FIM API: the same run, auth, events and streaming as /v1/completions."""
        return await self.completions(request, parse_fim_request)

    def _check_event_fits(self, run: CompletionRun) -> None:
        """413 now, before any token, when the CompletionServed event this run ends with could exceed what
        one Kafka message holds: answering 200 and then losing the event would lose the feedback's episode.

        The event is built as it stands (prompt, prefix, suffix: everything but the completion) and given
        room for the longest completion the run may produce: ``max_tokens`` (+1 for a text-only last step)
        tokens of the tokenizer's longest token, at 4 bytes a character, with their per-token fields."""
        per_token = 4 * self._longest_token() + PER_TOKEN_FIELD_BYTES
        completion_room = (run.params.max_tokens + 1) * per_token
        spare = self.publisher.room(run.event()) - completion_room
        if spare < 0:
            raise HTTPProblem(413, f"this prompt is {-spare} bytes too long to serve: its CompletionServed event, "
                                   f"with room for {run.params.max_tokens} tokens of completion, would be over the "
                                   f"{self.publisher.producer.message_max_bytes}-byte Kafka message limit",
                              param="prompt")

    def _longest_token(self) -> int:
        """Characters in the tokenizer's longest token (the same for every weight version)."""
        if self._longest_token_chars is None:
            self._longest_token_chars = max(map(len, self.engine.tokenizer.get_vocab()), default=1)
        return self._longest_token_chars

    async def _body(self, request: Request):
        return await read_json(request, self.settings.max_body_bytes, self.settings.body_timeout_s)

    def _record(self, run: CompletionRun) -> None:
        """Metrics and the CompletionServed event, off the latency path."""
        m = self.metrics
        m.latency.observe(run.latency_ms / 1000)
        if run.token_ids:
            m.ttft.observe(run.ttft_ms / 1000)
            m.tokens.inc(len(run.token_ids))
            if run.latency_ms > 0:
                m.tokens_per_s.set(len(run.token_ids) / (run.latency_ms / 1000))
        m.completions.labels(run.finish_reason or "abort").inc()
        self.served_to[run.completion_id] = run.project_id
        if len(self.served_to) > SERVED_TO_REMEMBERED:
            self.served_to.popitem(last=False)
        self.publisher.submit(run.event())
        m.events.labels("completion").inc()

    async def models(self, request: Request) -> Response:
        self.authenticate(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.engine.model_name, "object": "model", "created": 0, "owned_by": "tabloop",
             "policy_version": self.engine.policy_version}]})

    # -- feedback -------------------------------------------------------------------

    async def _ingest(self, request: Request, parse) -> Response:
        caller = self.authenticate(request)
        body = await self._body(request)
        event = parse(body, project_id=caller.project_id, user_id=caller.user_id)
        if event is None:  # a data: event that is not about autocomplete
            return JSONResponse({"event_id": None, "ignored": body.get("name")}, status_code=202)
        owner = self.served_to.get(event.record.get("completion_id") or "")
        if owner is not None and owner != caller.project_id:
            raise HTTPProblem(403, f"completion {event.record['completion_id']!r} was not served to project "
                                   f"{caller.project_id!r}", kind="permission_error", param="completion_id")
        try:
            where = await self.publisher.publish_durably(event)
        except EventTooLarge as exc:
            raise HTTPProblem(413, f"feedback too large to store: {exc}") from None
        self.metrics.feedback.labels(event.record["source"]).inc()
        self.metrics.events.labels("feedback").inc()
        return JSONResponse({"event_id": event.event_id, "stored": where}, status_code=202)

    async def fork_feedback(self, request: Request) -> Response:
        return await self._ingest(request, feedback.from_fork)

    async def continue_events(self, request: Request) -> Response:
        return await self._ingest(request, feedback.from_continue_data)

    async def api_feedback(self, request: Request) -> Response:
        return await self._ingest(request, feedback.from_api)

    # -- health -----------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def readyz(self, request: Request) -> Response:
        checks = {"model": self.engine.ready(), "events": self._events_writable()}
        ok = all(checks.values())
        return JSONResponse({"ready": ok, **checks, "policy_version": self.engine.policy_version},
                            status_code=200 if ok else 503)

    def _events_writable(self) -> bool:
        # Kafka answering, or the spool's directory writable: either way no event is lost.
        return self.publisher.kafka_ok() or os.access(self.publisher.spool.directory, os.W_OK)

    async def metrics_endpoint(self, request: Request) -> Response:
        self.metrics.spool_depth.set(self.publisher.depth())
        self.metrics.policy_version.set(self.engine.policy_version)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _openapi(self, make):
        async def endpoint(request: Request) -> Response:
            doc = make(self.settings)
            doc["servers"] = [{"url": str(request.base_url).rstrip("/")}]  # as the caller reached us
            return JSONResponse(doc)

        return endpoint

    # -- the route tables -----------------------------------------------------------------

    def _common(self) -> list[Route]:
        return [Route("/healthz", _guard(self.healthz)), Route("/readyz", _guard(self.readyz)),
                Route("/metrics", _guard(self.metrics_endpoint))]

    def completions_app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/completions", _guard(self.completions), methods=["POST"]),
            Route("/v1/fim/completions", _guard(self.fim_completions), methods=["POST"]),
            Route("/v1/models", _guard(self.models)),
            Route("/openapi.json", self._openapi(openapi.completions_document)),
            *self._common(),
        ])

    def feedback_app(self) -> Starlette:
        return Starlette(routes=[
            Route("/api/training/submit", _guard(self.fork_feedback), methods=["POST"]),
            Route("/api/continue/events", _guard(self.continue_events), methods=["POST"]),
            Route("/v1/feedback", _guard(self.api_feedback), methods=["POST"]),
            Route("/openapi.json", self._openapi(openapi.feedback_document)),
            *self._common(),
        ])


def _presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return request.headers.get("api-key") or None  # Continue sends both headers


def _guard(handler):
    """Turn HTTPProblem into its error response."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except HTTPProblem as problem:
            return problem.response()

    endpoint.__name__ = handler.__name__
    return endpoint
