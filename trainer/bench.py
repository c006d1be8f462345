"""`tabloop bench trainer`: seconds per policy update and tokens/s, LoRA and full fine-tuning.

Synthetic episodes (random prompt and completion tokens, behaviour logprobs
near the policy's own, ±advantages) through ``PolicyTrainer.update`` — the
same code the online trainer runs — without Kafka. ``--model-shape
qwen2.5-coder-1.5b`` builds that architecture with random weights (nothing is
downloaded), for a GPU; model FLOPs utilisation = 6 · parameters · tokens per
second / the accelerator's peak (the usual convention, counting every token of
every sequence, prompt included).
"""

from __future__ import annotations

import gc
import json
import random
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from policy.models import load_model
from trainer.build_models import build_named_model
from trainer.learner import PolicyTrainer, Sample, UpdateConfig, describe_device

# bf16 dense peak TFLOP/s of accelerators we may meet.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0}

QWEN25_CODER_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                        tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)


def _model(shape: str, settings, device: str, full: bool):
    if shape == "tiny":
        return load_model(build_named_model(settings), device=device, dtype="float32")
    # Random weights in the real shape: what matters for speed is the shape, not the values.
    config = Qwen2Config(**QWEN25_CODER_15B)
    dtype = torch.float32 if full or not device.startswith("cuda") else torch.bfloat16
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)

    class _Tok:  # the update needs only the pad id
        pad_token_id = 151643
        eos_token_id = 151643

        def save_pretrained(self, *_):
            pass

    return model, _Tok()


def _peak(device: str, given: float | None) -> float | None:
    if given is not None:
        return given
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def bench_trainer(settings, *, model_shape: str = "tiny", modes=("lora", "full"), batch: int = 16,
                  micro_batch: int = 8, prompt_tokens: int = 256, completion_tokens: int = 32, updates: int = 5,
                  device: str = "auto", peak_tflops: float | None = None) -> dict:
    device = describe_device(device)
    result: dict = {"bench": "trainer", "model_shape": model_shape, "device": device, "batch": batch,
                    "micro_batch": micro_batch, "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens, "updates": updates}
    if device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(0)
    peak = _peak(device, peak_tflops)
    rng = random.Random(0)
    for mode in modes:
        full = mode == "full"
        model, tok = _model(model_shape, settings, device, full)
        params = sum(p.numel() for p in model.parameters())
        vocab = model.config.vocab_size
        trainer = PolicyTrainer(model, tok, UpdateConfig(lr=1e-5, warmup_updates=0, micro_batch=micro_batch),
                                device=device, full=full, lora_rank=settings.trainer_lora_rank, seed=0)
        samples = [Sample([rng.randrange(16, vocab) for _ in range(prompt_tokens)],
                          [rng.randrange(16, vocab) for _ in range(completion_tokens)],
                          [-rng.uniform(0.5, 8.0) for _ in range(completion_tokens)], rng.choice([-0.5, 0.5]))
                   for _ in range(batch)]
        trainer.update(samples)  # warm-up: allocator, kernels, optimizer state
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(updates):
            trainer.update(samples)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / updates
        all_tokens = batch * (prompt_tokens + completion_tokens)
        stats = {"parameters": params, "trainable_parameters": trainer.trainable_parameters,
                 "seconds_per_update": round(seconds, 4),
                 "update_tokens_per_s": round(batch * completion_tokens / seconds, 1),
                 "sequence_tokens_per_s": round(all_tokens / seconds, 1)}
        if peak:
            stats["mfu"] = round(6 * params * all_tokens / seconds / (peak * 1e12), 4)
            stats["peak_tflops"] = peak
        if device.startswith("cuda"):
            stats["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        result[mode] = stats
        print(f"  {mode:4s}: {seconds:.3f} s/update, {stats['update_tokens_per_s']:,.0f} completion tokens/s, "
              f"{stats['sequence_tokens_per_s']:,.0f} tokens/s" + (f", MFU {stats['mfu']:.1%}" if peak else ""),
              file=sys.stderr)
        del trainer, model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(json.dumps(result, sort_keys=True))
    return result
