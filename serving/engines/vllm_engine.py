"""Remote generation on one or more vLLM OpenAI-compatible servers (round-robin over healthy ones).

Each request asks for the sampled tokens' ids and logprobs (``return_token_ids``,
``logprobs: 0``) and records the prompt ids the replica tokenized the text into
(vLLM returns them as ``prompt_token_ids`` with ``return_token_ids``; so does a
``tabloop serve`` replica).

The behaviour logprob must be of the distribution the token was drawn from
(temperature, top-p: ``policy.sampling.sampling_log_probs``). vLLM returns, by
default, the *raw* logprobs (temperature 1, before top-p), and which ones it
returns is a server option, not a request field: run the replicas with
``vllm serve … --logprobs-mode processed_logprobs`` (vLLM ≥ 0.10.2), which
returns them after temperature and top-k/top-p. Without it the recorded logprobs
are right only for requests served at temperature 1 and top-p 1. Greedy requests
(temperature ≤ GREEDY_TEMPERATURE) are recorded as what they are, a point mass
(logprob 0), whatever the replica reports; what it reports becomes the token's
``gate_logprob``, the show-gate's confidence figure (a replica reports one kind of
logprob, not also those at the exploration temperature the transformers engine
gives: the gate then sees greedy lines at temperature 1). Anything that speaks
the same API works as a replica, another ``tabloop serve`` included.

The name a request asks for is the replica's own: the base model is whatever the replica lists in
``/v1/models`` (the entry with no ``parent``; vLLM lists its LoRA adapters with one), asked once per replica.
The replica is the one source of truth: it was started with some ``--served-model-name`` (or none: then its
model path, which need not be the path this door loads the tokenizer from), and no setting has to be kept in
step with it.

Adapters. A LoRA version is loaded on every replica with ``/v1/load_lora_adapter`` as ``tabloop-vN`` and
requested by that name. The served set is the adapters some project's requests ask for (the shared policy's
and each project's own; this engine serves no canaries); an adapter that leaves it is unloaded from every
replica (``/v1/unload_lora_adapter``) once no request in flight still uses it. A replica is brought to the
served set (missing adapters loaded, ``tabloop-v*`` ones no longer served unloaded, whoever loaded them) the
first time it is used, after it failed (it may come back restarted, with no adapters) and when it answers 404
for a name (it restarted between two requests): then the request is retried on it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from typing import AsyncIterator

import httpx

from infra.settings import Settings
from serving.engines.base import Engine, GenerationRequest, TokenStep
from policy.sampling import GREEDY_TEMPERATURE

log = logging.getLogger("tabloop.vllm")
UNHEALTHY_FOR_S = 5.0
ADAPTER_PREFIX = "tabloop-v"  # the adapters this engine names, and so may unload


class ReplicaOutOfStep(RuntimeError):
    """A replica could not be brought to the served set (its models unreadable, an adapter it would not load):
    it is skipped like a failed one."""


class VLLMEngine(Engine):
    name = "vllm"
    feeds_prompt_ids = False  # replicas tokenize the prompt text; they say which ids they fed (``_steps``)

    def __init__(self, settings: Settings):
        from transformers import AutoTokenizer

        from policy.named_models import resolve_model_spec  # lazy, like transformers: torch the default engine pays

        urls = [u.strip().rstrip("/") for u in settings.vllm_urls.split(",") if u.strip()]
        if not urls:
            raise ValueError("TABLOOP_ENGINE=vllm needs TABLOOP_VLLM_URLS (comma-separated base URLs)")
        self.urls = urls
        # The model's spec (a path or hub id): the tokenizer's source and the base model weight versions name.
        # Not what requests ask a replica for: that is the replica's own name (``_base_names``).
        self.model_name = resolve_model_spec(settings)
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_name)
        # project ("" = shared) -> (the adapter its requests ask for, None: the base model; version)
        self._served: dict[str, tuple[str | None, int]] = {"": (None, 0)}
        self._adapter_paths: dict[str, str] = {}  # adapter name -> its path, for each adapter loaded and not unloaded
        self._in_use: dict[str, int] = {}  # adapter name -> requests in flight asking for it
        self._base_names: dict[str, str] = {}  # url -> the base model's name on that replica (its /v1/models)
        self._synced: set[str] = set()  # replicas known to hold the served set of adapters
        self._tasks: set[asyncio.Task] = set()
        self._down_until = {u: 0.0 for u in urls}
        self._order = itertools.cycle(urls)
        headers = {"Authorization": f"Bearer {settings.vllm_api_key}"} if settings.vllm_api_key else {}
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=3.0), headers=headers)

    @property
    def tokenizer(self):
        return self._tokenizer

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        await self._http.aclose()

    def _healthy_urls(self) -> list[str]:
        now = time.monotonic()
        first = next(self._order)
        ordered = self.urls[self.urls.index(first):] + self.urls[:self.urls.index(first)]
        healthy = [u for u in ordered if self._down_until[u] <= now]
        return healthy or ordered  # all marked down: try them anyway rather than fail outright

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenStep]:
        # Text, not ids: any OpenAI-compatible server takes it (ours and vLLM tokenize the same way).
        prompt = request.prompt_text if request.prompt_text is not None else request.prompt_ids
        adapter, version = self._served.get(request.project_id) or self._served[""]
        body = {"prompt": prompt, "max_tokens": request.max_new_tokens,
                "temperature": request.temperature, "top_p": request.top_p, "stream": True, "logprobs": 0,
                "return_token_ids": True, "skip_special_tokens": False}
        if request.seed is not None:
            body["seed"] = request.seed
        with self._using(adapter):  # counted before any await: an unload of it waits for this request
            async for step in self._stream_from_replicas(body, adapter, version, request):
                yield step

    @contextlib.contextmanager
    def _using(self, adapter: str | None):
        """Count a request (a stream, a candidates read) as using ``adapter``: its unload waits until none does.
        The last one out of an adapter that left the served set meanwhile unloads it."""
        if adapter is None:
            yield
            return
        self._in_use[adapter] = self._in_use.get(adapter, 0) + 1
        try:
            yield
        finally:
            self._in_use[adapter] -= 1
            if not self._in_use[adapter]:
                del self._in_use[adapter]
                if adapter not in self._wanted():
                    self._spawn(self._unload_unserved())

    async def _stream_from_replicas(self, body: dict, adapter: str | None, version: int,
                                    request: GenerationRequest) -> AsyncIterator[TokenStep]:
        last_error: Exception | None = None
        for url in self._healthy_urls():
            emitted = False
            try:
                resp = await self._send(url, body, adapter, stream=True)
                try:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            return
                        for step in _steps(json.loads(data), version,
                                           greedy=request.temperature <= GREEDY_TEMPERATURE):
                            emitted = True
                            yield step
                    return
                finally:
                    await resp.aclose()
            except (httpx.TransportError, httpx.HTTPStatusError, ReplicaOutOfStep) as exc:
                last_error = exc
                self._mark_down(url, exc)
                if emitted:  # tokens already went to the client: don't splice another replica's
                    raise RuntimeError(f"replica {url} failed mid-completion: {exc}") from exc
        raise RuntimeError(f"no vLLM replica answered: {last_error}")

    async def _send(self, url: str, body: dict, adapter: str | None, *, stream: bool) -> httpx.Response:
        """POST ``body`` to the replica's completions under the adapter's name (or its base model's): the answer
        (a stream still open, for the caller to read and close) once the replica took the request. A replica that
        does not know the name restarted (without its adapters) or was started under another name since it was
        asked: it is brought to the served set and asked once more. A 5xx raises ``HTTPStatusError`` (the caller
        tries another replica), any other refusal ``RuntimeError`` (the request itself is at fault)."""
        for attempt in (1, 2):
            if url not in self._synced:
                await self._sync(url)
            model = adapter or self._base_names[url]
            resp = await self._http.send(self._http.build_request("POST", f"{url}/v1/completions",
                                                                  json={**body, "model": model}), stream=stream)
            if resp.status_code < 400:
                return resp
            detail = (await resp.aread()).decode(errors="replace")[:500]
            await resp.aclose()
            if resp.status_code == 404 and attempt == 1:
                log.warning("replica %s does not know model %s: bringing it to the served set", url, model)
                self._synced.discard(url)
                continue
            if resp.status_code >= 500:
                raise httpx.HTTPStatusError(f"{resp.status_code}", request=resp.request, response=resp)
            raise RuntimeError(f"replica {url} refused the request ({resp.status_code}): {detail}")
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _mark_down(self, url: str, exc: Exception) -> None:
        """Skip the replica for ``UNHEALTHY_FOR_S``; it may come back restarted, holding no adapter."""
        self._down_until[url] = time.monotonic() + UNHEALTHY_FOR_S
        self._synced.discard(url)
        log.warning("replica %s failed: %s", url, exc)

    reads_candidates = True

    async def read_continuations(self, request: GenerationRequest, continuations: list[list[int]], *,
                                 version: int | None = None) -> list[list[float]]:
        """vLLM's ``prompt_logprobs``: each continuation sent as token ids after the request's prompt ids, one
        token generated (nothing is read of it), the prompt's own log-probabilities returned (``prompt_logprobs:
        0``: the actual token's only), at temperature 1 and top-p 1 (so the replica's ``--logprobs-mode`` makes no
        difference), under the adapter the request's project is served (this engine holds one version a project,
        so ``version`` is that one)."""
        adapter, _ = self._served.get(request.project_id) or self._served[""]
        prompt = list(request.prompt_ids)
        if not prompt:
            raise ValueError("reading candidates needs the request's prompt ids")

        async def one(cont: list[int]) -> list[float]:
            if not cont:
                return []
            body = {"prompt": prompt + list(cont), "max_tokens": 1, "temperature": 1.0, "top_p": 1.0,
                    "prompt_logprobs": 0}
            answer = await self._complete(body, adapter)
            try:
                entries = answer["choices"][0]["prompt_logprobs"][len(prompt):]
                return [float(entry[str(token)]["logprob"]) for entry, token in zip(entries, cont, strict=True)]
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise RuntimeError("the replica did not return the prompt's log-probabilities (prompt_logprobs: "
                                   f"a vLLM server does): {str(answer)[:300]}") from exc

        with self._using(adapter):  # an unload of it waits for these reads, as for a stream
            return list(await asyncio.gather(*(one(c) for c in continuations)))

    async def _complete(self, body: dict, adapter: str | None) -> dict:
        """One non-streamed completion, on the first healthy replica that answers (the stream's failover and
        its one retry after a 404 for a name the replica forgot, through ``_send``)."""
        last_error: Exception | None = None
        for url in self._healthy_urls():
            try:
                return (await self._send(url, body, adapter, stream=False)).json()
            except (httpx.TransportError, httpx.HTTPStatusError, ReplicaOutOfStep) as exc:
                last_error = exc
                self._mark_down(url, exc)
        raise RuntimeError(f"no vLLM replica answered: {last_error}")

    async def load_version(self, version: int, uri: str, kind: str, *, project: str = "") -> None:
        """Serve ``version`` to the project's requests (""; every project without its own): the replicas load
        a LoRA version by adapter name, once, and each request names the adapter of its project. The adapter
        it replaces is unloaded from the replicas if no other project is served it."""
        if version == 0:
            self._set_served(project, None, 0)
        else:
            if kind != "LORA":
                raise ValueError("the vllm engine hot-loads LoRA adapters; full weights need the replicas restarted "
                                 "with the new checkpoint")
            name, path = f"{ADAPTER_PREFIX}{version}", uri.removeprefix("file://")
            self._adapter_paths[name] = path
            loaded = 0
            try:
                for url in self.urls:
                    try:
                        await self._load(url, name, path)
                        loaded += 1
                    except httpx.TransportError as exc:  # down now: it gets the served set when it is used again
                        self._synced.discard(url)
                        log.warning("replica %s is unreachable; it loads %s when it is back: %s", url, name, exc)
                if not loaded:
                    raise RuntimeError(f"no vLLM replica could be reached to load adapter {name} ({path})")
            except Exception:
                await self._unload_unserved()  # not served: off the replicas that did load it
                raise
            self._set_served(project, name, version)
        await self._unload_unserved()

    async def drop_project(self, project: str) -> None:
        if not project:
            raise ValueError("the shared policy cannot be dropped (roll it back to a version instead)")
        self._served.pop(project, None)
        await self._unload_unserved()

    def _set_served(self, project: str, name: str | None, version: int) -> None:
        self._served[project] = (name, version)
        if not project:
            self.policy_version = version

    # -- the replicas' adapters ----------------------------------------------------

    def _wanted(self) -> set[str]:
        return {name for name, _ in self._served.values() if name is not None}

    async def _load(self, url: str, name: str, path: str) -> None:
        resp = await self._http.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        if resp.status_code >= 400 and "already" not in resp.text:  # vLLM: 400 "… has already been loaded"
            # The path said here: vLLM's message says "<path>" in its place.
            raise RuntimeError(f"{url} could not load adapter {name} from {path}: {resp.status_code} "
                               f"{resp.text[:300]}")

    async def _unload(self, url: str, name: str) -> None:
        resp = await self._http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
        if resp.status_code == 404:  # not there (it restarted, or another door unloaded it): the wanted state
            return
        if resp.status_code >= 400:
            raise RuntimeError(f"{url} could not unload adapter {name}: {resp.status_code} {resp.text[:300]}")

    async def _unload_unserved(self) -> None:
        """Unload from every replica the adapters no project is served, except those requests still use."""
        for name in [n for n in self._adapter_paths if n not in self._wanted() and n not in self._in_use]:
            for url in self.urls:
                try:
                    await self._unload(url, name)
                except (httpx.TransportError, RuntimeError) as exc:  # its next sync unloads it
                    self._synced.discard(url)
                    log.warning("replica %s: adapter %s stays loaded for now: %s", url, name, exc)
            self._adapter_paths.pop(name, None)

    async def _sync(self, url: str) -> None:
        """Learn the replica's base model name and bring its ``tabloop-v*`` adapters to the served set."""
        resp = await self._http.get(f"{url}/v1/models")
        if resp.status_code >= 400:
            raise ReplicaOutOfStep(f"{url}/v1/models answered {resp.status_code}: {resp.text[:300]}")
        try:
            models = resp.json().get("data") or []
        except (ValueError, AttributeError) as exc:
            raise ReplicaOutOfStep(f"{url}/v1/models did not answer a model list: {resp.text[:300]}") from exc
        bases = [m["id"] for m in models if not m.get("parent")]
        if not bases:
            raise ReplicaOutOfStep(f"{url}/v1/models lists no base model: {models!r:.300}")
        self._base_names[url] = bases[0]
        have = {m["id"] for m in models if m.get("parent")}
        wanted = self._wanted()
        try:
            for name in sorted(wanted - have):
                await self._load(url, name, self._adapter_paths[name])
            for name in sorted(have - wanted - set(self._in_use)):
                if name.startswith(ADAPTER_PREFIX):
                    await self._unload(url, name)
        except RuntimeError as exc:
            raise ReplicaOutOfStep(str(exc)) from exc
        self._synced.add(url)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _steps(chunk: dict, version: int, *, greedy: bool = False) -> list[TokenStep]:
    """TokenSteps from one streamed completion chunk (it may carry several tokens); ``greedy``: the request
    took the argmax, whose behaviour logprob is 0 (a point mass) whatever the replica reports; the reported one
    is kept as the step's ``gate_logprob`` (how sure the model was, for the show-gate)."""
    if not chunk.get("choices"):  # the usage chunk (``stream_options.include_usage``) has none: no token
        return []
    choice = chunk["choices"][0]
    ids = choice.get("token_ids") or []
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if len(logprobs) != len(ids):
        raise RuntimeError("the replica did not return one logprob per token id (needs return_token_ids "
                           "and logprobs support)")
    gate = [float(lp) for lp in logprobs] if greedy else [None] * len(ids)
    if greedy:
        logprobs = [0.0] * len(ids)
    prompt_ids = choice.get("prompt_token_ids")
    prompt_ids = tuple(prompt_ids) if prompt_ids else None
    text, finish = choice.get("text", ""), choice.get("finish_reason")
    if not ids:
        return [TokenStep(-1, 0.0, text, version, finish, prompt_ids)] if (text or finish or prompt_ids) else []
    steps = [TokenStep(t, float(lp), "", version, None, prompt_ids if i == 0 else None, gate_logprob=g)
             for i, (t, lp, g) in enumerate(zip(ids[:-1], logprobs[:-1], gate[:-1]))]
    steps.append(TokenStep(ids[-1], float(logprobs[-1]), text, version, finish, None if steps else prompt_ids,
                           gate_logprob=gate[-1]))
    return steps


def from_settings(settings) -> VLLMEngine:
    """The engine over the vLLM replicas ``TABLOOP_VLLM_URLS`` lists (``ENGINES``)."""
    return VLLMEngine(settings)
