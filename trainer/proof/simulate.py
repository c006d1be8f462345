"""Simulated Continue users: real FIM tasks, real HTTP, real accept/reject decisions.

Each simulated user behaves like the Continue extension talking to
``tabloop serve``:

* it builds Qwen FIM prompts from tasks (``trainer.proof.tasks``), sometimes with
  repo and file context (``<|repo_name|>``/``<|file_sep|>``);
* it streams ``POST /v1/completions`` with Continue's body (model, prompt,
  max_tokens, temperature, top_p, penalties, Continue's stop list,
  ``stream: true``) and both auth headers;
* while "typing", it fires a request for a shorter prefix and drops it after
  the first chunk (an abandoned request); then it waits out the debounce;
* with the cursor in the middle of a line (Continue's single-line mode) it
  stops reading at the first newline;
* it shows what is left after Continue's clean-up (nothing for an empty
  suggestion), decides per its user model, and reports the decision through
  its feedback route: the fork's ``/api/training/submit``, stock Continue's
  ``data:`` destination (``/api/continue/events``), or our ``/v1/feedback``.

Beside the characters a user accepts it counts those it keeps (``kept_characters``): of an accepted
suggestion, the part that agrees with the code that truly follows the cursor, so a half-right line accepted
in full counts half.

The decision rules (``UserModel``), what is kept and the payload builders are pure
functions; ``simulate`` is the I/O.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Callable, Sequence

import httpx

from policy.agreement import common_prefix_length
from policy.fim import QWEN_STOP_WORDS
from policy.shown import first_line, shown_text, single_line_mode
from rewards import sandbox
from rewards.spec import acceptance_reward
from trainer.metrics import edit_similarity
from trainer.proof.tasks import FimTask

# What Continue sends as `stop` for a Qwen coder model: the model's own special
# tokens, then the ones Continue adds for every model.
CONTINUE_STOPS = (*QWEN_STOP_WORDS, "\n\n", "\r\n\r\n", "/src/", "#- coding: utf-8", "```")
ROUTES = ("fork", "data", "api")
RULES = ("exact", "similarity", "tests")
MODEL_NAME = "qwen2.5-coder-1.5b"


# -- what the user sees and decides (pure; what is shown: policy.shown) ------------------

@dataclass(frozen=True)
class UserModel:
    """When a simulated user presses Tab.

    ``exact`` (default): the suggestion's first line is exactly the rest of the
    true line. ``similarity``: its edit similarity to the rest of the true line
    is at least ``threshold``. ``tests``: the file with the suggestion passes
    the task's tests.
    """

    rule: str = "exact"
    threshold: float = 0.8

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"user model rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"similarity threshold must be in [0, 1], got {self.threshold}")

    def accepts(self, task: FimTask, shown: str, *, run_tests: Callable[[str, str], bool] | None = None) -> bool:
        """``run_tests(source, tests)`` decides the tests rule: the file with the suggestion, the task's tests."""
        if self.rule == "tests":
            if task.test is None:
                raise ValueError(f"the tests rule needs tasks with tests; {task.task_id} has none")
            if run_tests is None:
                raise ValueError("the tests rule needs a test runner")
            return run_tests(task.source_with(shown), task.test)
        return self.takes_line(shown, task.true_line_rest)

    def takes_line(self, shown: str, true_line_rest: str) -> bool:
        """The ``exact`` and ``similarity`` rules: ``shown``'s first line against the true rest of the line."""
        got, want = first_line(shown).rstrip(), true_line_rest.rstrip()
        if self.rule == "exact":
            return bool(want) and got == want
        if self.rule == "tests":
            raise ValueError("the tests rule decides by running the file, not by the line")
        return edit_similarity(got, want) >= self.threshold


def kept_characters(completion: str, truth: str) -> int:
    r"""How many characters of an accepted ``completion`` the user keeps: the length of its longest common
    prefix with ``truth``, the code that truly follows the cursor (``true_continuations``).

    A user who presses Tab takes the whole suggestion, then edits what is wrong; the characters up to the
    first one that differs from the true code are what stays (a character may match again later, but once
    the text has gone wrong what follows is retyped, not kept). So a half-right line accepted in full counts
    half, where accepted characters count it whole:

    >>> kept_characters("compute(2)", "compute(1)")
    8
    >>> kept_characters("return x\n    y = 2", "return x\n    z = 3\n")
    13
    >>> kept_characters("", "x"), kept_characters("abc", "")
    (0, 0)

    Never more than ``len(completion)`` nor ``len(truth)``: text written past the true continuation (the
    suffix that is already in the file, repeated) is not kept.
    """
    return common_prefix_length(completion, truth)


