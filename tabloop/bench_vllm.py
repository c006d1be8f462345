"""`tabloop bench serving --engine vllm`: a real vLLM replica asked directly, the front door over it, and the
front door over tabloop's own transformers engine, side by side in one run (issue 43, item 5).

Every side gets the same requests (the same FIM prompts, seeds, temperature and token budget),
streamed, with ``stream_options.include_usage`` so each answer says how many tokens it generated. Per side
and per concurrency (one client, then ``clients`` at once), in alternating rounds so that the machine's
other load falls on every side alike:

- TTFT (the first chunk with text) and whole-answer latency, ms, p50/p95/p99 over the rounds;
- throughput: the answers' generated tokens over the round's wall time, tokens/s, per round;
- what the door costs against vLLM itself: its throughput as a fraction of vLLM's, its TTFT p50 minus vLLM's;
- **paired TTFT** (``paired``): one client, each prompt sent to vLLM and to the door back to back, which goes
  first alternating, so the machine's load at that moment falls on both; the door's TTFT minus vLLM's per pair,
  its mean with a 90 % interval and its median (``paired_difference``). The p50s above come from different
  requests at different moments, and their difference swung wider than the 5 ms the door may cost.

The replica is started here from the vLLM environment (`tabloop vllm install`) on ``TABLOOP_MODEL``, unless
``vllm_url`` names one already running on that model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from infra.kafka_broker import free_port
from infra.settings import Settings, to_environ
from infra.vllm_env import VLLMReplica
from policy.fim import prompt_token_ids
from policy.named_models import resolve_model_spec
from tabloop.bench import _emit, _percentiles, scratch_dir, serving_prompts, wait_ready
from trainer.proof.served import mean_interval

SERVED_NAME = "tabloop-bench"
PAIRED_MAX_TOKENS = 4
"""The paired TTFT's answers are short: the first token is what is timed, and the two requests of a pair then
run seconds apart at most, under the same load."""


async def stream_one(http: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float, int]:
    """(TTFT ms, latency ms, generated tokens) of one streamed completion; TTFT is the first chunk with text
    (the end, when none has any)."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    async with http.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url} answered {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("text") for c in chunk.get("choices") or []):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    done = time.perf_counter()
    return ((first or done) - t0) * 1000, (done - t0) * 1000, tokens


def start_door(settings: Settings, log_path: Path, **update) -> tuple[subprocess.Popen, str]:
    """A `tabloop serve` process on its own ports, its state (the spool) beside its log; (the process, its
    completions URL)."""
    state = log_path.with_suffix("")
    state.mkdir(parents=True, exist_ok=True)
    s = settings.model_copy(update={"completions_port": free_port(), "feedback_port": free_port(),
                                    "state_dir": state, **update})
    with open(log_path, "wb") as log_file:  # the server keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "tabloop.cli", "serve"], stdout=log_file,
                                stderr=subprocess.STDOUT, env={**os.environ, **to_environ(s)})
    return proc, f"http://127.0.0.1:{s.completions_port}"


