"""LLM-as-judge: a second model scores a code completion 0–10 through an OpenAI-compatible chat API.

Configured like the reference recipe: a base URL, an API key and a model name
(``POST {api_url}/chat/completions``). The judge's score is one reward
component among others (``rewards.spec``), so a failure here must never
stall or fake an episode's reward: every call ends in a ``JudgeResult`` that
holds either a score or an error saying why there is none, and the composite
reward leaves a missing judge score out rather than counting it as zero.

The score is the raw 0–10 number the judge wrote; normalising it to 0..1 is
the reward layer's job.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import random
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import httpx

SCORE_MIN, SCORE_MAX = 0.0, 10.0
MALFORMED_RETRIES = 1
"""A malformed answer is asked again once: temperature 0 is not always deterministic across a
provider's replicas, but a judge that keeps answering off-format is not going to improve."""
MAX_DELAY_S = 60.0
"""No wait between attempts is longer than this, even when Retry-After asks for more: a judge call
sits on the episode path, and ``max_retries`` then bounds how long a provider can hold it up."""

_SCORE_PREFIX = "SCORE:"
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")  # plain decimal only: no exponent, nan or inf

SYSTEM_PROMPT = """\
You are a strict, experienced code reviewer grading code completions.
An editor showed a developer a completion: text inserted at the cursor, between the code before \
the cursor (the prefix) and the code after it (the suffix).
Grade how good the completion is as the code that belongs exactly between the prefix and the suffix, \
from 0 (wrong, broken or useless) to 10 (exactly what an expert would write there). Consider:
- correctness: it is valid code, does what the surrounding code needs, and introduces no bugs;
- fit: it joins the prefix and the suffix seamlessly, without repeating or contradicting either, \
and uses the names, types and conventions already in the file;
- style: it is idiomatic, readable, and no longer than it needs to be.
An empty completion scores well only if nothing belongs at the cursor.
You may reason briefly first. Then end your answer with one final line, exactly:
SCORE: <number>
where <number> is an integer or decimal from 0 to 10 (for example SCORE: 7 or SCORE: 6.5), \
with nothing else on that line and nothing after it."""


class JudgeParseError(ValueError):
    """The judge's answer has no usable final ``SCORE: <number>`` line."""


@dataclass(frozen=True)
class JudgeConfig:
    api_url: str
    """Base URL of an OpenAI-compatible API, e.g. https://api.example.com/v1."""
    api_key: str = field(repr=False)  # kept out of reprs and logs
    model: str
    timeout_s: float = 30.0
    """Per attempt: connecting, sending, and waiting for the whole answer."""
    max_retries: int = 4
    """Further attempts after a transport error, timeout, 429 or 5xx."""
    backoff_s: float = 0.5
    """First retry waits about this long, doubling each time (with jitter) unless Retry-After says otherwise."""
    max_concurrency: int = 8
    """Requests in flight to the API at once, across all callers of one client."""
    cache_size: int = 10_000
    """Scored completions remembered (LRU); 0 turns the cache off."""

    def __post_init__(self) -> None:
        if not self.api_url.startswith(("http://", "https://")):
            raise ValueError(f"judge api_url must be an http(s) base URL such as https://api.example.com/v1, "
                             f"not {self.api_url!r}")
        if not self.model:
            raise ValueError("judge model must name the model to ask")
        for name, value, least in (("timeout_s", self.timeout_s, None), ("max_retries", self.max_retries, 0),
                                   ("backoff_s", self.backoff_s, 0), ("max_concurrency", self.max_concurrency, 1),
                                   ("cache_size", self.cache_size, 0)):
            if least is None and not value > 0:
                raise ValueError(f"judge {name} must be positive, not {value!r}")
            if least is not None and not value >= least:
                raise ValueError(f"judge {name} must be at least {least}, not {value!r}")

    @property
    def endpoint(self) -> str:
        return f"{self.api_url.rstrip('/')}/chat/completions"


