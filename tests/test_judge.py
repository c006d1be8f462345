"""The LLM judge client against a real local server speaking the OpenAI chat completions API.

The server (Starlette under uvicorn, on a free 127.0.0.1 port, in a thread) answers from a
script each test writes, and records what it received: the request count proves caching and
retries, the headers and bodies prove what the client sends, and its in-flight high-water
mark proves the concurrency bound.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field
from email.utils import formatdate

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rewards.judge import (JudgeClient, JudgeConfig, JudgeParseError, JudgeResult, build_judge_messages, cache_key,
                           parse_score, retry_after_s)
from tests.system_helpers import poll

API_KEY = "sk-judge-test"
MODEL = "judge-model"
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
COMPLETION = "return a + b"


@dataclass
class Reply:
    """One scripted answer: a chat completion whose message is ``content``, or an error ``status``."""

    content: str = "Correct and idiomatic.\nSCORE: 8"
    status: int = 200
    headers: dict = field(default_factory=dict)
    delay_s: float = 0.0
    raw_body: str | None = None  # sent as-is instead of a chat completion
    hold_until_in_flight: int = 0
    """Held until this many requests are in flight at once (or every request the test sends has come:
    ``FakeJudgeAPI.expected``): shows that the client does overlap its calls, on a machine of any speed."""


class FakeJudgeAPI:
    """An OpenAI-compatible ``/v1/chat/completions`` on 127.0.0.1, in its own event loop thread."""

    def __init__(self):
        self.reset()
        app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])])
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))  # the port is ours from here on: no free-port race
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        poll(lambda: self._server.started or not self._thread.is_alive(), timeout_s=10, poll_s=0.01)
        if not self._server.started:
            raise RuntimeError("the fake judge API did not start")

    def reset(self) -> None:
        self.script: list[Reply] = []  # answered in order; then ``default`` for every request
        self.default = Reply()
        self.requests: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.expected: int | None = None
        # A request still held from an earlier test (a client that gave up on it) must not count in this one's.
        self.generation = getattr(self, "generation", 0) + 1

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append({"headers": dict(request.headers), "body": body})
        generation = self.generation
        self.in_flight += 1  # one event loop: no lock needed
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            reply = self.script.pop(0) if self.script else self.default
            if reply.hold_until_in_flight:
                # Polled, not timed: the wait ends when the client has that many calls open. 30 s at most,
                # for a client that never opens that many (its test then fails on max_in_flight).
                for _ in range(3000):
                    if self.in_flight >= reply.hold_until_in_flight or len(self.requests) == self.expected:
                        break
                    await asyncio.sleep(0.01)
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if reply.raw_body is not None:
                return Response(reply.raw_body, status_code=reply.status, headers=reply.headers,
                                media_type="application/json")
            if reply.status != 200:
                error = {"error": {"message": f"scripted failure {reply.status}", "type": "test_error",
                                   "code": reply.status}}
                return JSONResponse(error, status_code=reply.status, headers=reply.headers)
            completion = {"id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion",
                          "created": int(time.time()), "model": body.get("model"),
                          "choices": [{"index": 0, "finish_reason": "stop",
                                       "message": {"role": "assistant", "content": reply.content}}],
                          "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}
            return JSONResponse(completion, headers=reply.headers)
        finally:
            if generation == self.generation:
                self.in_flight -= 1


@pytest.fixture(scope="module")
def judge_server():
    server = FakeJudgeAPI()
    yield server
    server.stop()


@pytest.fixture
def api(judge_server) -> FakeJudgeAPI:
    judge_server.reset()
    return judge_server


def config(api: FakeJudgeAPI, **overrides) -> JudgeConfig:
    settings = {"api_url": f"{api.url}/v1", "api_key": API_KEY, "model": MODEL, "timeout_s": 5.0,
                "backoff_s": 0.01, **overrides}
    return JudgeConfig(**settings)


def score_in_turn(cfg: JudgeConfig, *calls: tuple[str, str, str]) -> list[JudgeResult]:
    """Each (prefix, suffix, completion) scored one after another by one client."""

    async def go():
        async with JudgeClient(cfg) as client:
            return [await client.score(*call) for call in calls]

    return asyncio.run(go())


CALL = (PREFIX, SUFFIX, COMPLETION)


# --- talking to the API -------------------------------------------------------------------------------------


def test_scores_a_good_answer_and_sends_key_model_and_prompt(api):
    api.default = Reply("The completion returns the sum, as print(add(1, 2)) needs.\nSCORE: 7.5")
    [result] = score_in_turn(config(api), CALL)
    assert result == JudgeResult(score=7.5, error=None, attempts=1, cached=False, raw=api.default.content)
    assert len(api.requests) == 1
    sent = api.requests[0]
    assert sent["headers"]["authorization"] == f"Bearer {API_KEY}"
    assert sent["body"]["model"] == MODEL
    assert sent["body"]["temperature"] == 0
    assert sent["body"]["messages"] == build_judge_messages(*CALL)


def test_cache_answers_repeats_without_calling_the_api(api):
    other = (PREFIX, SUFFIX, "return a - b")
    first, again, different, once_more = score_in_turn(config(api), CALL, CALL, other, CALL)
    assert (first.score, first.cached, first.attempts) == (8.0, False, 1)
    assert (again.score, again.cached, again.attempts) == (8.0, True, 0)
    assert (different.cached, once_more.cached) == (False, True)
    assert len(api.requests) == 2  # CALL once, other once


def test_cache_is_lru_bounded(api):
    a, b, c = ((PREFIX, SUFFIX, f"return {x}") for x in "abc")
    results = score_in_turn(config(api, cache_size=2), a, b, a, c, a, b)
    # a, b asked; a hit (now most recent); c asked and evicts b; a still a hit; b asked again.
    assert [r.cached for r in results] == [False, False, True, False, True, False]
    assert len(api.requests) == 4


def test_cache_off(api):
    results = score_in_turn(config(api, cache_size=0), CALL, CALL)
    assert [r.cached for r in results] == [False, False]
    assert len(api.requests) == 2


@pytest.mark.parametrize("answer, why", [
    ("The completion is correct and fits well.", "no 'SCORE: <number>' line"),
    ("Too good to be true.\nSCORE: 11", "outside 0..10"),
    ("SCORE: ten", "'ten' is not a number"),
])
def test_malformed_answers_are_recorded_errors_asked_once_more_and_not_cached(api, answer, why):
    api.default = Reply(answer)
    first, second = score_in_turn(config(api), CALL, CALL)
    assert first.score is None and not first.ok
    assert first.error.startswith("malformed judge answer") and why in first.error
    assert (first.attempts, first.cached, first.raw) == (2, False, answer)
    assert second.cached is False
    assert len(api.requests) == 4  # asked twice per call; the error was not cached


def test_malformed_then_good_answer_scores(api):
    api.script = [Reply("I think it's fine."), Reply("SCORE: 6")]
    [result] = score_in_turn(config(api), CALL)
    assert (result.score, result.error, result.attempts) == (6.0, None, 2)


@pytest.mark.parametrize("raw_body", ["not json at all", '{"choices": []}',
                                      '{"choices": [{"message": {"role": "assistant", "content": null}}]}'])
def test_a_200_that_is_not_a_chat_completion_is_an_error(api, raw_body):
    api.default = Reply(raw_body=raw_body)
    [result] = score_in_turn(config(api), CALL)
    assert result.score is None and "malformed judge answer" in result.error
    assert result.attempts == 2 and result.raw is None


def test_429_waits_for_retry_after_then_succeeds(api):
    api.script = [Reply(status=429, headers={"Retry-After": "1"}), Reply("SCORE: 9")]
    started = time.monotonic()
    [result] = score_in_turn(config(api, backoff_s=0.01), CALL)
    elapsed = time.monotonic() - started
    assert (result.score, result.attempts, result.error) == (9.0, 2, None)
    assert len(api.requests) == 2
    assert elapsed >= 0.95  # the server's 1 s, not the 10 ms backoff


def test_500_then_success(api):
    api.script = [Reply(status=500), Reply(status=502), Reply("SCORE: 4")]
    [result] = score_in_turn(config(api), CALL)
    assert (result.score, result.attempts) == (4.0, 3)
    assert len(api.requests) == 3


def test_5xx_gives_up_after_max_retries(api):
    api.default = Reply(status=503)
    [result] = score_in_turn(config(api, max_retries=2), CALL)
    assert result.score is None and result.attempts == 3
    assert "gave up after 3 attempts" in result.error and "HTTP 503" in result.error
    assert "scripted failure 503" in result.error  # the API's own error message
    assert len(api.requests) == 3


def test_slower_than_the_timeout_is_retried_then_an_error(api):
    api.default = Reply("SCORE: 5", delay_s=60)
    [result] = score_in_turn(config(api, timeout_s=0.2, max_retries=1), CALL)
    assert api.in_flight == 2  # it gave up on both while the API still held them: it did not wait for them
    assert result.score is None and result.attempts == 2
    assert "no answer" in result.error and "0.2 s" in result.error
    assert len(api.requests) == 2


def test_slow_first_answer_then_a_quick_one(api):
    api.script = [Reply("SCORE: 1", delay_s=1.5), Reply("SCORE: 3")]
    [result] = score_in_turn(config(api, timeout_s=0.2), CALL)
    assert (result.score, result.attempts) == (3.0, 2)


def test_401_is_not_retried_and_not_cached(api):
    api.default = Reply(status=401)
    first, second = score_in_turn(config(api), CALL, CALL)
    assert first.score is None and first.attempts == 1 and not first.cached
    assert "HTTP 401" in first.error and "scripted failure 401" in first.error
    assert API_KEY not in first.error
    assert second.attempts == 1 and not second.cached
    assert len(api.requests) == 2


def test_unreachable_api_is_an_error_after_retries():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = JudgeConfig(api_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, model=MODEL, backoff_s=0.01,
                      max_retries=2)
    [result] = score_in_turn(cfg, CALL)
    assert result.score is None and result.attempts == 3
    assert "could not reach" in result.error


def test_concurrency_is_bounded(api):
    # Each answer is held until three calls are open (a delay was not enough: at 0.5 s a loaded CI run saw
    # only two in flight), so the calls overlap as far as the client allows, whatever the machine's speed.
    api.default = Reply("SCORE: 7", hold_until_in_flight=3)
    calls = [(PREFIX, SUFFIX, f"return a + b  # {i}") for i in range(20)]
    api.expected = len(calls)  # the last two are not held for a third that never comes

    async def go():
        async with JudgeClient(config(api, max_concurrency=3)) as client:
            return await asyncio.gather(*(client.score(*call) for call in calls))

    results = asyncio.run(go())
    assert [r.score for r in results] == [7.0] * 20
    assert len(api.requests) == 20
    assert api.max_in_flight == 3  # never more than allowed, and the calls did overlap


# --- pure parts ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, score", [
    ("SCORE: 7", 7.0),
    ("The completion is right.\nIt fits.\nSCORE: 6.5\n", 6.5),
    ("SCORE: 0", 0.0),
    ("SCORE: 10", 10.0),
    ("SCORE: 10.0", 10.0),
    ("  SCORE:   3  ", 3.0),
    ("First guess SCORE: 2... no.\nSCORE: 2\nOn reflection:\nSCORE: 9", 9.0),  # the last SCORE line wins
])
def test_parse_score(text, score):
    assert parse_score(text) == score


@pytest.mark.parametrize("text, why", [
    ("", "empty"),
    ("   \n ", "empty"),
    ("Looks good to me.", "no 'SCORE: <number>' line"),
    ("score: 7", "no 'SCORE: <number>' line"),
    ("The score is SCORE: 7", "no 'SCORE: <number>' line"),  # not a SCORE line: it doesn't start one
    ("SCORE: 11", "outside 0..10"),
    ("SCORE: 10.5", "outside 0..10"),
    ("SCORE: -1", "outside 0..10"),
    ("SCORE: ten", "'ten' is not a number"),
    ("SCORE:", "'' is not a number"),
    ("SCORE: 7/10", "'7/10' is not a number"),
    ("SCORE: 7 (solid)", "is not a number"),
    ("SCORE: 1e1", "is not a number"),
    ("SCORE: nan", "is not a number"),
    ("SCORE: **8**", "is not a number"),
    ("SCORE: 9\nSCORE: eleven", "'eleven' is not a number"),  # the last one counts, even when broken
])
def test_parse_score_rejects(text, why):
    with pytest.raises(JudgeParseError) as caught:
        parse_score(text)
    assert why in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_judge_messages():
    messages = build_judge_messages(PREFIX, SUFFIX, COMPLETION)
    assert [m["role"] for m in messages] == ["system", "user"]
    system, user = messages[0]["content"], messages[1]["content"]
    assert "SCORE: <number>" in system and "0" in system and "10" in system
    for word in ("correct", "fit", "style", "prefix", "suffix"):
        assert word in system.lower()
    assert user.index(PREFIX) < user.index(SUFFIX) < user.index(COMPLETION)
    assert messages == build_judge_messages(PREFIX, SUFFIX, COMPLETION)  # pure: same in, same out


def test_judge_messages_fence_outlasts_backticks_in_the_code():
    prefix = 'doc = """\n```python\nx = 1\n```\n"""\n'
    user = build_judge_messages(prefix, "", "````")[1]["content"]
    assert "`````\n" + prefix + "\n`````" in user  # five: longer than the completion's four


def test_cache_key_separates_the_texts_and_the_model():
    assert cache_key(MODEL, "ab", "c", "") != cache_key(MODEL, "a", "bc", "")
    assert cache_key(MODEL, "a", "b", "c") != cache_key("other-model", "a", "b", "c")
    assert cache_key(MODEL, "a", "b", "c") == cache_key(MODEL, "a", "b", "c")


def test_retry_after():
    now = time.time()
    assert retry_after_s("2") == 2.0
    assert retry_after_s(" 0 ") == 0.0
    assert retry_after_s(formatdate(now + 30, usegmt=True), now=now) == pytest.approx(30, abs=1)
    assert retry_after_s(formatdate(now - 30, usegmt=True), now=now) == 0.0
    assert retry_after_s(None) is None and retry_after_s("soon") is None


def test_config_checks_and_keeps_the_key_out_of_its_repr():
    cfg = JudgeConfig(api_url="https://api.example.com/v1/", api_key="sk-secret", model="m")
    assert cfg.endpoint == "https://api.example.com/v1/chat/completions"
    assert "sk-secret" not in repr(cfg)
    assert (cfg.timeout_s, cfg.max_retries, cfg.backoff_s, cfg.max_concurrency, cfg.cache_size) == (
        30, 4, 0.5, 8, 10_000)
    with pytest.raises(ValueError, match="api_url"):
        JudgeConfig(api_url="api.example.com/v1", api_key="k", model="m")
    with pytest.raises(ValueError, match="max_concurrency"):
        JudgeConfig(api_url="https://x/v1", api_key="k", model="m", max_concurrency=0)
    with pytest.raises(ValueError, match="timeout_s"):
        JudgeConfig(api_url="https://x/v1", api_key="k", model="m", timeout_s=0)
    with pytest.raises(ValueError, match="model"):
        JudgeConfig(api_url="https://x/v1", api_key="k", model="")