def bench_serving_vllm(settings: Settings, *, clients: int = 8, requests_per_client: int = 12, max_tokens: int = 32,
                       rounds: int = 2, vllm_url: str | None = None, with_transformers: bool = True) -> dict:
    """The side-by-side run (the module's docstring); its figures as one JSON line on stdout, progress on stderr."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model_dir = resolve_model_spec(settings)
    with scratch_dir("tabloop-bench-vllm-") as state:
        # The model by its directory: a named one (smollm2) lives under the configured state dir, not this one.
        settings = settings.model_copy(update={"model": model_dir, "state_dir": state, "auth": "open",
                                               "serve_host": "127.0.0.1", "max_batch": clients})
        replica = None
        if vllm_url is None:
            replica = VLLMReplica(settings.cache_dir, model_dir, port=free_port(), served_name=SERVED_NAME,
                                  log_file=state / "vllm.log")
            print(f"  starting a vLLM replica on {model_dir} …", file=sys.stderr)
            replica.start()
        doors: dict[str, tuple[subprocess.Popen, str, Path]] = {}
        try:
            vllm_url = vllm_url or replica.url
            ready_s = replica.wait_healthy() if replica is not None else 0.0
            served_name = httpx.get(f"{vllm_url}/v1/models", timeout=30).json()["data"][0]["id"]
            doors["front_door"] = (*start_door(settings, state / "door-vllm.log", engine="vllm", vllm_urls=vllm_url),
                                   state / "door-vllm.log")
            if with_transformers:
                doors["front_door_transformers"] = (
                    *start_door(settings, state / "door-transformers.log", engine="transformers"),
                    state / "door-transformers.log")
            result = asyncio.run(_measure(vllm_url, served_name, doors, clients, requests_per_client, max_tokens,
                                          rounds, model_dir, settings.max_prompt_tokens))
        finally:
            for proc, _, _ in doors.values():
                proc.terminate()
                proc.wait(30)
            if replica is not None:
                replica.stop()
    out = {"bench": "serving", "engine_kind": "vllm", "model": model_dir, "clients": clients,
           "requests_per_client": requests_per_client, "max_tokens": max_tokens, "rounds": rounds,
           "vllm_ready_s": round(ready_s, 1), **result}
    for level in [lv for lv in result if lv != "paired_ttft_one_client"]:
        sides = out[level]
        vllm_tps = statistics.median(sides["vllm"]["tokens_per_s"])
        for side in doors:
            door_tps = statistics.median(sides[side]["tokens_per_s"])
            sides[side]["throughput_vs_vllm"] = round(door_tps / vllm_tps, 3) if vllm_tps else None
            sides[side]["ttft_overhead_p50_ms"] = round(
                sides[side]["ttft_ms"]["p50"] - sides["vllm"]["ttft_ms"]["p50"], 2)
        print(f"  {level}: vLLM {vllm_tps:.1f} tokens/s, TTFT p50 {sides['vllm']['ttft_ms']['p50']} ms; "
              + "; ".join(f"{side} {sides[side]['throughput_vs_vllm']}× its throughput, TTFT p50 "
                          f"{sides[side]['ttft_overhead_p50_ms']:+.2f} ms" for side in doors), file=sys.stderr)
    for side, p in result["paired_ttft_one_client"].items():
        print(f"  paired, one client: {side} TTFT minus vLLM's over {p['pairs']} prompts: mean {p['mean_ms']:+.2f} ms "
              f"[{p['low_ms']:+.2f}, {p['high_ms']:+.2f}], median {p['median_ms']:+.2f} ms", file=sys.stderr)
    return _emit(out)


def paired_difference(door_ms: list[float], vllm_ms: list[float]) -> dict:
    """The door's TTFT minus vLLM's over pairs of the same prompt: the mean with its 90 % normal interval over
    pairs, the median, and how many pairs the door was the slower of."""
    if len(door_ms) != len(vllm_ms) or not door_ms:
        raise ValueError(f"pairs need as many door as vLLM figures, and some: {len(door_ms)} and {len(vllm_ms)}")
    diffs = [d - v for d, v in zip(door_ms, vllm_ms)]
    mean = mean_interval(diffs)
    return {"pairs": len(diffs), "mean_ms": round(mean["value"], 2), "low_ms": round(mean["low"], 2),
            "high_ms": round(mean["high"], 2), "median_ms": round(statistics.median(diffs), 2),
            "door_slower": sum(1 for d in diffs if d > 0)}


async def _measure(vllm_url: str, served_name: str, doors: dict, clients: int, requests_per_client: int,
                   max_tokens: int, rounds: int, model_dir: str, max_prompt_tokens: int) -> dict:
    n = clients * requests_per_client
    prompts = serving_prompts(n)
    # vLLM asked directly gets what the door would send it: the prompt rendered for the served model (a model
    # without FIM tokens, such as SmolLM2, continues the prefix) and trimmed to the door's budget.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model_prompts = [prompt_token_ids(tokenizer, p, max_prompt_tokens)[1] for p in prompts]
    urls = {"vllm": f"{vllm_url}/v1/completions",
            **{side: f"{base}/v1/completions" for side, (_, base, _) in doors.items()}}

    def body(side: str, i: int) -> dict:
        # No stop words: the door adds its own (special tokens' text, which vLLM ends at as end-of-text anyway),
        # and vLLM takes at most four.
        b = {"prompt": model_prompts[i] if side == "vllm" else prompts[i], "max_tokens": max_tokens,
             "temperature": 1.0, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
        return {"model": served_name, **b} if side == "vllm" else b

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=clients * 2)) as http:
        for side, (proc, base, log_path) in doors.items():
            await wait_ready(http, f"{base}/readyz", proc, log_path)

        async def one_round(side: str, concurrency: int, samples: dict | None) -> None:
            async def client(c: int) -> list[tuple[float, float, int]]:
                return [await stream_one(http, urls[side], body(side, c * requests_per_client + r))
                        for r in range(requests_per_client)]

            t0 = time.perf_counter()
            got = [x for xs in await asyncio.gather(*(client(c) for c in range(concurrency))) for x in xs]
            wall = time.perf_counter() - t0
            if samples is not None:
                samples["ttft"] += [g[0] for g in got]
                samples["latency"] += [g[1] for g in got]
                samples["tokens_per_s"].append(round(sum(g[2] for g in got) / wall, 2))

        levels = {"one_client": 1, **({f"{clients}_clients": clients} if clients > 1 else {})}
        samples = {level: {side: {"ttft": [], "latency": [], "tokens_per_s": []} for side in urls} for level in levels}
        for side in urls:  # warm-up: the first requests compile and fill caches
            await one_round(side, clients, None)
        for r in range(rounds):
            for level, concurrency in levels.items():
                for side in urls:
                    print(f"  round {r + 1}/{rounds}, {level}: {side} …", file=sys.stderr)
                    await one_round(side, concurrency, samples[level][side])
        paired = {}
        for side in doors:
            print(f"  paired TTFT, one client: {side} and vLLM, {n} prompts …", file=sys.stderr)
            door_ms, vllm_ms = [], []
            for i in range(n):
                order = ("vllm", side) if i % 2 == 0 else (side, "vllm")
                for s in order:
                    ttft = (await stream_one(http, urls[s], {**body(s, i), "max_tokens": PAIRED_MAX_TOKENS}))[0]
                    (vllm_ms if s == "vllm" else door_ms).append(ttft)
            paired[side] = paired_difference(door_ms, vllm_ms)
    out = {level: {side: {"ttft_ms": _percentiles(s["ttft"]), "latency_ms": _percentiles(s["latency"]),
                          "tokens_per_s": s["tokens_per_s"]} for side, s in sides.items()}
           for level, sides in samples.items()}
    return {**out, "paired_ttft_one_client": paired}
