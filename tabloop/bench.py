"""Benchmarks behind `tabloop bench NAME`. Each prints progress, then one JSON object on its last line."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

import httpx
from confluent_kafka import Consumer
from confluent_kafka.admin import NewTopic

from infra import bus
from infra.bus import EventProducer, ensure_topics
from infra.errors import TabloopError
from infra.files import log_tail
from infra.kafka_broker import SEVERAL_WORKERS_JOIN_WAIT_MS, LocalKafka, free_port
from infra.settings import Settings, to_environ
from policy.fim import QWEN_STOP_WORDS, build_fim_prompt
from schemas.codec import Codec
from schemas.events import EVENT_TYPES, new_event
from schemas.examples import example_event
from serving.engines import make_engine
from serving.engines.base import GenerationRequest


def _emit(result: dict) -> dict:
    print(json.dumps(result, sort_keys=True))
    return result


def stop_cleanly_on_sigterm() -> Callable[[], None]:
    """Make SIGTERM (``kill``, a CI job's timeout) end a bench through its ``finally``, which stops its
    broker and processes and removes its scratch dir; by default SIGTERM ended the process at once and left
    them running. Only the main thread can set a handler (elsewhere: nothing changes). Returns what puts
    the previous handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return lambda: signal.signal(signal.SIGTERM, previous)


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A temporary directory for a bench's broker, server and logs (under ``TMPDIR``).

    Removed when the bench ends, whether it finished or was stopped (SIGTERM, Ctrl-C): a pipeline bench's
    broker data runs to hundreds of MB, and every run used to leave its directory behind. Kept when the
    bench fails, with its path printed, since its logs say why."""
    restore = stop_cleanly_on_sigterm()
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except (KeyboardInterrupt, SystemExit):
        shutil.rmtree(path, ignore_errors=True)
        raise
    except Exception:
        print(f"  kept {path} (the bench's logs and data) for a look at what failed", file=sys.stderr)
        raise
    else:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        restore()


def bench_codec(n: int = 20_000, repeats: int = 3) -> dict:
    """Encode and decode events/s per event type, single-object format, best of ``repeats``."""
    codec = Codec()
    rng = random.Random(0)
    result: dict = {"bench": "codec", "events_per_type": n, "wire_format": codec.wire_format, "types": {}}
    for name in EVENT_TYPES:
        events = [example_event(name, i, rng) for i in range(n)]
        enc_best = dec_best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            blobs = [codec.encode(e) for e in events]
            t1 = time.perf_counter()
            for b in blobs:
                codec.decode(b)
            t2 = time.perf_counter()
            enc_best, dec_best = min(enc_best, t1 - t0), min(dec_best, t2 - t1)
        stats = {"encode_per_s": round(n / enc_best), "decode_per_s": round(n / dec_best),
                 "bytes_per_event": round(sum(map(len, blobs)) / n)}
        result["types"][name] = stats
        print(f"  {name:18s} encode {stats['encode_per_s']:>9,}/s  decode {stats['decode_per_s']:>9,}/s  "
              f"{stats['bytes_per_event']:>5} B", file=sys.stderr)
    return _emit(result)


def bench_kafka(settings: Settings, n: int = 200_000, partitions: int = 6) -> dict:
    """Produce (acks=all, idempotent) then consume n CompletionServed events on a fresh topic."""
    codec = Codec()
    topic = f"tabloop.bench.{uuid.uuid4().hex[:8]}"
    admin = bus.admin_client(settings)
    admin.create_topics([NewTopic(topic, partitions, settings.topic_replication)])[topic].result(30)
    # Pre-build the events: we measure encoding + producing, not Python's random module.
    rng = random.Random(1)
    templates = [example_event("CompletionServed", i, rng) for i in range(1000)]
    events = []
    for i in range(n):
        t = templates[i % len(templates)]
        events.append(type(t)(t.type, {**t.record, "event_id": str(uuid.UUID(int=i)),
                                       "completion_id": f"cmpl-{i}"}))
    raw_topic = f"{topic}.raw"
    admin.create_topics([NewTopic(raw_topic, partitions, settings.topic_replication)])[raw_topic].result(30)
    try:
        t0 = time.perf_counter()
        encoded = [(e.key.encode(), codec.encode(e)) for e in events]
        encode_s = time.perf_counter() - t0
        print(f"  encoded   {n:,} in {encode_s:.2f}s = {n / encode_s:,.0f}/s", file=sys.stderr)

        # The same producer on bytes already encoded: what Kafka and the client take.
        with bus.EventProducer(settings, codec, client_id="tabloop-bench") as producer:
            t0 = time.perf_counter()
            for key, value in encoded:
                producer.send_encoded(raw_topic, key, value)
            producer.flush(120)
            raw_s = time.perf_counter() - t0
        print(f"  produced  {n:,} pre-encoded in {raw_s:.2f}s = {n / raw_s:,.0f}/s (acks=all)", file=sys.stderr)
        del encoded

        # The real path: publish() encodes each event and sends it.
        with bus.EventProducer(settings, codec, client_id="tabloop-bench") as producer:
            t0 = time.perf_counter()
            for e in events:
                producer.publish(e, topic=topic)
            producer.flush(120)
            produce_s = time.perf_counter() - t0
        print(f"  published {n:,} in {produce_s:.2f}s = {n / produce_s:,.0f}/s (encode + acks=all)",
              file=sys.stderr)

        consumer = bus.EventConsumer(settings, f"bench-{uuid.uuid4().hex[:6]}", [topic], codec,
                                     client_id="tabloop-bench")
        got, errors = 0, 0
        t0 = None
        deadline = time.monotonic() + 120
        while got < n and time.monotonic() < deadline:
            batch = consumer.poll(2000, 1.0)
            if batch and t0 is None:
                t0 = time.perf_counter()
            got += len(batch)
            errors += sum(1 for r in batch if r.error is not None)
        consume_s = time.perf_counter() - (t0 or time.perf_counter())
        consumer.close()
        print(f"  consumed  {got:,} in {consume_s:.2f}s = {got / consume_s:,.0f}/s (with decoding), "
              f"decode errors {errors}", file=sys.stderr)
    finally:
        admin.delete_topics([topic, raw_topic])
    size = len(codec.encode(events[0]))
    return _emit({"bench": "kafka", "events": n, "event_type": "CompletionServed", "bytes_per_event": size,
                  "partitions": partitions, "acks": "all", "produce_per_s": round(n / produce_s),
                  "produce_preencoded_per_s": round(n / raw_s), "encode_per_s": round(n / encode_s),
                  "consume_per_s": round(got / consume_s), "consumed": got, "decode_errors": errors,
                  "produce_mb_per_s": round(n * size / produce_s / 1e6, 1)})


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    if len(values) == 1:  # one request (the smallest runs): every percentile is it
        return dict.fromkeys(("p50", "p95", "p99"), round(values[0], 2))
    qs = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(qs[49], 2), "p95": round(qs[94], 2), "p99": round(qs[98], 2)}


def bench_adapters(settings: Settings, *, rows: int = 8, adapters: int = 4, prompt_repeats: int = 8,
                   steps: int = 24, rounds: int = 3, rank: int = 16) -> dict:
    """One decode step of ``rows`` rows, ms, side by side in each round: a LoRA version merged into a model
    copy (how the shared policy's versions are served), one unmerged adapter of a peft model (a project's
    version), ``adapters`` adapters mixed in one batch (several projects), and base rows through the peft
    model; and the time to load one adapter into it (random adapters of rank ``rank``, on TABLOOP_MODEL)."""
    # Lazy here and in bench_serving: the model code loads torch (seconds), which the codec, Kafka and
    # pipeline benches of this module must not pay.
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    from policy.models import CachedDecoder, load_model, lora_target_modules, use_torch_threads
    from trainer.build_models import build_named_model

    use_torch_threads(settings.torch_threads)
    spec = build_named_model(settings)
    base, tokenizer = load_model(spec)
    targets = lora_target_modules(base)
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i in range(adapters):
            torch.manual_seed(i)
            config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
            get_peft_model(copy.deepcopy(base), config).save_pretrained(Path(tmp) / f"a{i}")
            paths.append(str(Path(tmp) / f"a{i}"))
        merged = PeftModel.from_pretrained(copy.deepcopy(base), paths[0]).merge_and_unload().eval()
        peft = get_peft_model(base, LoraConfig(r=1, target_modules=targets), adapter_name="zero").eval()
        loads = []
        for i, path in enumerate(paths):
            started = time.perf_counter()
            peft.load_adapter(path, adapter_name=f"v{i}")
            loads.append((time.perf_counter() - started) * 1000)
    text = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(prompt_repeats))
    prompts = [tokenizer.encode(f"# row {r}\n" + text, add_special_tokens=False) for r in range(rows)]

    def step_ms(model, names) -> float:
        with torch.inference_mode():
            decoder = CachedDecoder.for_prompts(model, prompts, pad_id=0, adapters=names)
            started = time.perf_counter()
            for _ in range(steps):
                decoder.step(torch.full((rows,), 5, device=decoder.device))
            return (time.perf_counter() - started) / steps * 1000

    cases = {"merged_copy": (merged, None), "one_adapter": (peft, ["v0"] * rows),
             f"{adapters}_adapters_mixed": (peft, [f"v{r % adapters}" for r in range(rows)]),
             "base_rows_via_peft": (peft, ["__base__"] * rows)}
    per_round = [{name: round(step_ms(*case), 1) for name, case in cases.items()} for _ in range(rounds)]
    ratios = [{name: round(r[name] / r["merged_copy"], 2) for name in cases} for r in per_round]
    return _emit({"bench": "adapters", "model": spec, "rows": rows, "prompt_tokens": max(len(p) for p in prompts),
                  "rank": rank, "step_ms": per_round, "vs_merged": ratios,
                  "adapter_load_ms": [round(x) for x in loads]})


def serving_prompts(n: int) -> list[str]:
    """``n`` different FIM prompts of the same shape: what the serving benches send."""
    return [build_fim_prompt(f"def handler_{i}(request):\n    data = ", "\n    return data\n") for i in range(n)]


async def wait_ready(http: httpx.AsyncClient, probe_url: str, proc: subprocess.Popen | None, log_path: Path,
                     timeout_s: float = 300.0) -> None:
    """Until ``probe_url`` (a front door's /readyz) answers 200; raises with the log's tail if ``proc`` exited
    first or it never did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the front door exited ({proc.returncode}):\n{log_tail(log_path)}")
        try:
            if (await http.get(probe_url)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{probe_url} was not ready after {timeout_s:.0f} s:\n{log_tail(log_path)}")


def bench_serving(settings: Settings, *, clients: int = 8, requests_per_client: int = 12, max_tokens: int = 32,
                  rounds: int = 2) -> dict:
    """N concurrent streaming clients against the bare engine (in this process) and against the front door
    (a `tabloop serve` process on the same model, as a client would see it), in alternating rounds; ms."""
    from trainer.build_models import build_named_model  # lazy: torch (see bench_adapters)

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the figures
    with scratch_dir("tabloop-bench-serving-") as state:
        settings = settings.model_copy(update={
            "model": build_named_model(settings), "state_dir": state, "completions_port": free_port(),
            "feedback_port": free_port(), "auth": "open", "serve_host": "127.0.0.1", "max_batch": clients})
        log_path = state / "serve.log"
        engine = make_engine(settings)
        prompts = serving_prompts(clients * requests_per_client)
        tokenized = [engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        url = f"http://127.0.0.1:{settings.completions_port}/v1/completions"

        async def bare_one(i: int, samples: dict) -> None:
            t0 = time.perf_counter()
            first, text = None, ""
            async for step in engine.stream(GenerationRequest(tokenized[i], max_tokens, 1.0, 1.0, seed=i)):
                # TTFT on both sides = the first text a user could see: the front door sends no chunk for a
                # step without text (a token ending inside a UTF-8 character, which random-weight models make
                # often), so counting such a step here would flatter the engine.
                if first is None and step.text:
                    first = time.perf_counter()
                text += step.text
                if any(s in text for s in QWEN_STOP_WORDS):  # the front door stops there too
                    break
            done = time.perf_counter()
            samples["latency"].append((done - t0) * 1000)
            samples["ttft"].append(((first or done) - t0) * 1000)  # no text at all: the end, as the door's last chunk

        async def door_one(http: httpx.AsyncClient, i: int, samples: dict) -> None:
            t0 = time.perf_counter()
            first = line_done = None
            text = ""
            body = {"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 1.0, "seed": i, "stream": True}
            async with http.stream("POST", url, json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and first is None:
                        first = time.perf_counter()
                    if line.startswith("data: {") and line_done is None:
                        choices = json.loads(line[6:]).get("choices") or [{}]
                        text += choices[0].get("text") or ""
                        if "\n" in text:
                            line_done = time.perf_counter()
            done = time.perf_counter()
            samples["latency"].append((done - t0) * 1000)
            samples["ttft"].append((first - t0) * 1000)
            if "first_line" in samples:
                # What the show-gate's hold makes the first byte: the door sends nothing until the first line
                # is complete (its newline, or the end of the answer), then scores it in microseconds.
                samples["first_line"].append(((line_done or done) - t0) * 1000)

        async def run_clients(one) -> None:
            async def client(c: int) -> None:
                for r in range(requests_per_client):
                    await one(c * requests_per_client + r)
            await asyncio.gather(*(client(c) for c in range(clients)))

        results = {"engine": {"latency": [], "ttft": []}, "front_door": {"latency": [], "ttft": [], "first_line": []}}
        scratch = {"latency": [], "ttft": []}

        async def main() -> None:
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients * 2)) as http:
                await wait_ready(http, url.replace("/v1/completions", "/readyz"), server, log_path)
                await run_clients(lambda i: bare_one(i, scratch))  # warm-up, both sides
                await run_clients(lambda i: door_one(http, i, scratch))
                for r in range(rounds):
                    print(f"  round {r + 1}/{rounds}: engine …", file=sys.stderr)
                    await run_clients(lambda i: bare_one(i, results["engine"]))
                    print(f"  round {r + 1}/{rounds}: front door …", file=sys.stderr)
                    await run_clients(lambda i: door_one(http, i, results["front_door"]))

        # Started once the engine here has loaded, so that a model that fails to load leaves no server behind.
        with open(log_path, "wb") as log_file:  # the server keeps its own copy of the descriptor
            server = subprocess.Popen([sys.executable, "-m", "tabloop.cli", "serve"], stdout=log_file,
                                      stderr=subprocess.STDOUT, env={**os.environ, **to_environ(settings)})
        try:
            asyncio.run(main())
        finally:
            server.terminate()
            server.wait(30)
    out = {"bench": "serving", "model": engine.model_name, "engine_kind": engine.name, "clients": clients,
           "requests": clients * requests_per_client * rounds, "max_tokens": max_tokens}
    for name, samples in results.items():
        out[name] = {"latency_ms": _percentiles(samples["latency"]), "ttft_ms": _percentiles(samples["ttft"])}
    # The show-gate's hold: its first byte comes when the first line is complete; the last byte does not move
    # (the rest streams as before, or nothing more is generated when the gate hides the line).
    out["front_door"]["gated_ttft_ms"] = _percentiles(results["front_door"]["first_line"])
    # What the front door adds, to the whole answer and to the first token (what a user feels), at the
    # median and at p95: the goal is within 5 % or 2 ms of the engine at p50, 10 % at p95.
    for what, key in (("latency_ms", "overhead"), ("ttft_ms", "ttft_overhead")):
        for q in ("p50", "p95"):
            engine_q, door_q = out["engine"][what][q], out["front_door"][what][q]
            out[f"{key}_{q}_ms"] = round(door_q - engine_q, 2)
            out[f"{key}_{q}_ratio"] = round(door_q / engine_q - 1, 4) if engine_q else None
    print(f"  TTFT p50 engine {out['engine']['ttft_ms']['p50']} ms, "
          f"front door {out['front_door']['ttft_ms']['p50']} ms; "
          f"p95 {out['engine']['ttft_ms']['p95']} vs {out['front_door']['ttft_ms']['p95']} ms; latency p50 "
          f"{out['engine']['latency_ms']['p50']} vs {out['front_door']['latency_ms']['p50']} ms", file=sys.stderr)
    return _emit(out)


def _pipeline_events(n: int, seed: int, start_ms: int, prefix: str, step_ms: float = 1.0) -> tuple[list, list]:
    """``n`` completions and one feedback for each: half carry our id (our API), half only the prompt
    and the text the IDE showed (Continue), which the worker matches by prompt within its window."""
    rng = random.Random(seed)
    completions, feedback = [], []
    for i in range(n):
        project, user = f"p{i % 4}", f"u{i % 16}"
        prompt = f"<|fim_prefix|>def f_{prefix}_{i}(x):\n    return <|fim_suffix|>\n<|fim_middle|>"
        sha = hashlib.sha256(prompt.encode()).hexdigest()
        text = f"x + {i}"
        tokens = rng.randrange(8, 64)
        served = datetime.fromtimestamp((start_ms + i * step_ms) / 1000, timezone.utc)
        received = datetime.fromtimestamp((start_ms + i * step_ms + 1) / 1000, timezone.utc)
        cid = f"cmpl-{prefix}-{i}"
        completions.append(new_event(
            "CompletionServed", completion_id=cid, served_at=served, project_id=project, user_id=user,
            model="bench", policy_version=0, prompt=prompt, prompt_sha256=sha, completion_text=text,
            completion_token_ids=[rng.randrange(50_000) for _ in range(tokens)],
            completion_logprobs=[-rng.random() for _ in range(tokens)], finish_reason="stop", aborted=False,
            temperature=0.2, top_p=1.0, max_tokens=64, ttft_ms=5.0, latency_ms=20.0, replica_id="bench"))
        outcome = "ACCEPTED" if rng.random() < 0.3 else "REJECTED"
        if i % 2:
            feedback.append(new_event("FeedbackReceived", project_id=project, user_id=user, source="api",
                                      completion_id=cid, outcome=outcome, raw_payload="{}", received_at=received))
        else:
            feedback.append(new_event("FeedbackReceived", project_id=project, user_id=user, source="continue-fork",
                                      client_completion_id=f"continue-{prefix}-{i}", prompt=prompt,
                                      prompt_sha256=sha, completion=text[:3], outcome=outcome, raw_payload="{}",
                                      received_at=received))
    return completions, feedback


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux): a figure the machine's other load does not skew."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_pipeline(settings: Settings, *, n: int = 20_000, rate: int = 1000, seconds: float = 20.0,
                   guarantee: str = "exactly_once", workers: int = 1) -> dict:
    """``workers`` streams workers (one consumer group, the topics' partitions shared out) on a broker of
    their own.

    1. Throughput: ``n`` completions and ``n`` feedback already on the topics; episodes/s from the
       first episode to the last (start-up, group forming included, is reported apart).
    2. Latency: with the worker caught up, completions and feedback published at ``rate`` feedback/s
       for ``seconds``; latency = feedback published → its episode readable (read_committed).
    """
    if not 1 <= workers <= settings.topic_partitions:
        raise TabloopError(f"--workers {workers}: give 1 to the topics' {settings.topic_partitions} partitions "
                           "(TABLOOP_TOPIC_PARTITIONS); a worker past that would get no partition")
    with scratch_dir("tabloop-bench-pipeline-") as work:
        s = settings.model_copy(update={"state_dir": work, "kafka_bootstrap": f"127.0.0.1:{free_port()}",
                                        "topic_partitions": settings.topic_partitions})
        # Workers started together join one generation of the group (startup is reported apart).
        broker = LocalKafka(s, group_join_wait_ms=SEVERAL_WORKERS_JOIN_WAIT_MS if workers > 1 else 0)
        codec = Codec()
        arrivals: dict[str, float] = {}  # feedback event id -> when its episode was readable
        stop_reading = threading.Event()

        def read_episodes() -> None:
            c = Consumer({"bootstrap.servers": s.kafka_bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:6]}",
                          "auto.offset.reset": "earliest", "enable.auto.commit": False,
                          "isolation.level": "read_committed"})
            c.subscribe(["tabloop.episodes"])
            while not stop_reading.is_set():
                for m in c.consume(1000, 0.2):
                    if m.error() is None:
                        arrivals.setdefault(codec.decode(m.value()).record["feedback_event_id"], time.perf_counter())
            c.close()

        def wait_for(ids: list[str], timeout_s: float, label: str) -> float | None:
            deadline, last_print = time.monotonic() + timeout_s, 0.0
            while time.monotonic() < deadline:
                done = sum(1 for i in ids if i in arrivals)
                if time.monotonic() - last_print > 5:
                    print(f"  {label}: {done:,}/{len(ids):,} episodes", file=sys.stderr)
                    last_print = time.monotonic()
                if done == len(ids):
                    return max(arrivals[i] for i in ids)
                for i, worker in enumerate(pool):
                    if worker.poll() is not None:
                        log_file = work / f"streams-{i}.log"
                        raise RuntimeError(f"streams worker {i} exited with {worker.returncode}; "
                                           f"the end of {log_file}:\n{log_tail(log_file, 40)}")
                time.sleep(0.2)
            return None

        pool: list[subprocess.Popen] = []
        reader = threading.Thread(target=read_episodes, daemon=True)
        try:
            print(f"  starting a broker of its own on {s.kafka_bootstrap}", file=sys.stderr)
            broker.start()
            ensure_topics(s)
            now = int(time.time() * 1000)
            completions, feedback = _pipeline_events(n, 1, now - 60_000, "load")
            with EventProducer(s, codec) as producer:
                for e in completions + feedback:
                    producer.publish(e)
            print(f"  {n:,} completions and {n:,} feedback on the topics", file=sys.stderr)
            reader.start()
            t_start = time.perf_counter()
            for i in range(workers):  # each its own state dir (Faust's data dir), one consumer group
                pool.append(subprocess.Popen(
                    [sys.executable, "-m", "tabloop.cli", "streams", "--guarantee", guarantee],
                    stdout=open(work / f"streams-{i}.log", "ab"), stderr=subprocess.STDOUT,
                    env={**os.environ, **to_environ(s.model_copy(update={"state_dir": work / f"worker-{i}"}))}))
            ids = [f.event_id for f in feedback]

            def pool_cpu() -> float:
                return sum(_cpu_seconds(w.pid) for w in pool)

            cpu_start = None
            while cpu_start is None and all(w.poll() is None for w in pool):  # CPU from the first episode on
                if arrivals:
                    cpu_start = pool_cpu()
                time.sleep(0.05)
            t_end = wait_for(ids, max(600.0, n / 20), "backlog")
            cpu_backlog = pool_cpu() - (cpu_start or 0.0)
            if t_end is None:
                raise RuntimeError(f"the workers did not finish {n:,} episodes in time; see {work}/streams-*.log")
            t_first = min(arrivals[i] for i in ids)
            throughput = (n - 1) / (t_end - t_first)
            print(f"  backlog: {n:,} episodes, {throughput:,.0f}/s after a start-up of {t_first - t_start:.1f}s; "
                  f"{cpu_backlog / n * 1000:.2f} ms of worker CPU per episode ({workers} worker(s))", file=sys.stderr)

            # Live: each completion shortly before its feedback, feedback at ``rate`` per second.
            m = int(rate * seconds)
            completions, feedback = _pipeline_events(m, 2, int(time.time() * 1000), "live", 1000 / rate)
            sent: dict[str, float] = {}
            with EventProducer(s, codec) as producer:
                t0 = time.perf_counter()
                for i, (c, f) in enumerate(zip(completions, feedback)):
                    target = t0 + i / rate
                    if (pause := target - time.perf_counter()) > 0:
                        time.sleep(pause)
                    producer.publish(c)
                    sent[f.event_id] = time.perf_counter()
                    producer.publish(f)
                achieved = m / (time.perf_counter() - t0)
            # A worker slower than the feedback rate drains what piled up at its backlog pace.
            done = wait_for(list(sent), max(60 + seconds * 10, 2 * m / throughput), "live")
            latencies = [(arrivals[i] - t) * 1000 for i, t in sent.items() if i in arrivals]
            print(f"  live: {len(latencies):,}/{m:,} episodes at {achieved:,.0f} feedback/s", file=sys.stderr)
        finally:
            stop_reading.set()
            for worker in pool:
                worker.terminate()
            for worker in pool:
                try:
                    worker.wait(30)
                except subprocess.TimeoutExpired:
                    worker.kill()
            broker.stop()
    lat = _percentiles(latencies)
    return _emit({"bench": "pipeline", "guarantee": guarantee, "partitions": s.topic_partitions,
                  "workers": workers, "backlog_episodes": n, "episodes_per_s": round(throughput),
                  "worker_cpu_ms_per_episode": round(cpu_backlog / n * 1000, 3),
                  "episodes_per_worker_cpu_s": round(n / cpu_backlog) if cpu_backlog else None,
                  "worker_startup_s": round(t_first - t_start, 1),
                  "feedback_rate_per_s": round(achieved), "live_episodes": len(latencies),
                  "live_complete": done is not None,
                  "latency_ms_p50": lat.get("p50"), "latency_ms_p99": lat.get("p99"),
                  "goal": {"episodes_per_s": 5000, "latency_ms_p99": 500, "at_feedback_per_s": 1000}})
