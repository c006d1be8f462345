"""Continuous batching: rows join a decoding batch between steps and leave it when done, and each row's
logits are what it would get decoded alone (policy.models.CachedDecoder.merge/keep, the transformers
engine's admission)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from serving.engines.base import GenerationRequest
from policy.models import CachedDecoder, load_model


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_llama):
    return load_model(tiny_llama)


def _alone(model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The logits predicting each of ``tokens`` (and the one after) with the prompt decoded by itself."""
    decoder = CachedDecoder.for_prompts(model, [prompt], pad_id=0)
    out = [decoder.logits[0]]
    for t in tokens:
        out.append(decoder.step(torch.tensor([t]))[0])
    return out


@torch.inference_mode()
def test_rows_that_join_and_leave_a_batch_get_the_logits_they_get_alone(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    long_prompt = tokenizer.encode("def mean(values):\n    total = sum(values)\n    return", add_special_tokens=False)
    short_prompt = tokenizer.encode("import os\n", add_special_tokens=False)
    other_prompt = tokenizer.encode("class Point:\n    def __init__(self, x, y):\n", add_special_tokens=False)
    assert len(short_prompt) < len(long_prompt)
    tokens = [5, 17, 23, 42, 8, 11]

    batch = CachedDecoder.for_prompts(model, [long_prompt], pad_id=0)
    batch.step(torch.tensor([tokens[0]]))
    batch.step(torch.tensor([tokens[1]]))
    # A short prompt joins a batch that is two tokens in (its rows are longer: it gets left-padded), then a
    # long one that is longer than the batch (the batch gets left-padded).
    assert batch.resizable
    joining = CachedDecoder.for_prompts(model, [short_prompt], pad_id=0)
    batch.merge(joining)
    assert batch.rows == 2
    long_alone, short_alone = _alone(model, long_prompt, tokens), _alone(model, short_prompt, tokens)
    assert torch.allclose(batch.logits[0], long_alone[2], atol=1e-4)
    assert torch.allclose(batch.logits[1], short_alone[0], atol=1e-4)
    batch.step(torch.tensor([tokens[2], tokens[0]]))
    later = CachedDecoder.for_prompts(model, [other_prompt + other_prompt], pad_id=0)
    batch.merge(later)
    other_alone = _alone(model, other_prompt + other_prompt, tokens)
    batch.step(torch.tensor([tokens[3], tokens[1], tokens[0]]))
    assert torch.allclose(batch.logits[0], long_alone[4], atol=1e-4)
    assert torch.allclose(batch.logits[1], short_alone[2], atol=1e-4)
    assert torch.allclose(batch.logits[2], other_alone[1], atol=1e-4)
    # The two longest rows finish: the short one is left, and the columns only they used go.
    width = batch._mask.shape[1]
    batch.keep([1])
    assert batch.rows == 1 and batch._mask.shape[1] == len(short_prompt) + 2 < width
    assert torch.allclose(batch.step(torch.tensor([tokens[2]]))[0], short_alone[3], atol=1e-4)
    # Different logits for different rows: the comparisons above could fail.
    assert not torch.allclose(long_alone[4], short_alone[3], atol=1e-2)


def test_a_request_that_arrives_mid_generation_starts_at_the_next_step(tiny_llama):
    """Request B comes while A is decoding 200 tokens: B's tokens start before A ends (static batching made
    it wait for all of A), and B's greedy tokens and logprobs are those it gets when decoded alone."""
    from serving.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(tiny_llama, max_batch=4, batch_window_ms=0)
    engine.eos_ids = set()  # a random model could end A early; this test needs it long
    tokenizer = engine.tokenizer
    a = GenerationRequest(tokenizer.encode("def mean(values):\n", add_special_tokens=False), 200, 1.0, 1.0, seed=1)
    b = GenerationRequest(tokenizer.encode("import os\nimport sys\n", add_special_tokens=False), 12, 0.0, 1.0)

    async def run():
        events: list[tuple[str, float]] = []
        b_steps = []

        async def consume_a():
            n = 0
            async for _ in engine.stream(a):
                n += 1
                events.append(("a", time.monotonic()))
                if n == 5:
                    b_task.set_result(None)
            return n

        async def consume_b():
            await b_task
            async for step in engine.stream(b):
                b_steps.append(step)
                events.append(("b", time.monotonic()))

        b_task = asyncio.get_running_loop().create_future()
        a_count, _ = await asyncio.gather(consume_a(), consume_b())
        alone = [s async for s in engine.stream(b)]
        await engine.close()
        return events, a_count, b_steps, alone

    events, a_count, b_steps, alone = asyncio.run(run())
    assert a_count == 200 and len(b_steps) == 12
    order = [who for who, _ in events]
    last_a = len(order) - 1 - order[::-1].index("a")
    assert order.index("b") < last_a, "B waited for A to finish"
    assert order.count("b") == 12 and order[last_a - 5:last_a + 1].count("b") == 0  # B done long before A
    assert [s.token_id for s in b_steps] == [s.token_id for s in alone]
    assert [s.logprob for s in b_steps] == [s.logprob for s in alone]


def test_requests_past_max_batch_wait_for_a_row(tiny_llama):
    from serving.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(tiny_llama, max_batch=2, batch_window_ms=0)
    engine.eos_ids = set()
    prompt = engine.tokenizer.encode("x = 1\n", add_special_tokens=False)
    lengths = [30, 30, 5]

    async def run():
        finished: list[int] = []
        started: dict[int, int] = {}

        async def one(i: int):
            n = 0
            async for _ in engine.stream(GenerationRequest(prompt, lengths[i], 1.0, 1.0, seed=i)):
                n += 1
                started.setdefault(i, len(finished))
            finished.append(i)
            return n

        counts = await asyncio.gather(*(one(i) for i in range(3)))
        await engine.close()
        return counts, finished, started

    counts, finished, started = asyncio.run(run())
    assert counts == lengths
    # Two rows: the third request (5 tokens) starts only once one of the 30-token ones has finished.
    assert started[2] >= 1 and finished.index(2) == 2