def true_continuations(task: FimTask, *, single_line: bool) -> tuple[str, ...]:
    """What truly follows the cursor, for ``kept_characters``: in single-line mode (Continue shows one line)
    the rest of the true line (``task.true_line_rest``); otherwise the task's whole middle, all its lines.
    Not the suffix: it is already in the editor after the cursor, so a suggestion that writes it out again
    keeps nothing by doing so. (A one-line suggestion's common prefix with the middle ends at the middle's
    first newline anyway; the two cases differ only in what a multi-line suggestion is compared with.)

    One per right answer: the middle first, then the task's other ``solutions`` (HumanEval's), cut alike."""
    answers = dict.fromkeys((task.middle, *task.solutions))
    return tuple(first_line(a) if single_line else a for a in answers)


def kept_chars_of(task: FimTask, shown: str | None, accepted: bool) -> int:
    """The kept characters of one request: 0 unless the user accepted what was shown; else the longest common
    prefix of what was shown with a true continuation (``kept_characters``, ``true_continuations``)."""
    if shown is None or not accepted:
        return 0
    return max(kept_characters(shown, truth)
               for truth in true_continuations(task, single_line=single_line_mode(task.prefix)))


def outcome_of(shown: str | None, accepted: bool) -> str:
    """What a request's suggestion came to: nothing shown is IGNORED (the user decided nothing)."""
    return "IGNORED" if shown is None else ("ACCEPTED" if accepted else "REJECTED")


def decision_rows(tasks: Sequence[FimTask], completions: Sequence[str], user: UserModel, spec) -> list[dict]:
    """One row per completion: what the editor shows, whether ``user`` takes it, the outcome and its reward
    under ``spec`` (a ``rewards.spec.RewardSpec``), the accepted characters (all of what was shown, when
    taken) and the kept ones (``kept_chars_of``: of those, the ones that are right). The same rows score the
    held-out tasks of ``tabloop bench loop``, ``tabloop eval --scorer user`` and the offline trainer's user scorer; the
    ``tests`` rule runs the file in the sandbox, as the simulated users do."""
    if len(tasks) != len(completions):
        raise ValueError(f"{len(tasks)} tasks but {len(completions)} completions")
    rows = []
    for task, completion in zip(tasks, completions):
        shown = shown_text(completion, single_line=single_line_mode(task.prefix))
        accepted = shown is not None and user.accepts(task, shown, run_tests=sandbox_passes)
        outcome = outcome_of(shown, accepted)
        rows.append({"task_id": task.task_id, "completion": completion, "shown": shown, "accepted": accepted,
                     "accepted_chars": len(shown) if accepted else 0,
                     "kept_chars": kept_chars_of(task, shown, accepted), "outcome": outcome,
                     "reward": acceptance_reward(spec, outcome), "reference": task.middle})
    return rows


def sandbox_passes(source: str, tests: str | None = None) -> bool:
    """The file passes the tests, run in the sandbox with the verdict decided by the judge outside it."""
    return sandbox.run_tests(source, tests=tests, timeout_s=10.0).passed


# -- what Continue sends (pure) ----------------------------------------------------------

def completion_body(prompt: str, *, max_tokens: int, temperature: float) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "top_p": 1, "frequency_penalty": 0, "presence_penalty": 0, "stop": list(CONTINUE_STOPS),
            "stream": True}


def fork_payload(task: FimTask, prompt: str, shown: str, accepted: bool, *, client_id: str, decision_ms: int,
                 unique_id: str, now: datetime | None = None) -> dict:
    """The Continue fork's ``completionTrackingUrl`` body (flat)."""
    return {"completionId": client_id, "filepath": task.filepath or "untitled.py", "prefix": task.prefix,
            "suffix": task.suffix, "prompt": prompt, "completion": shown, "modelProvider": "openai",
            "modelName": MODEL_NAME, "accepted": accepted, "timestamp": _iso(now), "time": decision_ms,
            "uniqueId": unique_id, "numLines": shown.count("\n") + 1, "cacheHit": False}