@dataclass(frozen=True)
class JudgeResult:
    score: float | None
    """The judge's raw 0–10 score; None when there is none (then ``error`` says why)."""
    error: str | None
    attempts: int
    """HTTP requests this call made; 0 for a cache hit."""
    cached: bool
    raw: str | None
    """The judge's last answer text, when one came back (also for an unparseable answer)."""

    @property
    def ok(self) -> bool:
        return self.score is not None


def _fence(*texts: str) -> str:
    """A backtick fence longer than any backtick run in ``texts``, so code holding ``` can't close it early."""
    longest = max((len(run) for t in texts for run in re.findall(r"`+", t)), default=0)
    return "`" * max(3, longest + 1)


def build_judge_messages(prefix: str, suffix: str, completion: str) -> list[dict]:
    """The system and user messages asking the judge to score ``completion`` between ``prefix`` and ``suffix``."""
    fence = _fence(prefix, suffix, completion)

    def block(title: str, text: str) -> str:
        return f"{title}:\n{fence}\n{text}\n{fence}"

    user = "\n\n".join([
        block("Code before the cursor (prefix)", prefix),
        block("Code after the cursor (suffix)", suffix),
        block("Completion inserted at the cursor", completion),
        "Grade the completion as the code between the prefix and the suffix. "
        "End with the final line `SCORE: <number>` (0 to 10).",
    ])
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def parse_score(text: str) -> float:
    """The number on the answer's last ``SCORE:`` line, as written (0–10); ``JudgeParseError`` otherwise.

    Strict on purpose: a guessed score (a "7/10" somewhere, a lower-case "score", a word) would be a
    silent reward for whatever the judge rambled, so only the line the prompt asked for counts.
    """
    if not isinstance(text, str) or not text.strip():
        raise JudgeParseError("the judge's answer is empty")
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(_SCORE_PREFIX)]
    if not lines:
        tail = text.strip().splitlines()[-1][:80]
        raise JudgeParseError(f"the judge's answer has no 'SCORE: <number>' line (it ends with {tail!r})")
    value = lines[-1][len(_SCORE_PREFIX):].strip()
    if not _NUMBER.fullmatch(value):
        raise JudgeParseError(f"the judge's score {value[:40]!r} is not a number (line {lines[-1][:60]!r})")
    score = float(value)
    if not SCORE_MIN <= score <= SCORE_MAX:
        raise JudgeParseError(f"the judge's score {value} is outside {SCORE_MIN:g}..{SCORE_MAX:g}")
    return score + 0.0  # "-0" is 0.0, not -0.0


def cache_key(model: str, prefix: str, suffix: str, completion: str) -> str:
    """sha256 over the model and the three texts, JSON-encoded so ("ab", "c") and ("a", "bc") differ."""
    return hashlib.sha256(json.dumps([model, prefix, suffix, completion]).encode()).hexdigest()


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT; a zone-less one is taken as such
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class _Retry(Exception):
    """One attempt failed in a way worth another try (after ``delay_s`` if the server named one)."""

    def __init__(self, reason: str, delay_s: float | None = None):
        super().__init__(reason)
        self.reason, self.delay_s = reason, delay_s


class _Fail(Exception):
    """One attempt failed in a way another try won't fix (a 4xx other than 429)."""


class _Malformed(Exception):
    """The API answered 200 but not with a usable score."""

    def __init__(self, reason: str, raw: str | None):
        super().__init__(reason)
        self.reason, self.raw = reason, raw


