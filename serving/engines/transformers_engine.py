"""In-process generation with Hugging Face transformers (CPU or GPU).

One generation thread owns the model, so the event loop never waits on a
forward pass. Requests are decoded together as one left-padded batch with a KV
cache, and the batch is continuous: between two steps, requests that arrived are
prefilled and join it (up to ``max_batch`` rows), and finished rows leave it. A
request that arrives while others are decoding gets its first token after one
step, not after their whole generation (static batching made the front door's
time to first token several times the engine's under concurrent clients).

Weight versions: the shared policy's versions are whole model copies (a LoRA
version merged into a copy of the base), built off the generation thread, the
fastest to decode. A project's LoRA versions are named adapters of one peft
model over the base (one copy of the base, however many projects), and a batch
holds rows of any of them and of the base (peft's per-row adapter names). An
unmerged adapter costs more per step than a merged copy (``tabloop bench
adapters``), which only projects with versions of their own pay. Changes are
applied between steps: requests admitted afterwards see them, rows already
running finish on the version they started on, so a request runs start to end
on one version and its tokens are stamped with it.

Routes: the shared policy, and one per project that has its own promoted
version (``project``: the request's project id). A route may hold a canary: a
candidate version that serves ``share`` of its requests (decided when a request
is admitted). At most ``max_adapters`` LoRA adapters stay loaded: past that,
the project whose route was least recently used is unloaded and served by the
shared policy, and its next request loads it again in the background.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import torch
from transformers.utils import logging as hf_logging

from policy.models import CachedDecoder, load_model, lora_target_modules, read_continuations, use_torch_threads
from policy.named_models import resolve_model_spec
from policy.sampling import GREEDY_TEMPERATURE, sampling_log_probs
from serving.engines.adapter_residency import AdapterResidency, Policy, Route
from serving.engines.base import Engine, GenerationRequest, TokenStep

log = logging.getLogger("tabloop.engine")
_DONE = object()  # end of a request's token stream
_WAKE = object()  # makes an idle generation thread look at staged weights


@dataclass(eq=False)
class _Slot:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancelled: bool = False
    finished: bool = False
    generated: list[int] = field(default_factory=list)
    text_sent: int = 0
    generator: torch.Generator | None = None
    policy: Policy | None = None  # set when admitted

    def emit(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening
            self.cancelled = True

    def finish(self) -> None:
        self.finished = True
        self.emit(_DONE)


@dataclass(eq=False)
class _ReadJob:
    """A request's candidates to read (``read_continuations``), done by the generation thread between steps."""
    request: GenerationRequest
    continuations: list[list[int]]
    version: int | None
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future

    def answer(self, result) -> None:
        def settle():
            if not self.done.done():
                (self.done.set_exception if isinstance(result, BaseException) else self.done.set_result)(result)
        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody is waiting
            pass


@dataclass(eq=False)
class _Batch:
    """Rows decoded together by one model (of one version, or of several adapters of the peft model): a
    KV-cached decoder and the requests of its rows."""
    decoder: CachedDecoder
    slots: list[_Slot]

    @classmethod
    def start(cls, model: torch.nn.Module, slots: list[_Slot], pad_id: int) -> "_Batch":
        adapters = [s.policy.adapter for s in slots] if slots[0].policy.adapter is not None else None
        rows = [(tuple(s.request.prompt_ids), adapters[i] if adapters else None) for i, s in enumerate(slots)]
        unique = list(dict.fromkeys(rows))
        # Rows with the same prompt (and adapter) share one prefill, copied: a request's candidates
        # (TABLOOP_CANDIDATE_SAMPLES) pay for their prompt once, not once each.
        decoder = CachedDecoder.for_prompts(model, [list(p) for p, _ in unique], pad_id=pad_id,
                                            adapters=[a for _, a in unique] if adapters else None)
        if len(unique) < len(rows):
            if decoder.resizable:
                decoder.keep([unique.index(r) for r in rows])
            else:  # a cache rows can't be copied in: every row its own prefill
                decoder = CachedDecoder.for_prompts(model, [s.request.prompt_ids for s in slots], pad_id=pad_id,
                                                    adapters=adapters)
        for slot in slots:
            if slot.request.seed is not None:
                slot.generator = torch.Generator(device=decoder.device)
                slot.generator.manual_seed(slot.request.seed)
        return cls(decoder, slots)

    def absorb(self, other: "_Batch") -> None:
        self.decoder.merge(other.decoder)
        self.slots = self.slots + other.slots


