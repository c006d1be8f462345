"""Realistic example events, for benchmarks, tests and demos.

Sizes follow what the front door really emits: a ~2 KB FIM prompt and its
token ids (about one per 3.5 characters of code, packed as the front door packs
them), 64 completion tokens with their logprobs and text ends.
"""

from __future__ import annotations

import hashlib
import random
import uuid

from schemas.events import Event, new_event
from schemas.token_ids import pack_ids

_CODE = (
    "def moving_average(values, window):\n"
    "    if window <= 0:\n        raise ValueError('window must be positive')\n"
    "    total = 0.0\n    out = []\n    for i, v in enumerate(values):\n        total += v\n"
)


def fim_prompt(rng: random.Random, size: int = 2048) -> str:
    body = (_CODE * (size // len(_CODE) + 1))[: size - 60]
    cut = rng.randrange(len(body) // 2, len(body))
    return f"<|fim_prefix|>{body[:cut]}<|fim_suffix|>{body[cut:]}<|fim_middle|>"


def _prompt_ids(rng: random.Random, prompt: str) -> list[int]:
    return [rng.randrange(151_000) for _ in range(len(prompt) * 2 // 7)]


def example_event(type_name: str, i: int = 0, rng: random.Random | None = None, *,
                  prompt_size: int = 2048, tokens: int = 64, projects: int = 3) -> Event:
    rng = rng or random.Random(i)
    project, user = f"project-{i % projects}", f"user-{i % 7}"
    completion_id = f"cmpl-{uuid.UUID(int=rng.getrandbits(128))}"
    if type_name == "CompletionServed":
        prompt = fim_prompt(rng, prompt_size)
        return new_event(
            "CompletionServed", completion_id=completion_id, project_id=project, user_id=user,
            model="Qwen/Qwen2.5-Coder-1.5B", policy_version=i % 5, prompt=prompt,
            prompt_token_ids_packed=pack_ids(_prompt_ids(rng, prompt)),
            prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(), prefix=prompt[14:200], suffix=None,
            filepath=f"src/module_{i % 11}.py", completion_text="    return total / window\n",
            completion_token_ids=[rng.randrange(151_000) for _ in range(tokens)],
            completion_logprobs=[-rng.random() * 3 for _ in range(tokens)],
            completion_token_ends=[min(k, 26) for k in range(1, tokens + 1)],
            finish_reason="stop", aborted=False, temperature=0.2, top_p=0.95, max_tokens=tokens,
            requested_temperature=0.2,
            ttft_ms=12.5, latency_ms=180.0, replica_id="replica-0",
        )
    if type_name == "FeedbackReceived":
        accepted = rng.random() < 0.3
        return new_event(
            "FeedbackReceived", project_id=project, user_id=user, source="continue-fork",
            completion_id=None, client_completion_id=str(uuid.UUID(int=rng.getrandbits(128))),
            prompt="<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>", prompt_sha256=f"{i:064x}",
            completion="1", outcome="ACCEPTED" if accepted else "REJECTED", accepted_chars=None,
            time_to_decision_ms=rng.randrange(100, 10_000), cache_hit=False, filepath="a.py",
            model_name="qwen2.5-coder", raw_payload='{"accepted": %s}' % str(accepted).lower(),
        )
    if type_name == "Episode":
        prompt = fim_prompt(rng, prompt_size)
        return new_event(
            "Episode", completion_id=completion_id, project_id=project, user_id=user, policy_version=i % 5,
            prompt=prompt, prompt_token_ids_packed=pack_ids(_prompt_ids(rng, prompt)),
            prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(), completion_text="    return total / window\n",
            completion_token_ids=[rng.randrange(151_000) for _ in range(tokens)],
            behaviour_logprobs=[-rng.random() * 3 for _ in range(tokens)], temperature=0.2, top_p=0.95,
            outcome="ACCEPTED",
            reward=0.75, reward_components={"acceptance": 0.75}, scorer="acceptance", matched=True,
        )
    if type_name == "WeightVersion":
        return new_event(
            "WeightVersion", version=i + 1, parent_version=i, base_model="Qwen/Qwen2.5-Coder-1.5B", kind="LORA",
            uri=f"file:///weights/v{i + 1}", sha256="0" * 64, size_bytes=1 << 20, trainer_step=i * 10,
            episodes_consumed=i * 160, source_offsets={"0": i * 27, "1": i * 26}, metrics={"reward_mean": 0.1},
            status="PROMOTED",
        )
    if type_name == "GateVersion":
        return new_event(
            "GateVersion", project_id="" if i % 2 else project, version=i + 1, parent_version=i or None,
            policy_version=i % 5, feature_names=["log_tokens", "log_chars", "first_logprob", "mean_logprob",
                                                 "min_logprob", "sum_logprob", "end_logprob"],
            coef=[rng.uniform(-1, 1) for _ in range(7)], intercept=-1.1, feature_mean=[0.0] * 7,
            feature_scale=[1.0] * 7, threshold=0.2, exploration=0.1, episodes_used=50 + i,
            metrics={"auc": 0.8}, status="PROMOTED", reason="example",
        )
    if type_name == "DeadLetter":
        return new_event("DeadLetter", source_topic="tabloop.feedback", source_partition=i % 6, source_offset=i,
                         raw=bytes(rng.getrandbits(8) for _ in range(32)), error="CorruptEventError: example")
    raise ValueError(f"unknown event type {type_name!r}")