def data_event(task: FimTask, prompt: str, shown: str, accepted: bool, *, client_id: str, decision_ms: int,
               unique_id: str, user_id: str, now: datetime | None = None) -> dict:
    """Stock Continue's ``data:`` destination body for an autocomplete event (schema 0.2.0, level all)."""
    data = {"eventName": "autocomplete", "schema": "0.2.0", "timestamp": _iso(now), "userId": user_id,
            "userAgent": "tabloop-simulator", "selectedProfileId": "local", "accepted": accepted,
            "time": decision_ms, "prefix": task.prefix, "suffix": task.suffix, "prompt": prompt,
            "completion": shown, "modelProvider": "openai", "modelName": MODEL_NAME, "cacheHit": False,
            "filepath": task.filepath or "untitled.py", "gitRepo": task.repo or "", "completionId": client_id,
            "uniqueId": unique_id, "numLines": shown.count("\n") + 1}
    return {"name": "autocomplete", "schema": "0.2.0", "level": "all", "profileId": "local", "data": data}


def api_payload(completion_id: str, shown: str, accepted: bool, *, decision_ms: int) -> dict:
    """Our ``/v1/feedback``: ACCEPTED or REJECTED, with the text taken."""
    body = {"completion_id": completion_id, "outcome": "ACCEPTED" if accepted else "REJECTED",
            "time_to_decision_ms": decision_ms}
    if accepted:
        body["accepted_text"] = shown
    return body


FEEDBACK_PATHS = {"fork": "/api/training/submit", "data": "/api/continue/events", "api": "/v1/feedback"}
EVENT_SOURCES = {"fork": "continue-fork", "data": "continue-data", "api": "api"}


