"""The serving engine and the trainer agree: at the serving version every token's ratio is 1.

The behaviour logprob the transformers engine records for each token it draws, and the log-probability
the trainer recomputes for the same token (the prompt ids the engine was fed, the request's temperature
and top-p), must be the same number — or PPO's ratio compares two different distributions and even a
constant advantage moves the policy. This runs both real parts on the tiny model: the engine's KV-cached,
batched decoding and the trainer's left-padded forward with ``logits_to_keep``.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from serving.engines.base import GenerationRequest
from serving.engines.transformers_engine import TransformersEngine
from policy.models import load_model
from trainer.learner import PolicyTrainer, Sample, UpdateConfig


async def _serve(engine, requests):
    async def one(request):
        return [step async for step in engine.stream(request)]
    return await asyncio.gather(*(one(r) for r in requests))


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.3, 0.95)])
def test_the_served_tokens_have_ratio_one_under_the_trainer(tiny_model, temperature, top_p):
    model, tok = load_model(tiny_model)
    texts = ["def area(r):\n    return", "# café — naïve\nname = '", "import os\nimport sys\n\nclass A:\n    def"]
    # The ids the engine is fed, as they are (the second ends mid-character: a trim can cut there).
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    prompts[1] = prompts[1][:-1]
    engine = TransformersEngine(tiny_model)
    try:
        served = asyncio.run(_serve(engine, [GenerationRequest(p, 6, temperature, top_p, seed=i)
                                             for i, p in enumerate(prompts)]))
    finally:
        asyncio.run(engine.close())
    trainer = PolicyTrainer(model, tok, UpdateConfig(), full=True)
    samples = [Sample(p, [s.token_id for s in steps], [s.logprob for s in steps], 0.0, temperature, top_p)
               for p, steps in zip(prompts, served)]
    for sample, current in zip(samples, trainer.sequence_logprobs(samples)):
        ratios = [math.exp(c - b) for c, b in zip(current, sample.behaviour_logprobs)]
        assert ratios == pytest.approx([1.0] * len(ratios), abs=1e-4), (sample.completion_ids, ratios)


@pytest.mark.parametrize("lora,group", [(False, 1), (True, 1), (False, 3)])
def test_the_offline_sampler_records_what_the_trainer_recomputes(tiny_model, lora, group):
    """``sample_completions`` (KV-cached, prompts of different lengths left-padded) records ratio-1 logprobs.

    Offline runs train on what it records; a cache fed the wrong positions or mask would draw from a
    different distribution than the trainer recomputes. With ``lora`` the model is peft-wrapped (what
    ``--lora`` samples from), whose forward names its cache argument differently. With ``group`` > 1 each
    prompt comes that many times, as a GRPO/RLOO group asks: it is run through the model once and its cache
    copied to every repeat, and each copy must still decode as that prompt alone would.
    """
    import torch

    from trainer.learner import sample_completions

    model, tok = load_model(tiny_model)
    trainer = PolicyTrainer(model, tok, UpdateConfig(), full=not lora, seed=0)
    prompts = [tok.encode(t, add_special_tokens=False) for t in
               ["x =", "def area(r):\n    return 3.14 *", "import os\nimport sys\n\nclass A:\n    def __init__(self"]
               for _ in range(group)]
    drawn = sample_completions(trainer.model, prompts, max_new_tokens=8, temperature=0.7, top_p=0.9,
                               generator=torch.Generator().manual_seed(1), eos_id=tok.eos_token_id,
                               pad_id=trainer.pad_id)
    assert all(len(ids) == len(lps) >= 1 for ids, lps in drawn)
    if group > 1:  # the repeats are drawn independently, not copies of one draw
        assert len({tuple(ids) for ids, _ in drawn}) > len(drawn) // group
    samples = [Sample(p, ids, lps, 0.0, 0.7, 0.9) for p, (ids, lps) in zip(prompts, drawn)]
    for sample, current in zip(samples, trainer.sequence_logprobs(samples)):
        ratios = [math.exp(c - b) for c, b in zip(current, sample.behaviour_logprobs)]
        assert ratios == pytest.approx([1.0] * len(ratios), abs=1e-4), (sample.completion_ids, ratios)
