"""Remote generation on one or more vLLM OpenAI-compatible servers (round-robin over healthy ones).

Each request asks for the sampled tokens' ids and logprobs (``return_token_ids``,
``logprobs: 0``) and records the prompt ids the replica tokenized the text into
(vLLM returns them as ``prompt_token_ids`` with ``return_token_ids``; so does a
``tabloop serve`` replica).

The behaviour logprob must be of the distribution the token was drawn from
(temperature, top-p: ``trainer.losses.sampling_log_probs``). vLLM returns, by
default, the *raw* logprobs (temperature 1, before top-p), and which ones it
returns is a server option, not a request field: run the replicas with
``vllm serve … --logprobs-mode processed_logprobs`` (vLLM ≥ 0.10.2), which
returns them after temperature and top-k/top-p. Without it the recorded logprobs
are right only for requests served at temperature 1 and top-p 1. Greedy requests
(temperature ≤ GREEDY_TEMPERATURE) are recorded as what they are, a point mass
(logprob 0), whatever the replica reports; what it reports becomes the token's
``gate_logprob``, the show-gate's confidence figure (a replica reports one kind of
logprob, not also those at the exploration temperature the transformers engine
gives: the gate then sees greedy lines at temperature 1). New LoRA versions are loaded on every replica with
``/v1/load_lora_adapter`` and requested by adapter name. Anything that speaks
the same API works as a replica, another ``tabloop serve`` included.
"""

from __future__ import annotations

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


class VLLMEngine(Engine):
    name = "vllm"
    feeds_prompt_ids = False  # replicas tokenize the prompt text; they say which ids they fed (``_steps``)

    def __init__(self, settings: Settings):
        from transformers import AutoTokenizer

        from policy.named_models import resolve_model_spec

        urls = [u.strip().rstrip("/") for u in settings.vllm_urls.split(",") if u.strip()]
        if not urls:
            raise ValueError("TABLOOP_ENGINE=vllm needs TABLOOP_VLLM_URLS (comma-separated base URLs)")
        self.urls = urls
        self.model_name = resolve_model_spec(settings)
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_name)
        # project ("" = shared) -> (the model name requests ask for: the base model or a LoRA adapter's, version)
        self._served: dict[str, tuple[str, int]] = {"": (self.model_name, 0)}
        self._down_until = {u: 0.0 for u in urls}
        self._order = itertools.cycle(urls)
        headers = {"Authorization": f"Bearer {settings.vllm_api_key}"} if settings.vllm_api_key else {}
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=3.0), headers=headers)

    @property
    def tokenizer(self):
        return self._tokenizer

    async def close(self) -> None:
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
        served_name, version = self._served.get(request.project_id) or self._served[""]
        body = {"model": served_name, "prompt": prompt, "max_tokens": request.max_new_tokens,
                "temperature": request.temperature, "top_p": request.top_p, "stream": True, "logprobs": 0,
                "return_token_ids": True, "skip_special_tokens": False}
        if request.seed is not None:
            body["seed"] = request.seed
        last_error: Exception | None = None
        for url in self._healthy_urls():
            emitted = False
            try:
                async with self._http.stream("POST", f"{url}/v1/completions", json=body) as resp:
                    if resp.status_code >= 500:
                        raise httpx.HTTPStatusError(f"{resp.status_code}", request=resp.request, response=resp)
                    if resp.status_code >= 400:
                        detail = (await resp.aread()).decode(errors="replace")[:500]
                        raise RuntimeError(f"replica {url} refused the request ({resp.status_code}): {detail}")
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
            except (httpx.TransportError, httpx.HTTPStatusError) as exc:
                last_error = exc
                self._down_until[url] = time.monotonic() + UNHEALTHY_FOR_S
                log.warning("replica %s failed: %s", url, exc)
                if emitted:  # tokens already went to the client: don't splice another replica's
                    raise RuntimeError(f"replica {url} failed mid-completion: {exc}") from exc
        raise RuntimeError(f"no vLLM replica answered: {last_error}")

    async def load_version(self, version: int, uri: str, kind: str, *, project: str = "") -> None:
        """Serve ``version`` to the project's requests (""; every project without its own): the replicas load
        a LoRA version by adapter name, once, and each request names the adapter of its project."""
        if version == 0:
            self._set_served(project, self.model_name, 0)
            return
        if kind != "LORA":
            raise ValueError("the vllm engine hot-loads LoRA adapters; full weights need the replicas restarted "
                             "with the new checkpoint")
        name = f"tabloop-v{version}"
        for url in self.urls:
            resp = await self._http.post(f"{url}/v1/load_lora_adapter",
                                         json={"lora_name": name, "lora_path": uri.removeprefix("file://")})
            if resp.status_code >= 400 and "already" not in resp.text:
                raise RuntimeError(f"{url} could not load adapter {name}: {resp.status_code} {resp.text[:300]}")
        self._set_served(project, name, version)

    async def drop_project(self, project: str) -> None:
        if not project:
            raise ValueError("the shared policy cannot be dropped (roll it back to a version instead)")
        self._served.pop(project, None)

    def _set_served(self, project: str, name: str, version: int) -> None:
        self._served[project] = (name, version)
        if not project:
            self.policy_version = version


def _steps(chunk: dict, version: int, *, greedy: bool = False) -> list[TokenStep]:
    """TokenSteps from one streamed completion chunk (it may carry several tokens); ``greedy``: the request
    took the argmax, whose behaviour logprob is 0 (a point mass) whatever the replica reports; the reported one
    is kept as the step's ``gate_logprob`` (how sure the model was, for the show-gate)."""
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