def sample_token(logits: torch.Tensor, temperature: float, top_p: float,
                 generator: torch.Generator | None) -> tuple[int, float]:
    """(token id, its behaviour logprob) drawn from a row of logits by the sampler's own distribution.

    The distribution is ``sampling_log_probs`` — softmax(z/T) cut to the top-p nucleus and renormalised;
    the argmax with logprob 0.0 at or below GREEDY_TEMPERATURE — the same function the trainer recomputes
    the current policy with, so the ratio compares like with like.
    """
    logp = sampling_log_probs(logits, temperature, top_p)
    if temperature <= GREEDY_TEMPERATURE:
        token = int(torch.argmax(logp))
    else:
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
    return token, float(logp[token])


class TransformersEngine(AdapterResidency, Engine):
    name = "transformers"

    def __init__(self, model_spec: str, *, device: str = "cpu", max_batch: int = 8, batch_window_ms: float = 5.0,
                 policy_version: int = 0, max_adapters: int = 32):
        self.model_name = model_spec
        self.device = device
        self.max_batch = max_batch
        self.max_adapters = max_adapters
        self.batch_window_s = batch_window_ms / 1000
        self._base_model, self._tokenizer = load_model(model_spec, device=device)
        self._lora_targets = lora_target_modules(self._base_model)
        self._peft = None  # the peft model over the base, made when the first project version is loaded
        self._peft_lock = threading.Lock()  # the base is not copied while it is being wrapped
        self._routes: dict[str, Route] = {"": Route(Policy(policy_version, self._base_model))}
        self._last_used: dict[str, float] = {}  # project -> when a request last took its route (LRU)
        self._unloaded: dict[str, Route] = {}  # project -> the route unloaded past max_adapters
        self._reloading: set[str] = set()
        self._adapters_changed = False
        self.policy_version = policy_version
        self._staged: list[tuple[tuple, threading.Event, list]] = []  # changes the generation thread applies
        self._route = random.Random()
        self._lock = threading.Lock()
        eos = {self._tokenizer.eos_token_id}
        eos.discard(None)
        self.eos_ids = eos
        self.pad_id = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else min(eos)
        self._pending: queue.Queue[_Slot | None] = queue.Queue()
        self._failed: RuntimeError | None = None  # set when the generation thread has ended
        self._thread = threading.Thread(target=self._run, name="tabloop-generate", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self._tokenizer

    def served_versions(self) -> dict[str, tuple[int, int | None]]:
        """project ("" = shared) -> (promoted version, canary version or None), as requests are routed now."""
        shared = self._routes[""].promoted
        return {project: ((r.promoted or shared).version, r.candidate.version if r.candidate else None)
                for project, r in dict(self._routes).items()}

    async def close(self) -> None:
        self._pending.put(None)

    # -- the async side ---------------------------------------------------------

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenStep]:
        if self._failed is not None:
            raise self._failed
        project = request.project_id
        if project in self._unloaded and project not in self._reloading:
            self._reloading.add(project)  # served by the shared policy until its adapter is back
            asyncio.get_running_loop().create_task(self._reload(project))
        slot = _Slot(request, asyncio.get_running_loop(), asyncio.Queue())
        self._pending.put(slot)
        try:
            while True:
                item = await slot.out.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            slot.cancelled = True  # the generation thread drops the row at its next step

    reads_candidates = True

    async def read_continuations(self, request: GenerationRequest, continuations: list[list[int]], *,
                                 version: int | None = None) -> list[list[float]]:
        if self._failed is not None:
            raise self._failed
        loop = asyncio.get_running_loop()
        job = _ReadJob(request, [list(c) for c in continuations], version, loop, loop.create_future())
        self._pending.put(job)
        return await job.done

    async def load_version(self, version: int, uri: str, kind: str, *, project: str = "") -> None:
        policy = await asyncio.to_thread(self._build_version, version, uri, kind, project)
        await self._stage(("promoted", project, policy))

    async def load_candidate(self, version: int, uri: str, kind: str, share: float, *, project: str = "") -> None:
        if not 0.0 < share < 1.0:
            raise ValueError(f"a canary's share of requests must be between 0 and 1, got {share}")
        policy = await asyncio.to_thread(self._build_version, version, uri, kind, project)
        await self._stage(("candidate", project, policy, share))

    async def promote_candidate(self, *, project: str = "") -> None:
        await self._stage(("promote-candidate", project))

    async def drop_candidate(self, *, project: str = "") -> None:
        await self._stage(("drop-candidate", project))

    async def drop_project(self, project: str) -> None:
        if not project:
            raise ValueError("the shared policy cannot be dropped (roll it back to a version instead)")
        await self._stage(("drop-project", project))

    async def _reload(self, project: str) -> None:
        """Load a project's route again after it was unloaded for room (its next request asked for it)."""
        try:
            route = self._unloaded.get(project)
            if route is None:
                return
            for policy in route.policies():
                if policy is route.candidate:
                    await self.load_candidate(policy.version, *policy.source, route.share, project=project)
                else:
                    await self.load_version(policy.version, *policy.source, project=project)
            log.info("project %s: its versions %s are loaded again", project, [p.version for p in route.policies()])
        except Exception:
            log.exception("project %s: could not load its version again; the shared policy serves it", project)
        finally:
            self._reloading.discard(project)

    async def _stage(self, change: tuple) -> None:
        """Hand a change to the generation thread; return once requests that start afterwards see it."""
        applied, failure = threading.Event(), []
        with self._lock:
            self._staged.append((change, applied, failure))
        self._pending.put(_WAKE)  # an idle engine applies it at once
        await asyncio.to_thread(applied.wait)
        if failure:
            raise failure[0]

    def _build_version(self, version: int, uri: str, kind: str, project: str = "") -> Policy:
        return build_version(version, uri, kind, project, base_model=self._base_model, clean_base=self._clean_base,
                             device=self.device)

    def _clean_base(self):
        """A copy of the base model without adapters, to merge a shared LoRA version into."""
        with self._peft_lock:
            wrapped = self._peft is not None
            base = None if wrapped else copy.deepcopy(self._base_model)
        if wrapped:  # the base now holds adapters: a clean copy comes from where the base came from
            base, _ = load_model(self.model_name, device=self.device)
        return base

    # -- the generation thread --------------------------------------------------

    def _run(self) -> None:
        running: list[_Batch] = []
        waiting: list[_Slot] = []  # arrived, not admitted yet: every row is taken
        try:
            self._serve(running, waiting)
        except BaseException as exc:  # a bug here must fail the requests, not leave them waiting forever
            log.exception("the generation thread failed")
            self._failed = RuntimeError(f"the generation thread failed: {exc!r}")
            slots = [s for b in running for s in b.slots if not s.finished] + waiting
            pending = self._drain_pending()
            slots += [s for s in pending if isinstance(s, _Slot)]
            for slot in slots:
                slot.emit(self._failed)
            for job in pending:
                if isinstance(job, _ReadJob):
                    job.answer(self._failed)
            raise

    def _serve(self, running: list[_Batch], waiting: list[_Slot]) -> None:
        closing = False
        while True:
            if not running and not waiting:
                if closing:
                    self._failed = RuntimeError("the engine is closed")
                    for slot in self._drain_pending():  # came in after the last check
                        if isinstance(slot, _Slot):
                            slot.emit(self._failed)
                        elif isinstance(slot, _ReadJob):
                            slot.answer(self._failed)
                    return
                arrived = self._wait_for_requests()
            else:  # decoding: take whatever came during the last step, without waiting
                arrived = self._drain_pending()
            if None in arrived:
                closing = True
            # Between steps: requests admitted from here on see the change; running rows keep the model
            # they started on, so a request runs start to end on one version.
            self._apply_staged(running)
            if self._adapters_changed:
                self._collect_adapters(running)
            waiting += [s for s in arrived if isinstance(s, _Slot)]
            waiting = [s for s in waiting if not s.cancelled]
            for job in (a for a in arrived if isinstance(a, _ReadJob)):
                if closing:
                    job.answer(RuntimeError("the engine is shutting down"))
                else:
                    self._read(job)
            if closing:
                for slot in waiting:
                    slot.emit(RuntimeError("the engine is shutting down"))
                waiting = []
            room = self.max_batch - sum(len(b.slots) for b in running)
            if room > 0 and waiting:
                admitted, waiting = waiting[:room], waiting[room:]
                self._admit(admitted, running)
            for batch in list(running):  # each version: its own forward pass
                try:
                    done = self._advance(batch)
                except Exception as exc:  # a failed batch fails its requests, not the engine
                    log.exception("generation failed")
                    for slot in batch.slots:
                        if not slot.finished:
                            slot.emit(RuntimeError(f"generation failed: {exc}"))
                    done = True
                if done:
                    running.remove(batch)
                    self._adapters_changed = self._peft is not None

    def _wait_for_requests(self) -> list:
        """Block for the next request; then wait ``batch_window_s`` for others to share its prefill."""
        first = self._pending.get()
        arrived = [first]
        if not isinstance(first, _Slot):
            return arrived
        window_ends = time.monotonic() + self.batch_window_s
        while len(arrived) < self.max_batch:
            try:
                more = self._pending.get(timeout=max(0.0, window_ends - time.monotonic()))
            except queue.Empty:
                break
            arrived.append(more)
            if more is None:
                break
        return arrived

    def _drain_pending(self) -> list:
        arrived = []
        while True:
            try:
                arrived.append(self._pending.get_nowait())
            except queue.Empty:
                return arrived

    # -- routes and adapters (generation thread only) ----------------------------

    def _apply_staged(self, running: list[_Batch]) -> None:
        with self._lock:
            staged, self._staged = self._staged, []
        for change, applied, failure in staged:
            try:
                self._apply_change(change, running)
            except Exception as exc:  # the caller (the weight watcher) logs it and keeps what is served
                failure.append(exc)
            applied.set()
        if staged:
            self._collect_adapters(running)
            shared = self._routes[""]
            self.policy_version = shared.promoted.version
            self.candidate_version = shared.candidate.version if shared.candidate is not None else None

    def _apply_change(self, change: tuple, running: list[_Batch]) -> None:
        kind, project = change[0], change[1]
        # Made resident first: wrapping the base in the peft model rewrites the routes.
        policy = self._resident(change[2], running) if kind in ("promoted", "candidate") else None
        route = self._routes.get(project)
        label = f"project {project}" if project else "shared policy"
        if kind == "promoted":
            keep = route is not None and route.candidate is not None and route.candidate.version != policy.version
            self._routes[project] = Route(policy, route.candidate if keep else None, route.share if keep else 0.0)
            self._unloaded.pop(project, None)
            log.info("%s: now serving version %d", label, policy.version)
        elif kind == "candidate":
            share = change[3]
            self._routes[project] = Route(route.promoted if route is not None else None, policy, share)
            log.info("%s: canary version %d serves %.0f%% of requests", label, policy.version, 100 * share)
        elif kind == "promote-candidate" and route is not None and route.candidate is not None:
            self._routes[project] = Route(route.candidate)
            log.info("%s: canary promoted, now serving version %d", label, route.candidate.version)
        elif kind == "drop-candidate" and route is not None:
            if route.promoted is None:
                del self._routes[project]
            else:
                self._routes[project] = Route(route.promoted)
            log.info("%s: canary dropped", label)
        elif kind == "drop-project":
            self._routes.pop(project, None)
            self._unloaded.pop(project, None)
            log.info("%s: served by the shared policy again", label)

    def _policy_for(self, request: GenerationRequest, now: float) -> Policy:
        route = self._routes.get(request.project_id)
        if route is None:
            route = self._routes[""]
        elif request.project_id:
            self._last_used[request.project_id] = now
        coin = self._route.random() if request.route_seed is None else random.Random(request.route_seed).random()
        if route.candidate is not None and coin < route.share:
            return route.candidate
        return route.promoted if route.promoted is not None else self._routes[""].promoted

    def _reading_policy(self, job: _ReadJob) -> Policy:
        """The policy that serves the job's project, of the version asked for where its route holds it."""
        route = self._routes.get(job.request.project_id) or self._routes[""]
        shared = self._routes[""].promoted
        held = [*route.policies(), shared]
        return next((p for p in held if p.version == job.version), route.promoted or shared)

    @torch.inference_mode()
    def _read(self, job: _ReadJob) -> None:
        """The prompt once, its key/value cache copied to every continuation, then the continuations together,
        right-padded (causal attention: the padding after a row changes nothing before it); the vocabulary
        projection only where a continuation token is predicted."""
        try:
            policy = self._reading_policy(job)
            prompt, conts = list(job.request.prompt_ids), job.continuations
            width = max((len(c) for c in conts), default=0)
            if width == 0 or not prompt:
                job.answer([[] for _ in conts])
                return
            job.answer(read_continuations(policy.model, policy.adapter, prompt, conts, self.pad_id))
        except Exception as exc:  # a failed read fails its request, not the engine
            log.exception("reading candidates failed")
            job.answer(RuntimeError(f"reading candidates failed: {exc}"))

    @torch.inference_mode()
    def _admit(self, slots: list[_Slot], running: list[_Batch]) -> None:
        """Prefill newly arrived requests and add them to the running batch of their model (continuous
        batching: they get their first token at this step, not after the batch before them has finished).
        Rows of different LoRA versions share the peft model, so they decode in one batch."""
        now = time.monotonic()
        groups: dict[int, list[_Slot]] = {}
        for slot in slots:
            slot.policy = self._policy_for(slot.request, now)
            groups.setdefault(id(slot.policy.model), []).append(slot)
        for group in groups.values():
            try:
                batch = _Batch.start(group[0].policy.model, group, self.pad_id)
            except Exception as exc:
                log.exception("prefill failed")
                for slot in group:
                    slot.emit(RuntimeError(f"generation failed: {exc}"))
                continue
            joined = next((b for b in running if b.decoder.can_merge(batch.decoder)), None)
            if joined is None:
                running.append(batch)
            else:
                joined.absorb(batch)

    @torch.inference_mode()
    def _advance(self, batch: _Batch) -> bool:
        """One step of a running batch: a token for each of its rows, then one forward pass. True when done."""
        next_ids, keep = [], []
        for row, slot in enumerate(batch.slots):
            if slot.finished or slot.cancelled:
                if not slot.finished:
                    slot.finish()
                next_ids.append(self.pad_id)
                continue
            req = slot.request
            token, logprob = sample_token(batch.decoder.logits[row], req.temperature, req.top_p, slot.generator)
            gate_logprob = (None if req.gate_temperature is None else
                            float(sampling_log_probs(batch.decoder.logits[row], req.gate_temperature, req.top_p)[token]))
            slot.generated.append(token)
            finish = None
            if token in self.eos_ids:
                finish = "stop"
            elif len(slot.generated) >= req.max_new_tokens:
                finish = "length"
            slot.emit(TokenStep(token, logprob, new_text(self._tokenizer, slot, finish), slot.policy.version, finish,
                                gate_logprob=gate_logprob))
            if finish:
                slot.finish()
                next_ids.append(self.pad_id)
            else:
                next_ids.append(token)
                keep.append(row)
        if not keep:
            return True
        if batch.decoder.resizable and len(keep) < len(batch.slots):
            # Finished rows leave, so a long-running batch costs only what its live rows cost.
            batch.decoder.keep(keep)
            batch.slots = [batch.slots[r] for r in keep]
            next_ids = [next_ids[r] for r in keep]
        batch.decoder.step(torch.tensor(next_ids, device=batch.decoder.device))
        return False