class JudgeClient:
    """Scores completions with the configured judge; one HTTP client and one concurrency bound for all callers.

    Create and use it inside one event loop, and ``aclose()`` it (or ``async with``) when done.
    """

    def __init__(self, config: JudgeConfig):
        self.config = config
        # No more connections than requests allowed in flight: the pool never queues behind the semaphore.
        limits = httpx.Limits(max_connections=config.max_concurrency,
                              max_keepalive_connections=config.max_concurrency)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s), limits=limits,
                                       headers={"Authorization": f"Bearer {config.api_key}"})
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self._cache: OrderedDict[str, JudgeResult] = OrderedDict()

    async def __aenter__(self) -> "JudgeClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def score(self, prefix: str, suffix: str, completion: str) -> JudgeResult:
        """The judge's score for ``completion`` between ``prefix`` and ``suffix``; failures are in the result."""
        key = cache_key(self.config.model, prefix, suffix, completion)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return replace(hit, attempts=0, cached=True)
        result = await self._ask(build_judge_messages(prefix, suffix, completion))
        if result.ok and self.config.cache_size:  # errors are not cached: the next call asks again
            self._cache[key] = result
            self._cache.move_to_end(key)
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        return result

    async def _ask(self, messages: list[dict]) -> JudgeResult:
        body = {"model": self.config.model, "messages": messages, "temperature": 0}
        attempts = retries = malformed = 0
        while True:
            attempts += 1
            try:
                raw = await self._attempt(body)
                try:
                    return JudgeResult(score=parse_score(raw), error=None, attempts=attempts, cached=False, raw=raw)
                except JudgeParseError as exc:
                    raise _Malformed(str(exc), raw) from None
            except _Malformed as exc:
                if malformed < MALFORMED_RETRIES:
                    malformed += 1
                    continue
                return JudgeResult(score=None, error=f"malformed judge answer: {exc.reason}", attempts=attempts,
                                   cached=False, raw=exc.raw)
            except _Fail as exc:
                return JudgeResult(score=None, error=str(exc), attempts=attempts, cached=False, raw=None)
            except _Retry as exc:
                if retries >= self.config.max_retries:
                    return JudgeResult(score=None, error=f"judge gave up after {attempts} attempts: {exc.reason}",
                                       attempts=attempts, cached=False, raw=None)
                retries += 1
                await asyncio.sleep(self._delay(retries, exc.delay_s))

    def _delay(self, retry: int, server_asked: float | None) -> float:
        """Retry-After when the server gave one; else exponential backoff with jitter (so callers that failed
        together don't come back together), never below half the nominal wait."""
        if server_asked is not None:
            return min(server_asked, MAX_DELAY_S)
        nominal = self.config.backoff_s * 2 ** (retry - 1)
        return min(random.uniform(nominal / 2, nominal), MAX_DELAY_S)

    async def _attempt(self, body: dict) -> str:
        """One request; the answer's text, or _Retry / _Fail / _Malformed saying what went wrong."""
        url = self.config.endpoint
        async with self._slots:  # held for the request only, not across backoff sleeps
            try:
                # httpx's timeout bounds each read; this bounds the whole exchange (a slow drip included).
                async with asyncio.timeout(self.config.timeout_s):
                    resp = await self._http.post(url, json=body)
            except (httpx.TimeoutException, TimeoutError):
                raise _Retry(f"no answer from {url} within {self.config.timeout_s:g} s") from None
            except httpx.TransportError as exc:
                raise _Retry(f"could not reach {url}: {type(exc).__name__}: {exc}") from None
        if resp.status_code == 429 or resp.status_code >= 500:
            delay = retry_after_s(resp.headers.get("retry-after")) if resp.status_code in (429, 503) else None
            raise _Retry(f"HTTP {resp.status_code} from {url}: {_error_detail(resp)}", delay)
        if resp.status_code >= 400:
            raise _Fail(f"judge API refused the request: HTTP {resp.status_code} from {url}: {_error_detail(resp)}")
        if resp.status_code != 200:
            raise _Malformed(f"HTTP {resp.status_code} from {url} is not an answer", None)
        try:
            content = resp.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Malformed(f"the response is not a chat completion with choices[0].message.content: "
                             f"{resp.text[:200]!r}", None) from None
        if not isinstance(content, str):
            raise _Malformed(f"choices[0].message.content is {type(content).__name__}, not text", None)
        return content


def _error_detail(resp: httpx.Response) -> str:
    """The OpenAI-shaped ``error.message`` when there is one, else the start of the body."""
    try:
        message = resp.json()["error"]["message"]
        if isinstance(message, str):
            return message[:300]
    except (ValueError, KeyError, TypeError):
        pass
    return resp.text[:300] or "(empty body)"