def _iso(now: datetime | None) -> str:
    return (now or datetime.now(timezone.utc)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# -- the run ----------------------------------------------------------------------------------

@dataclass
class SimConfig:
    completions_url: str = "http://127.0.0.1:8081"
    feedback_url: str = "http://127.0.0.1:8082"
    users: int = 8
    requests: int | None = 200
    """Completed (not abandoned) requests over all users; None: until ``duration_s``."""
    duration_s: float | None = None
    rule: str = "exact"
    threshold: float = 0.8
    routes: tuple[str, ...] = ROUTES
    """Feedback route of user i: routes[i % len(routes)]."""
    context_share: float = 0.3
    abandon_share: float = 0.15
    debounce_s: float = 0.15
    think_s: float = 0.0
    max_tokens: int = 48
    temperature: float = 0.01
    seed: int = 0
    api_keys: Sequence[str] = ()
    """One per user (cycled); empty: open auth, identified by X-Project-ID/X-User-ID."""
    project: str = "sim"
    timeout_s: float = 120.0
    progress_every_s: float = 5.0

    def __post_init__(self) -> None:
        if self.users < 1:
            raise ValueError(f"users must be at least 1, got {self.users}")
        if self.requests is None and self.duration_s is None:
            raise ValueError("give a number of requests or a duration")
        bad = [r for r in self.routes if r not in ROUTES]
        if bad or not self.routes:
            raise ValueError(f"feedback routes must be among {', '.join(ROUTES)}, got {', '.join(self.routes)}")
        for name in ("context_share", "abandon_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        UserModel(self.rule, self.threshold)


@dataclass
class RequestRecord:
    user: int
    task_id: str
    route: str
    completion_id: str | None
    prompt_sha256: str
    with_context: bool
    suggestion: str = ""
    shown: str | None = None
    accepted: bool = False
    accepted_chars: int = 0
    kept_chars: int = 0
    """Of the accepted characters, those the user keeps (``kept_chars_of``: the common prefix with the task's
    true continuation); 0 when not accepted."""
    feedback_event_id: str | None = None
    policy_version: int | None = None
    gate_version: int | None = None
    """The show-gate version that decided it (the door's ``X-Tabloop-Gate-Version``; None: no gate)."""
    error: str | None = None
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    feedback_status: int | None = None
    """The feedback route's HTTP status (None: not sent, or no answer)."""
    sent_at: float | None = None
    """Wall-clock time (epoch seconds) the completion request went out."""
    feedback_sent_at: float | None = None
    """Wall-clock time the feedback went out (None: none sent)."""


@dataclass
class HttpCall:
    """One HTTP request the simulator made, for checks that need every answer (fault drills)."""

    kind: str  # completion | abandoned | feedback
    started_at: float  # wall-clock seconds
    ended_at: float
    status: int | None  # None: no answer (refused, reset, timed out)
    error: str | None = None


@dataclass
class SimReport:
    records: list[RequestRecord] = field(default_factory=list)
    abandoned: int = 0
    errors: int = 0
    feedback_errors: int = 0
    wall_s: float = 0.0
    calls: list[HttpCall] = field(default_factory=list)

    def by_version(self) -> dict[int, dict]:
        """The summary of the requests each policy version served (abandoned ones aside)."""
        versions = sorted({r.policy_version for r in self.records if r.policy_version is not None})
        out = {}
        for v in versions:
            part = SimReport(records=[r for r in self.records if r.policy_version == v])
            s = part.summary()
            for k in ("requests", "abandoned", "errors", "feedback_errors", "wall_s", "policy_versions"):
                s.pop(k)
            out[v] = s
        return out

    def summary(self) -> dict:
        done = [r for r in self.records if r.error is None]
        shown = [r for r in done if r.shown is not None]
        accepted = [r for r in shown if r.accepted]
        lat = sorted(r.latency_ms for r in done)
        ttft = sorted(r.ttft_ms for r in done if r.ttft_ms is not None)
        return {
            "requests": len(self.records) + self.abandoned, "completed": len(done), "abandoned": self.abandoned,
            "errors": self.errors, "shown": len(shown), "accepted": len(accepted),
            "feedback_sent": sum(1 for r in shown if r.feedback_event_id), "feedback_errors": self.feedback_errors,
            "accept_rate_shown": _ratio(len(accepted), len(shown)), "shown_share": _ratio(len(shown), len(done)),
            "accepted_chars_per_request": _ratio(sum(r.accepted_chars for r in accepted), len(done)),
            "kept_chars_per_request": _ratio(sum(r.kept_chars for r in accepted), len(done)),
            "latency_p50_ms": _pct(lat, 0.5), "latency_p95_ms": _pct(lat, 0.95), "ttft_p50_ms": _pct(ttft, 0.5),
            "policy_versions": sorted({r.policy_version for r in done if r.policy_version is not None}),
            "wall_s": round(self.wall_s, 2),
        }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1)


class _Stream:
    """One streamed completion: its id, text, and timings."""

    def __init__(self) -> None:
        self.completion_id: str | None = None
        self.policy_version: int | None = None
        self.gate_version: int | None = None
        self.text = ""
        self.ttft_ms: float | None = None
        self.latency_ms = 0.0


class Simulation:
    def __init__(self, tasks: Sequence[FimTask], config: SimConfig, *,
                 log: Callable[[str], None] | None = None, user_model=None):
        """``user_model``: who decides (anything with ``UserModel.accepts``, e.g. a team's user,
        ``trainer.proof.teams.TeamUsers``); None: ``UserModel(config.rule, config.threshold)``."""
        if not tasks:
            raise ValueError("no tasks to simulate users on")
        self.tasks = list(tasks)
        self.config = config
        self.user_model = user_model or UserModel(config.rule, config.threshold)
        if config.rule == "tests":
            missing = [t.task_id for t in self.tasks if t.test is None]
            if missing:
                raise ValueError(f"the tests rule needs tasks with tests; {len(missing)} have none "
                                 f"(e.g. {missing[0]})")
        self.report = SimReport()
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._claimed = 0
        self._deadline: float | None = None
        self._sandbox_lock = asyncio.Lock()

    def _claim(self) -> bool:
        if self._deadline is not None and time.monotonic() > self._deadline:
            return False
        if self.config.requests is not None:
            if self._claimed >= self.config.requests:
                return False
            self._claimed += 1
        return True

    def _headers(self, user: int) -> dict:
        keys = self.config.api_keys
        if keys:
            key = keys[user % len(keys)]
            return {"Authorization": f"Bearer {key}", "api-key": key}
        return {"X-Project-ID": self.config.project, "X-User-ID": f"sim-{user}"}

    async def run(self) -> SimReport:
        c = self.config
        started = time.monotonic()
        if c.duration_s is not None:
            self._deadline = started + c.duration_s
        limits = httpx.Limits(max_connections=c.users * 3, max_keepalive_connections=c.users * 2)
        async with httpx.AsyncClient(timeout=httpx.Timeout(c.timeout_s), limits=limits) as http:
            progress = asyncio.create_task(self._progress())
            try:
                await asyncio.gather(*(self._user(http, i) for i in range(c.users)))
            finally:
                progress.cancel()
        self.report.wall_s = time.monotonic() - started
        return self.report

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.config.progress_every_s)
            s = self.report.summary()
            self.log(f"simulate: {s['completed']} completed, {s['abandoned']} abandoned, {s['shown']} shown, "
                     f"{s['accepted']} accepted, {s['errors']} errors")

    async def _user(self, http: httpx.AsyncClient, user: int) -> None:
        c = self.config
        rng = random.Random(f"{c.seed}:user:{user}")
        route = c.routes[user % len(c.routes)]
        unique_id = f"sim-machine-{user}"
        while self._claim():
            task = rng.choice(self.tasks)
            with_context = rng.random() < c.context_share and bool(task.context_files or task.repo)
            prompt = task.fim_prompt(with_context=with_context)
            if rng.random() < c.abandon_share and len(task.prefix) > 3:
                # Still typing: a request for the line so far, dropped once its first chunk arrives.
                typed = task.prefix[:-rng.randint(1, 3)]
                early = FimTask(task.task_id, typed, task.suffix, task.middle, filepath=task.filepath,
                                repo=task.repo, context_files=task.context_files)
                try:
                    await self._stream(http, user, early.fim_prompt(with_context=with_context), abandon=True)
                except (httpx.HTTPError, _HTTPStatus):
                    pass  # an abandoned request's fate doesn't matter to the user
                self.report.abandoned += 1
            await asyncio.sleep(c.debounce_s)
            record = RequestRecord(user=user, task_id=task.task_id, route=route, completion_id=None,
                                   prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(),
                                   with_context=with_context)
            self.report.records.append(record)
            record.sent_at = time.time()
            try:
                s = await self._stream(http, user, prompt, stop_at_newline=single_line_mode(task.prefix))
            except (httpx.HTTPError, _HTTPStatus) as exc:
                record.error = f"{type(exc).__name__}: {exc}"
                self.report.errors += 1
                continue
            record.completion_id, record.policy_version = s.completion_id, s.policy_version
            record.gate_version = s.gate_version
            record.suggestion, record.latency_ms, record.ttft_ms = s.text, s.latency_ms, s.ttft_ms
            record.shown = shown_text(s.text, single_line=single_line_mode(task.prefix))
            if record.shown is None:
                continue  # nothing shown, nothing to report: Continue sends no event
            if c.rule == "tests":
                # One sandbox run at a time: runs under one uid share its process limit and could signal
                # each other (rewards.sandbox), and they are CPU-bound anyway.
                async with self._sandbox_lock:
                    record.accepted = await asyncio.to_thread(self.user_model.accepts, task, record.shown,
                                                              run_tests=sandbox_passes)
            else:
                record.accepted = self.user_model.accepts(task, record.shown)
            record.accepted_chars = len(record.shown) if record.accepted else 0
            record.kept_chars = kept_chars_of(task, record.shown, record.accepted)
            decision_ms = rng.randint(250, 1500) if record.accepted else rng.randint(600, 10_000)
            if c.think_s:
                await asyncio.sleep(c.think_s)
            await self._send_feedback(http, user, route, task, prompt, record, decision_ms, unique_id)

    async def _send_feedback(self, http: httpx.AsyncClient, user: int, route: str, task: FimTask, prompt: str,
                             record: RequestRecord, decision_ms: int, unique_id: str) -> None:
        client_id = str(uuid.uuid4())  # Continue's own id, never the server's
        if route == "fork":
            body = fork_payload(task, prompt, record.shown, record.accepted, client_id=client_id,
                                decision_ms=decision_ms, unique_id=unique_id)
        elif route == "data":
            body = data_event(task, prompt, record.shown, record.accepted, client_id=client_id,
                              decision_ms=decision_ms, unique_id=unique_id, user_id=f"sim-{user}")
        else:
            if record.completion_id is None:
                self.report.feedback_errors += 1
                return
            body = api_payload(record.completion_id, record.shown, record.accepted, decision_ms=decision_ms)
        started = record.feedback_sent_at = time.time()
        try:
            resp = await http.post(f"{self.config.feedback_url}{FEEDBACK_PATHS[route]}", json=body,
                                   headers={**self._headers(user), "Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            self.report.calls.append(HttpCall("feedback", started, time.time(), None, type(exc).__name__))
            self.report.feedback_errors += 1
            self.log(f"simulate: feedback via {route} failed: {type(exc).__name__}: {exc}")
            return
        self.report.calls.append(HttpCall("feedback", started, time.time(), resp.status_code))
        record.feedback_status = resp.status_code
        if resp.status_code != 202:
            self.report.feedback_errors += 1
            self.log(f"simulate: feedback via {route} got HTTP {resp.status_code}: {resp.text[:200]}")
            return
        record.feedback_event_id = resp.json().get("event_id")

    async def _stream(self, http: httpx.AsyncClient, user: int, prompt: str, *, abandon: bool = False,
                      stop_at_newline: bool = False) -> _Stream:
        c = self.config
        out = _Stream()
        body = completion_body(prompt, max_tokens=c.max_tokens, temperature=c.temperature)
        started = time.monotonic()
        call = HttpCall("abandoned" if abandon else "completion", time.time(), 0.0, None)
        self.report.calls.append(call)
        try:
            return await self._read_stream(http, user, body, out, started, call, abandon, stop_at_newline)
        except httpx.HTTPError as exc:
            call.error = type(exc).__name__
            raise
        finally:
            call.ended_at = time.time()

    async def _read_stream(self, http: httpx.AsyncClient, user: int, body: dict, out: _Stream, started: float,
                           call: HttpCall, abandon: bool, stop_at_newline: bool) -> _Stream:
        async with http.stream("POST", f"{self.config.completions_url}/v1/completions", json=body,
                               headers=self._headers(user)) as resp:
            call.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                raise _HTTPStatus(f"HTTP {resp.status_code}: {resp.text[:200]}")
            out.completion_id = resp.headers.get("x-tabloop-completion-id")
            version = resp.headers.get("x-tabloop-policy-version")
            out.policy_version = int(version) if version and version.isdigit() else None
            gate = resp.headers.get("x-tabloop-gate-version")
            out.gate_version = int(gate) if gate and gate.isdigit() else None
            async for line in resp.aiter_lines():
                if line.startswith(": ping"):
                    break  # Continue ends the stream on a ping comment
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                piece = chunk["choices"][0].get("text") or ""
                if piece and out.ttft_ms is None:
                    out.ttft_ms = (time.monotonic() - started) * 1000
                out.text += piece
                if abandon and out.text:
                    break  # leaving the block closes the connection: the server sees the abort
                if stop_at_newline and "\n" in out.text:
                    break  # single-line mode: Continue stops reading at the line's end
        out.latency_ms = (time.monotonic() - started) * 1000
        return out


class _HTTPStatus(Exception):
    """A non-200 answer to a completion request."""


def simulate(tasks: Sequence[FimTask], config: SimConfig, **kwargs) -> SimReport:
    """Run the simulation to the end (blocking); see ``Simulation``."""
    return asyncio.run(Simulation(tasks, config, **kwargs).run())


def records_jsonl(report: SimReport) -> str:
    return "".join(json.dumps(asdict(r)) + "\n" for r in report.records)


def calls_jsonl(report: SimReport) -> str:
    return "".join(json.dumps(asdict(c)) + "\n" for c in report.calls)


def summary_rate(summary: dict) -> str:
    """One human line for a summary."""
    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"
    return (f"{summary['completed']} completions ({summary['abandoned']} abandoned, {summary['errors']} errors): "
            f"shown {pct(summary['shown_share'])}, accepted {pct(summary['accept_rate_shown'])} of shown, "
            f"{summary['accepted_chars_per_request'] or 0:.2f} accepted chars/request, "
            f"{summary.get('kept_chars_per_request') or 0:.2f} kept")