def new_text(tokenizer, slot: _Slot, finish: str | None) -> str:
    """The text ``slot``'s newest token adds (held back while it ends inside a multi-byte character)."""
    ids = slot.generated[:-1] if finish == "stop" else slot.generated  # the end token shows no text
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if text.endswith("\ufffd") and not finish:
        return ""
    new, slot.text_sent = text[slot.text_sent:], len(text)
    return new


def build_version(version: int, uri: str, kind: str, project: str, *, base_model, clean_base, device: str) -> Policy:
    """A model copy for a FULL version or a shared LoRA version (merged into ``clean_base()``), loaded off the
    generation thread; a project's LoRA version is only checked here, and becomes an adapter of the peft model on
    the generation thread (``TransformersEngine._resident``)."""
    if version == 0 or not uri:
        return Policy(0, base_model)
    path = uri.removeprefix("file://")
    if kind == "LORA":
        config = Path(path) / "adapter_config.json"
        if not config.is_file():
            raise FileNotFoundError(f"version {version}: no LoRA adapter at {path} (no adapter_config.json)")
        json.loads(config.read_text())  # a broken file fails here, not on the generation thread
        if project:
            return Policy(version, base_model, adapter=f"v{version}", source=(uri, kind))
        from peft import PeftModel  # lazy: only a shared LoRA version needs it

        model = PeftModel.from_pretrained(clean_base(), path).merge_and_unload()
    elif kind == "FULL":
        model, _ = load_model(str(path), device=device)
    else:
        raise ValueError(f"unknown weight kind {kind!r} (expected LORA or FULL)")
    return Policy(version, model.eval(), source=(uri, kind))


def from_settings(settings) -> TransformersEngine:
    """The in-process engine over the model ``TABLOOP_MODEL`` names, on ``TABLOOP_DEVICE`` (``ENGINES``)."""
    hf_logging.disable_progress_bar()  # a server's log is no place for progress bars
    use_torch_threads(settings.torch_threads)
    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return TransformersEngine(resolve_model_spec(settings), device=device, max_batch=settings.max_batch,
                              batch_window_ms=settings.batch_window_ms, max_adapters=settings.max_adapters)
