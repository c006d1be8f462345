"""In-process generation with Hugging Face transformers (CPU or GPU).

One generation thread owns the model, so the event loop never waits on a
forward pass. Requests are decoded together as one left-padded batch with a KV
cache, and the batch is continuous: between two steps, requests that arrived are
prefilled and join it (up to ``max_batch`` rows), and finished rows leave it. A
request that arrives while others are decoding gets its first token after one
step, not after their whole generation (static batching made the front door's
time to first token several times the engine's under concurrent clients).

Weight versions are loaded into a second model copy off the generation thread
and swapped in between steps: requests admitted afterwards run on the new
version, rows already running finish on theirs, so a request runs start to end
on one version and its tokens are stamped with it. Each version decodes as its
own batch.

Canary: a candidate version can be held next to the promoted one; each request
goes to it with probability ``share`` (decided when it is admitted) and decodes
in the candidate's batch.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from serving.engines.base import Engine, GenerationRequest, TokenStep
from trainer.losses import GREEDY_TEMPERATURE, sampling_log_probs
from trainer.models import CachedDecoder

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

    def emit(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening
            self.cancelled = True

    def finish(self) -> None:
        self.finished = True
        self.emit(_DONE)


@dataclass(eq=False)
class _Batch:
    """Rows decoded together on one model version: a KV-cached decoder and the requests of its rows."""
    version: int
    decoder: CachedDecoder
    slots: list[_Slot]

    @classmethod
    def start(cls, model: torch.nn.Module, version: int, slots: list[_Slot], pad_id: int) -> "_Batch":
        decoder = CachedDecoder.for_prompts(model, [s.request.prompt_ids for s in slots], pad_id=pad_id)
        for slot in slots:
            if slot.request.seed is not None:
                slot.generator = torch.Generator(device=decoder.device)
                slot.generator.manual_seed(slot.request.seed)
        return cls(version, decoder, slots)

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


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, model_spec: str, *, device: str = "cpu", max_batch: int = 8, batch_window_ms: float = 5.0,
                 policy_version: int = 0):
        from trainer.models import load_model

        self.model_name = model_spec
        self.device = device
        self.max_batch = max_batch
        self.batch_window_s = batch_window_ms / 1000
        self._base_model, self._tokenizer = load_model(model_spec, device=device)
        self._model = self._base_model
        self.policy_version = policy_version
        self._staged: list[tuple[object, threading.Event]] = []  # changes the generation thread applies
        self._candidate: tuple[torch.nn.Module, int, float] | None = None  # (model, version, share)
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

    async def close(self) -> None:
        self._pending.put(None)

    # -- the async side ---------------------------------------------------------

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenStep]:
        if self._failed is not None:
            raise self._failed
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

    async def load_version(self, version: int, uri: str, kind: str) -> None:
        model = await asyncio.to_thread(self._build_version, version, uri, kind)
        await self._stage(("promoted", model, version))

    async def load_candidate(self, version: int, uri: str, kind: str, share: float) -> None:
        if not 0.0 < share < 1.0:
            raise ValueError(f"a canary's share of requests must be between 0 and 1, got {share}")
        model = await asyncio.to_thread(self._build_version, version, uri, kind)
        await self._stage(("candidate", model, version, share))

    async def promote_candidate(self) -> None:
        await self._stage(("promote-candidate",))

    async def drop_candidate(self) -> None:
        await self._stage(("drop-candidate",))

    async def _stage(self, change: tuple) -> None:
        """Hand a change to the generation thread; return once requests that start afterwards see it."""
        applied = threading.Event()
        with self._lock:
            self._staged.append((change, applied))
        self._pending.put(_WAKE)  # an idle engine applies it at once
        await asyncio.to_thread(applied.wait)

    def _build_version(self, version: int, uri: str, kind: str) -> torch.nn.Module:
        if version == 0 or not uri:
            return self._base_model
        path = uri.removeprefix("file://")
        if kind == "LORA":
            from peft import PeftModel

            model = PeftModel.from_pretrained(copy.deepcopy(self._base_model), path).merge_and_unload()
        elif kind == "FULL":
            from trainer.models import load_model

            model, _ = load_model(str(path), device=self.device)
        else:
            raise ValueError(f"unknown weight kind {kind!r} (expected LORA or FULL)")
        return model.eval()

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
            slots += [s for s in self._drain_pending() if isinstance(s, _Slot)]
            for slot in slots:
                slot.emit(self._failed)
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
                    return
                arrived = self._wait_for_requests()
            else:  # decoding: take whatever came during the last step, without waiting
                arrived = self._drain_pending()
            if None in arrived:
                closing = True
            # Between steps: requests admitted from here on see the change; running rows keep the model
            # they started on, so a request runs start to end on one version.
            self._apply_staged()
            waiting += [s for s in arrived if isinstance(s, _Slot)]
            waiting = [s for s in waiting if not s.cancelled]
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

    def _split(self, slots: list[_Slot]) -> list[tuple[torch.nn.Module, int, list[_Slot]]]:
        """(model, version, slots) groups: the canary's share of requests goes to the candidate."""
        if self._candidate is None:
            return [(self._model, self.policy_version, slots)]
        cand_model, cand_version, share = self._candidate
        to_candidate = [self._route.random() < share for _ in slots]
        groups = [(self._model, self.policy_version, [s for s, c in zip(slots, to_candidate) if not c]),
                  (cand_model, cand_version, [s for s, c in zip(slots, to_candidate) if c])]
        return [g for g in groups if g[2]]

    def _apply_staged(self) -> None:
        with self._lock:
            staged, self._staged = self._staged, []
        for change, applied in staged:
            kind = change[0]
            if kind == "promoted":
                self._model, self.policy_version = change[1], change[2]
                if self._candidate is not None and self._candidate[1] == change[2]:
                    self._candidate = None
                log.info("now serving policy version %d", self.policy_version)
            elif kind == "candidate":
                self._candidate = (change[1], change[2], change[3])
                log.info("canary: version %d serves %.0f%% of requests", change[2], 100 * change[3])
            elif kind == "promote-candidate" and self._candidate is not None:
                self._model, self.policy_version = self._candidate[0], self._candidate[1]
                self._candidate = None
                log.info("canary promoted: now serving policy version %d", self.policy_version)
            elif kind == "drop-candidate":
                self._candidate = None
                log.info("canary dropped: serving policy version %d only", self.policy_version)
            self.candidate_version = self._candidate[1] if self._candidate is not None else None
            applied.set()

    @torch.inference_mode()
    def _admit(self, slots: list[_Slot], running: list[_Batch]) -> None:
        """Prefill newly arrived requests and add them to the running batch of their model (continuous
        batching: they get their first token at this step, not after the batch before them has finished)."""
        for model, version, group in self._split(slots):
            try:
                batch = _Batch.start(model, version, group, self.pad_id)
            except Exception as exc:
                log.exception("prefill failed")
                for slot in group:
                    slot.emit(RuntimeError(f"generation failed: {exc}"))
                continue
            joined = next((b for b in running if b.version == version and b.decoder.can_merge(batch.decoder)), None)
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
            slot.generated.append(token)
            finish = None
            if token in self.eos_ids:
                finish = "stop"
            elif len(slot.generated) >= req.max_new_tokens:
                finish = "length"
            slot.emit(TokenStep(token, logprob, self._new_text(slot, finish), batch.version, finish))
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

    def _new_text(self, slot: _Slot, finish: str | None) -> str:
        """The text the newest token adds (held back while it ends inside a multi-byte character)."""
        ids = slot.generated[:-1] if finish == "stop" else slot.generated  # the end token shows no text
        text = self._tokenizer.decode(ids, skip_special_tokens=False)
        if text.endswith("\ufffd") and not finish:
            return ""
        new, slot.text_sent = text[slot.text_sent:], len(text)
        return new
