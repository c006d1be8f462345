"""/v1/completions: the OpenAI legacy completions API, as Continue speaks it.

A request becomes a ``CompletionRun``: it tokenizes and trims the prompt, asks
the engine for tokens (with ``TABLOOP_CANDIDATE_SAMPLES``, for a few candidates
first, and takes the one the model finds likeliest with the suffix read after
it), cuts the text at stop strings (holding back what might
be the start of one, so a stop word never leaks into a chunk), and when it
ends — finished, cut, or abandoned by the client — hands one CompletionServed
event to the publisher. Bookkeeping never waits on Kafka.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from infra.settings import Settings
from schemas.events import Event, new_event
from schemas.token_ids import pack_ids
from serving.engines.base import Engine, GenerationRequest, TokenStep
from policy.fim import (
    QWEN_STOP_WORDS,
    build_fim_prompt,
    earliest_stop,
    parse_prompt,
    prompt_format,
    prompt_token_ids,
    safe_emit_length,
)
from policy.exploration import Sampling, choose_sampling, served_temperature
from policy.show_gate import Gate, line_features
from policy.shown import first_line, kept_token_count, shown_line, single_line_mode
from policy.value_model import candidate_continuations, posterior_pick
from serving.http import MAX_NAME_CHARS, HTTPProblem, field as body_field

MAX_STOP_WORDS = 32


@dataclass(frozen=True)
class CompletionParams:
    client_prompt: str
    """The prompt as the client sent it: what feedback's prompt hash refers to."""
    model_prompt: str
    """What the model is asked to continue (a FIM prompt built from prompt + suffix when a suffix came)."""
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    stream: bool
    logprobs: int | None
    return_token_ids: bool
    user: str | None
    model: str | None
    seed: int | None
    requested_temperature: float | None = None
    """The temperature the client asked for (None: it sent none); ``temperature`` is what is served."""
    include_usage: bool = False
    """``stream_options.include_usage``: a streamed answer ends with a chunk carrying ``usage``."""
    api: str = "completions"
    """Which response shape: "completions" (OpenAI's legacy text completions) or "fim" (Mistral's FIM API,
    whose answers are chat-completion shaped)."""


def sampling_temperature(requested: float | None, settings: Settings) -> float:
    """The temperature a request is served at when the exploration coin says exploit: what users get.

    ``TABLOOP_EXPLORATION_TEMPERATURE``, when set, for every request (an operator's override; 0 = greedy).
    Otherwise the client's temperature when it asked for one at or above ``TABLOOP_MIN_TEMPERATURE`` (it
    asked for samples: it keeps its own, and no coin is flipped). A request that sent none (Continue's
    autocomplete) or a near-greedy one (older Continue's 0.01, an explicit 0) is served greedily, the
    policy's best guess — unless the coin makes it one of the ``TABLOOP_EXPLORATION_SHARE`` exploration
    samples, drawn at ``TABLOOP_DEFAULT_TEMPERATURE``: ``request_sampling`` decides that, per completion id
    (``policy.exploration`` holds the rule). A bench that mirrors the door calls this for the temperature
    users are shown at, and ``policy.exploration`` for the explored share.
    """
    return served_temperature(requested, False, exploration_temperature=settings.default_temperature,
                              min_temperature=settings.min_temperature, override=settings.exploration_temperature)


def request_sampling(requested: float | None, completion_id: str, settings: Settings) -> Sampling:
    """How the request ``completion_id`` is served: greedy, an exploration sample (the coin, seeded by
    ``TABLOOP_EXPLORATION_SEED``, says so for ``TABLOOP_EXPLORATION_SHARE`` of the requests it applies to),
    the client's own temperature or the operator's override (``policy.exploration.choose_sampling``)."""
    return choose_sampling(requested, completion_id, share=settings.exploration_share,
                           seed=settings.exploration_seed, exploration_temperature=settings.default_temperature,
                           min_temperature=settings.min_temperature, override=settings.exploration_temperature)


def parse_completion_request(body, settings: Settings) -> CompletionParams:
    """Validate a /v1/completions body; 400 naming the field for anything we can't honour."""
    if not isinstance(body, dict):
        raise HTTPProblem(400, "request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # the OpenAI client may send a one-element list
    if not isinstance(prompt, str):
        raise HTTPProblem(400, "'prompt' is required and must be a string", param="prompt")
    suffix = body_field(body, "suffix", str)
    max_tokens = body_field(body, "max_tokens", int, default=16)
    if max_tokens < 1:
        raise HTTPProblem(400, "'max_tokens' must be at least 1", param="max_tokens")
    temperature = body_field(body, "temperature", (int, float))  # None (or near 0): greedy, or the coin explores
    if temperature is not None and not 0 <= temperature <= 2:
        raise HTTPProblem(400, "'temperature' must be between 0 and 2", param="temperature")
    top_p = float(body_field(body, "top_p", (int, float), default=1.0))
    if not 0 < top_p <= 1:
        raise HTTPProblem(400, "'top_p' must be in (0, 1]", param="top_p")
    stop = body_field(body, "stop", (str, list), default=[])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP_WORDS:
        raise HTTPProblem(400, f"'stop' must be a string or a list of at most {MAX_STOP_WORDS} strings", param="stop")
    if any(len(s) > MAX_NAME_CHARS for s in stop):
        raise HTTPProblem(400, f"each 'stop' string must be at most {MAX_NAME_CHARS} characters", param="stop")
    n = body_field(body, "n", int, default=1)
    if n != 1:
        raise HTTPProblem(400, "'n' other than 1 is not supported", param="n")
    if body_field(body, "echo", bool, default=False):
        raise HTTPProblem(400, "'echo' is not supported", param="echo")
    logprobs = body_field(body, "logprobs", (int, bool))
    if isinstance(logprobs, bool):
        logprobs = 1 if logprobs else None
    if logprobs is not None and not 0 <= logprobs <= 5:
        raise HTTPProblem(400, "'logprobs' must be between 0 and 5", param="logprobs")
    seed = body_field(body, "seed", int)
    stream_options = body_field(body, "stream_options", dict, default={})
    include_usage = body_field(stream_options, "include_usage", bool, default=False, where="stream_options.")
    if seed is not None and not -2**63 <= seed < 2**63:  # what vLLM and torch take: a 64-bit integer
        raise HTTPProblem(400, "'seed' must be a 64-bit integer", param="seed")
    return CompletionParams(
        client_prompt=prompt,
        model_prompt=build_fim_prompt(prompt, suffix) if suffix is not None else prompt,
        max_tokens=min(max_tokens, settings.max_new_tokens),
        temperature=sampling_temperature(temperature, settings),  # the run's coin may make it an exploration sample
        requested_temperature=float(temperature) if temperature is not None else None,
        top_p=top_p,
        stop=tuple(dict.fromkeys([*stop, *QWEN_STOP_WORDS])),  # the client's first, no duplicates
        stream=body_field(body, "stream", bool, default=False),
        logprobs=logprobs,
        return_token_ids=body_field(body, "return_token_ids", bool, default=False),
        user=body_field(body, "user", str, max_chars=MAX_NAME_CHARS),
        model=body_field(body, "model", str, max_chars=MAX_NAME_CHARS),
        seed=seed,
        include_usage=include_usage,
    )


def parse_fim_request(body, settings: Settings) -> CompletionParams:
    """Validate a ``/v1/fim/completions`` body, Mistral's FIM API (what openai-adapters' ``fimStream`` and
    Continue's FIM providers send): ``prompt`` is the text before the cursor, ``suffix`` the text after
    it (none: empty), ``max_completion_tokens`` stands for ``max_tokens``, ``random_seed`` for ``seed``.
    The rest is /v1/completions' request, checked by its parser."""
    if not isinstance(body, dict):
        raise HTTPProblem(400, "request body must be a JSON object")
    body = dict(body)
    body.setdefault("suffix", "")
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        body["max_tokens"] = body["max_completion_tokens"]
    if body.get("seed") is None and body.get("random_seed") is not None:
        body["seed"] = body["random_seed"]
    return replace(parse_completion_request(body, settings), api="fim")


@dataclass
class CompletionRun:
    """One completion from request to event."""

    params: CompletionParams
    engine: Engine
    settings: Settings
    project_id: str
    user_id: str
    replica_id: str
    completion_id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    aborted: bool = False
    policy_version: int | None = None
    prompt_text: str = ""
    generation: GenerationRequest | None = None
    started: float = field(default_factory=time.perf_counter)
    ttft_ms: float = 0.0
    latency_ms: float = 0.0
    prompt_ids: list[int] = field(default_factory=list)
    """The token ids the model was fed: ours after trimming, or those a remote replica reported; [] when
    a replica tokenized the text itself and did not say (the trainer then re-encodes the prompt text)."""
    token_text_ends: list[int] = field(default_factory=list)
    """Where each generated token's text ends in the generated text (``kept_token_count``)."""
    gate: Gate | None = None
    """The show-gate this request is scored with (None: everything is shown)."""
    rng: random.Random | None = None
    """Draws the gate's exploration (None: the random module's)."""
    gate_score: float | None = None
    gate_shown: bool = True
    show_probability: float = 1.0
    hidden_line: str = ""
    """The line the gate hid: on the event (what the gate decided on), never sent."""
    sampling: Sampling | None = None
    """How this request is served: greedy, an exploration sample, the client's temperature or the override
    (``request_sampling``, decided once the completion id exists; ``params.temperature`` is set to it)."""
    gate_logprobs: list[float] = field(default_factory=list)
    """The generated tokens' logprobs at the exploration temperature, the show-gate's confidence figures
    (one per token, like ``logprobs``; the behaviour logprob where the engine reported none)."""
    candidates: int = 1
    """How many candidates the shown completion was chosen among (1: served as generated)."""
    chosen_candidate: int = 0
    """Which of them: 0 the greedy one, i ≥ 1 the i-th sample (``choose_candidate``)."""
    _generated_chars: int = 0
    _prompt_ids_sent: bool = False

    def __post_init__(self) -> None:
        if self.sampling is None:
            self.sampling = request_sampling(self.params.requested_temperature, self.completion_id, self.settings)
        self.params = replace(self.params, temperature=self.sampling.temperature)

    def prepare(self) -> GenerationRequest:
        """Tokenize and trim the prompt; raises HTTPProblem before any response is started."""
        tok = self.engine.tokenizer
        # The served model's own prompt format (its FIM template, or the end of the prefix for a model
        # without FIM tokens) and its own end tokens as stop words, whatever template the client wrote.
        fmt = prompt_format(tok)
        self.params = replace(self.params, stop=tuple(dict.fromkeys([*self.params.stop, *fmt.stop_words])))
        try:
            ids, self.prompt_text = prompt_token_ids(tok, self.params.model_prompt, self.settings.max_prompt_tokens,
                                                     fmt)
        except ValueError as exc:
            raise HTTPProblem(400, str(exc), param="prompt") from None
        if not ids:  # the model has nothing to continue (and no BOS token of its own to start from)
            detail = "" if fmt.fim_tokens else " (the served model has no FIM tokens: it continues the prefix)"
            raise HTTPProblem(400, f"'prompt' is empty{detail}", param="prompt")
        self.prompt_ids = list(ids) if self.engine.feeds_prompt_ids else []
        # The show-gate scores a line on its tokens' logprobs at one temperature, the exploration one, whatever
        # this request is drawn at: a greedy token's behaviour logprob is 0 (a point mass), which says nothing
        # of how sure the model was, and a gate fit on explored lines must see greedy ones on the same scale.
        # Asked of the engine (a second distribution per token) only where a gate is learned and served.
        gate_temperature = self.settings.default_temperature
        wants_gate_figures = self.settings.show_gate and self.params.temperature != gate_temperature
        self.generation = GenerationRequest(prompt_ids=ids, max_new_tokens=self.params.max_tokens,
                                            temperature=self.params.temperature, top_p=self.params.top_p,
                                            seed=self.params.seed, prompt_text=self.prompt_text,
                                            project_id=self.project_id,
                                            gate_temperature=gate_temperature if wants_gate_figures else None)
        return self.generation

    def chooses(self) -> bool:
        """Whether this request is served by the candidate chooser: it is on, the coin said exploit (the user
        gets the policy's best guess, which the chooser makes better) and there is a suffix to read."""
        sampling = self.sampling
        return (self.settings.candidate_samples > 0 and sampling.exploration_share is not None
                and not sampling.explored and bool(parse_prompt(self.params.model_prompt).suffix))

    def _sample_request(self, generation: GenerationRequest, i: int) -> GenerationRequest:
        """The i-th sampled candidate: at the exploration temperature, seeded from the request's seed or its
        completion id (a replay draws the same candidates), by the same version as the greedy one."""
        seed = ((self.params.seed + i) % 2 ** 63 if self.params.seed is not None else
                int.from_bytes(hashlib.sha256(f"{self.completion_id}/{i}".encode()).digest()[:7], "big"))
        return replace(generation, temperature=self.settings.default_temperature, seed=seed, gate_temperature=None)

    async def _candidate_steps(self, request: GenerationRequest, single_line: bool) -> list[TokenStep]:
        """One candidate in full: its steps up to its end, or up to the step that completes a stop string, or
        in single-line mode the one that ends the first line (the editor shows nothing after it, and Continue
        stops reading there: a plain request is not generated further either). A candidate cut short ends
        with finish reason "stop"."""
        steps, text = [], ""
        async with aclosing(self.engine.stream(request)) as tokens:
            async for step in tokens:
                text += step.text
                if not step.finish_reason and (earliest_stop(text, self.params.stop) >= 0
                                               or (single_line and "\n" in text)):
                    step = replace(step, finish_reason="stop")
                steps.append(step)
                if step.finish_reason:
                    break
        return steps

    async def choose_candidate(self, generation: GenerationRequest) -> list[TokenStep]:
        """Greedy and ``TABLOOP_CANDIDATE_SAMPLES`` samples, drawn together (one version: one route seed), each
        read by the model with the first tokens of the suffix after it; the steps of the one
        ``posterior_choice`` picks (greedy on ties and when none shows anything). Records which."""
        route_seed = int.from_bytes(hashlib.sha256(self.completion_id.encode()).digest()[:7], "big")
        generation = replace(generation, route_seed=route_seed)
        requests = [generation] + [self._sample_request(generation, i)
                                   for i in range(1, self.settings.candidate_samples + 1)]
        parsed = parse_prompt(self.params.model_prompt)
        single_line = single_line_mode(parsed.prefix)
        drawn = await asyncio.gather(*(self._candidate_steps(r, single_line) for r in requests))
        texts = []
        for steps in drawn:
            text = "".join(s.text for s in steps)
            cut = earliest_stop(text, self.params.stop)
            texts.append(shown_line(text[:cut] if cut >= 0 else text, parsed.prefix) or None)
        distinct, cand_ids, continuations = candidate_continuations(texts, parsed.suffix, self.engine.tokenizer)
        version = drawn[0][0].policy_version if drawn[0] else None
        logprobs = await self.engine.read_continuations(generation, continuations, version=version)
        pick = posterior_pick(texts, distinct, cand_ids, logprobs)
        self.candidates, self.chosen_candidate = len(requests), pick
        if pick:  # a sample is served: recorded as drawn at the exploration temperature, not explored
            self.sampling = replace(self.sampling, temperature=requests[pick].temperature)
            self.params = replace(self.params, temperature=requests[pick].temperature)
        return drawn[pick]

    async def _chosen_stream(self, generation: GenerationRequest) -> AsyncIterator[TokenStep]:
        for step in await self.choose_candidate(generation):
            yield step

    def _token_stream(self) -> AsyncIterator[TokenStep]:
        generation = self.generation or self.prepare()
        return self._chosen_stream(generation) if self.chooses() else self.engine.stream(generation)

    @property
    def deciding_gate(self) -> Gate | None:
        """The gate that decided this completion: None without one, or when its first line was empty."""
        return self.gate if self.gate_score is not None else None

    def _decide(self, held: str) -> bool:
        """The show-gate's decision on the first line of ``held`` (all generated so far, nothing sent yet):
        True to send it. The line's figures are those its episode will carry: its text and its tokens'
        logprobs up to the one that ended it, cut as the event cuts them (``kept_token_count``), which is
        what ``policy.show_gate.first_line_features`` recomputes from the episode. An empty
        first line is not gated: single-line mode shows nothing anyway, and a multi-line suggestion that
        starts on the next line has no line to judge yet."""
        line = first_line(held)
        if not line.strip():
            return True
        kept = kept_token_count(self.token_text_ends, len(line))
        self.gate_score = self.gate.score(line_features(line, self.gate_logprobs[:kept]))
        self.gate_shown, self.show_probability = self.gate.decide(self.gate_score, self.rng)
        if not self.gate_shown:
            self.hidden_line, self.finish_reason = line, "stop"
        return self.gate_shown

    async def pieces(self) -> AsyncIterator[tuple[str, list[TokenStep]]]:
        """(text, the steps that made it) as soon as the text is safe to show; the last piece may be ('', []).

        With a show-gate, nothing is sent until the first line is complete (a newline, or the end): the
        gate scores it, and the held text is sent in one piece, or nothing is and generation stops."""
        pending, steps = "", []
        held, held_steps = "", []  # the text generated before the gate decides: not sent yet
        deciding = self.gate is not None
        try:
            async with aclosing(self._token_stream()) as tokens:
                async for step in tokens:
                    if not self.ttft_ms:
                        self.ttft_ms = (time.perf_counter() - self.started) * 1000
                    self.policy_version = step.policy_version
                    if step.prompt_token_ids:
                        self.prompt_ids = list(step.prompt_token_ids)
                    self._generated_chars += len(step.text)
                    if step.token_id >= 0:  # remote engines may end with a text-only step
                        self.token_ids.append(step.token_id)
                        self.logprobs.append(step.logprob)
                        self.gate_logprobs.append(step.logprob if step.gate_logprob is None else step.gate_logprob)
                        self.token_text_ends.append(self._generated_chars)
                        steps.append(step)
                    pending += step.text
                    cut = earliest_stop(pending, self.params.stop)
                    if cut >= 0:
                        self.finish_reason = "stop"
                        pending = pending[:cut]
                        break
                    if step.finish_reason:
                        self.finish_reason = step.finish_reason
                        break
                    ready = safe_emit_length(pending, self.params.stop)
                    if ready > 0:
                        piece, piece_steps = pending[:ready], steps
                        pending, steps = pending[ready:], []
                        if deciding:
                            held += piece
                            held_steps.extend(piece_steps)
                            if "\n" not in piece:  # the first line goes on: nothing is sent yet
                                continue
                            deciding = False
                            if not self._decide(held):
                                return  # hidden: leaving the block stops the generation
                            piece, piece_steps = held, held_steps
                        self.text += piece
                        yield piece, piece_steps
            if deciding:
                pending, steps = held + pending, held_steps + steps
                if not self._decide(pending):
                    return
            self.text += pending
            yield pending, steps
        except BaseException:
            self.aborted = self.finish_reason is None
            raise
        finally:
            self.latency_ms = (time.perf_counter() - self.started) * 1000
            if self.aborted:
                self.finish_reason = "abort"

    def chunk(self, text: str, steps: list[TokenStep], finish_reason: str | None) -> dict:
        choice: dict = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.params.api == "fim":
            # Mistral's FIM answers are chat completions: the text is the assistant's content (a delta when
            # streamed); ``text`` stays too, for clients that read FIM answers as text completions.
            message = {"role": "assistant", "content": text}
            choice["delta" if self.params.stream else "message"] = message
        if self.params.logprobs is not None:
            tok = self.engine.tokenizer
            choice["logprobs"] = {"tokens": [tok.decode([s.token_id]) for s in steps],
                                  "token_logprobs": [s.logprob for s in steps], "top_logprobs": None,
                                  "text_offset": None}
        if self.params.return_token_ids:
            choice["token_ids"] = [s.token_id for s in steps]
            if not self._prompt_ids_sent:  # as vLLM does: the ids this server fed the model, once
                choice["prompt_token_ids"] = self.prompt_ids
                self._prompt_ids_sent = True
        return {"id": self.completion_id, "object": self._object(), "created": self.created,
                "model": self.params.model or self.engine.model_name, "choices": [choice]}

    def _object(self) -> str:
        if self.params.api == "fim":
            return "chat.completion.chunk" if self.params.stream else "chat.completion"
        return "text_completion"

    def usage(self) -> dict:
        """OpenAI's usage: the prompt's tokens as the model was fed them, the completion's as generated."""
        prompt = len(self.prompt_ids or (self.generation.prompt_ids if self.generation else []))
        return {"prompt_tokens": prompt, "completion_tokens": len(self.token_ids),
                "total_tokens": prompt + len(self.token_ids)}

    async def sse_payloads(self) -> AsyncIterator[bytes]:
        """The streaming response: one chunk per safe piece of text, the last with the finish reason."""
        wants_tokens = self.params.logprobs is not None or self.params.return_token_ids
        async for text, steps in self.pieces():
            if text or (steps and wants_tokens):
                yield json.dumps(self.chunk(text, steps, None)).encode()
        yield json.dumps(self.chunk("", [], self.finish_reason)).encode()
        if self.params.include_usage:  # as OpenAI: one more chunk, no choices, the usage
            yield json.dumps({"id": self.completion_id, "object": self._object(), "created": self.created,
                              "model": self.params.model or self.engine.model_name, "choices": [],
                              "usage": self.usage()}).encode()

    async def complete(self) -> dict:
        all_steps = []
        async for _, steps in self.pieces():
            all_steps.extend(steps)
        body = self.chunk(self.text, all_steps, self.finish_reason)
        body["usage"] = self.usage()
        return body

    def event(self) -> Event:
        parsed = parse_prompt(self.params.model_prompt)
        # The episode trains on what the user saw plus the token that ended it, not on tokens generated
        # past a stop, held back and never sent, or read by a client that had already gone. A line the
        # gate hid is kept the same way: it is what the gate decided on.
        text = self.text if self.gate_shown else self.hidden_line
        gate = self.deciding_gate
        kept = kept_token_count(self.token_text_ends, len(text))
        ends = self.token_text_ends[:kept]
        sampling = self.sampling
        gate_logprobs = self.gate_logprobs[:kept]
        return new_event(
            "CompletionServed", completion_id=self.completion_id, project_id=self.project_id,
            user_id=self.user_id, model=self.engine.model_name,
            policy_version=self.policy_version if self.policy_version is not None else self.engine.policy_version,
            prompt=self.prompt_text or self.params.model_prompt,
            prompt_token_ids_packed=pack_ids(self.prompt_ids or ()),  # packed once, here (schemas.token_ids)
            prompt_sha256=hashlib.sha256(self.params.client_prompt.encode()).hexdigest(),
            prefix=parsed.prefix, suffix=parsed.suffix, filepath=parsed.filepath,
            completion_text=text, completion_token_ids=self.token_ids[:kept],
            completion_logprobs=self.logprobs[:kept], completion_token_ends=ends,
            finish_reason=self.finish_reason or "abort", aborted=self.aborted,
            temperature=self.params.temperature, top_p=self.params.top_p, max_tokens=self.params.max_tokens,
            requested_temperature=self.params.requested_temperature,
            explored=sampling.explored, exploration_share=sampling.exploration_share,
            candidates=self.candidates, chosen_candidate=self.chosen_candidate,
            completion_gate_logprobs=gate_logprobs if gate_logprobs != self.logprobs[:kept] else [],
            ttft_ms=self.ttft_ms, latency_ms=self.latency_ms, replica_id=self.replica_id,
            gate_version=gate.version if gate is not None else None, gate_score=self.gate_score,
            gate_threshold=gate.threshold if gate is not None else None, gate_shown=self.gate_shown,
            show_probability=self.show_probability,
        )
