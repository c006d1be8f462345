"""The policy and one update of it: reusable by the online trainer and by offline GRPO/RLOO runs.

``PolicyTrainer`` wraps a causal LM (LoRA adapters by default, every weight
with ``full=True``), its AdamW optimizer, the learning-rate schedule and the
reference policy for the optional KL term. ``update(samples)`` is one policy
update: PPO's clipped loss on the completion tokens of every sample, against
the logprobs recorded when the sample was generated, accumulated over
micro-batches, gradients clipped, one optimizer step.

A ``Sample`` is (prompt token ids, completion token ids, behaviour logprobs or
None, advantage, and the temperature and top-p the completion was sampled
with): the online trainer fills the advantage from a per-project baseline,
offline validation from GRPO or RLOO over k samples of a prompt.

The importance ratio compares like with like: the behaviour logprob is the
log-probability of the served token under the distribution the sampler drew it
from (softmax(z/T) cut to the top-p nucleus, ``policy.sampling.sampling_log_probs``),
and the update recomputes the current policy's log-probability with the same
transform at the sample's temperature and top-p. At version 0 the ratio is
then exactly 1 and a constant advantage has zero expected gradient. Greedy
completions (T ≤ ``GREEDY_TEMPERATURE``) are not samples of any distribution
one could weigh: they are not ``Sample``s at all (the online trainer drops and
counts them). The KL to the reference and the entropy are of the model's own
next-token distribution (T = 1): they regularise the model, not the sampler.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from policy.models import CachedDecoder, lora_target_modules
from policy.sampling import GREEDY_TEMPERATURE, sampling_log_probs
from trainer.losses import (DUAL_CLIP_RATIO, LossTerms, TrainInferenceCorrection, entropy_from_logits, gap_figures,
                            kl_k3, loss_terms, masked_mean, policy_token_logprobs, ppo_clipped_loss, token_logprobs,
                            train_inference_correction)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float] | None
    """One per completion token, from the policy that generated it; None = the current policy (on-policy)."""
    advantage: float
    temperature: float = 1.0
    """The sampler's temperature when the completion was drawn: the ratio is taken under the same one."""
    top_p: float = 1.0
    """The sampler's top-p nucleus when the completion was drawn."""
    same_weights: bool = False
    """Served by the very weights the update starts from (its policy version is the trainer's): its behaviour
    logprobs and the trainer's differ only by the server's numerics (``losses.train_inference_correction``)."""

    def __post_init__(self) -> None:
        if self.temperature <= GREEDY_TEMPERATURE:
            raise ValueError(f"temperature {self.temperature} is greedy: a greedy completion is not a sample of a "
                             f"distribution, so it has no importance ratio to train with")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.prompt_ids:
            raise ValueError("a sample needs at least one prompt token (the first completion token's context)")
        if not self.completion_ids:
            raise ValueError("a sample needs at least one completion token")
        if self.behaviour_logprobs is not None and len(self.behaviour_logprobs) != len(self.completion_ids):
            raise ValueError(f"{len(self.behaviour_logprobs)} behaviour logprobs for "
                             f"{len(self.completion_ids)} completion tokens")


def make_sample(tokenizer, prompt: str, completion_ids: Sequence[int], behaviour_logprobs: Sequence[float] | None,
                advantage: float, *, max_prompt_tokens: int = 2048, prompt_ids: Sequence[int] | None = None,
                temperature: float = 1.0, top_p: float = 1.0) -> Sample:
    """A Sample of the prompt the model was fed.

    ``prompt_ids``, when given (the ids the serving replica fed the model, after its trim), are used as
    they are: decoding and re-encoding them is not the identity (a trim can split a UTF-8 character, BPE
    merges differ across the cut). Only without them — old episodes — is ``prompt`` encoded, keeping the
    end of a long prompt (nearest the completion).
    """
    if prompt_ids:
        ids = list(prompt_ids)
    else:
        ids = tokenizer.encode(prompt, add_special_tokens=False)[-max_prompt_tokens:]
    return Sample(list(ids), list(completion_ids),
                  list(behaviour_logprobs) if behaviour_logprobs is not None else None, float(advantage),
                  float(temperature), float(top_p))


@dataclass(frozen=True)
class UpdateConfig:
    lr: float = 1e-5
    warmup_updates: int = 10
    """Linear warm-up of the learning rate; constant afterwards (an online trainer has no last step)."""
    clip_eps: float = 0.2
    clip_ratio_c: float = DUAL_CLIP_RATIO
    """Dual clip: a token with A < 0 adds at most −c·A to the loss however stale its episode
    (``ppo_clipped_loss``)."""
    tis_cap: float = 2.0
    """Truncated importance weights on rows served by the weights being trained (``same_weights``): the cap on
    π_trainer/μ_server (``losses.train_inference_correction``); 0 = off (the server's logprobs are the ratio's
    denominator on every row)."""
    kl_coef: float = 0.0
    """Weight of KL(current ‖ reference) in the loss; 0 = off (no reference forward pass)."""
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch: int = 8
    """Samples per forward/backward; the gradient of a whole update is accumulated over them."""
    epochs: int = 1
    """Passes over the batch per update (PPO epochs); each pass is one optimizer step."""
    weight_decay: float = 0.0


def describe_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class PolicyTrainer:
    def __init__(self, model, tokenizer, config: UpdateConfig, *, device: str = "cpu", full: bool = False,
                 lora_rank: int = 16, lora_alpha: int | None = None, adapter_dir: str | Path | None = None,
                 seed: int | None = None, reference_model=None):
        """``model`` is a loaded base (or full-weights) model; ``adapter_dir`` resumes a saved LoRA adapter.

        The KL reference is always the base model. With LoRA it is the model under the adapter. Full
        fine-tuning keeps a frozen copy: ``reference_model`` when given — the base, which a trainer resuming
        from saved full weights must load and pass — else a copy of ``model``, which is then the base.
        """
        self.config = config
        self.tokenizer = tokenizer
        self.device = describe_device(device)
        self.full = full
        if seed is not None:
            torch.manual_seed(seed)
        model.to(self.device)
        self.reference = None
        if full:
            self.model = model
            if config.kl_coef > 0:
                import copy

                reference = reference_model if reference_model is not None else copy.deepcopy(model)
                self.reference = reference.to(self.device).eval().requires_grad_(False)
        else:
            from peft import LoraConfig, PeftModel, get_peft_model  # third-party, needed for LoRA only

            if adapter_dir is not None:
                self.model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
            else:
                lora = LoraConfig(r=lora_rank, lora_alpha=lora_alpha or 2 * lora_rank, lora_dropout=0.0,
                                  target_modules=lora_target_modules(model), task_type="CAUSAL_LM")
                self.model = get_peft_model(model, lora)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.trainable_parameters = sum(p.numel() for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        warm = max(1, config.warmup_updates)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / warm))
        self.updates = 0
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad if pad is not None else 0)

    # -- one update ---------------------------------------------------------------

    def _autocast(self):
        if self.device.startswith("cuda"):
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()  # fp32 on the CPU

    def _reference_context(self):
        """The reference policy: the base model under the adapter (LoRA), or a frozen copy (full)."""
        if self.reference is not None:
            return contextlib.nullcontext(self.reference)
        if not self.full:
            @contextlib.contextmanager
            def base():
                with self.model.disable_adapter():
                    yield self.model
            return base()
        raise RuntimeError("no reference policy (kl_coef is 0)")

    def _forward(self, model, batch: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return completion_logits(model, batch, pad_id=self.pad_id, device=self.device)

    def update(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One policy update on ``samples``; returns its metrics (loss, KL, clip fraction, entropy, grad norm…).

        Per epoch: each micro-batch's loss terms (``_loss_terms``), its gradient weighted by its share of the
        completion tokens, then one clipped optimizer step (``_step``). The metrics are the last epoch's terms.
        """
        if not samples:
            raise ValueError("an update needs at least one sample")
        cfg = self.config
        started = time.perf_counter()
        total_tokens = sum(len(s.completion_ids) for s in samples)
        micro = [samples[i:i + cfg.micro_batch] for i in range(0, len(samples), cfg.micro_batch)]
        sums = {"policy_loss": 0.0, "approx_kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "kl_ref": 0.0,
                "ratio_mean": 0.0, "dual_clip_fraction": 0.0}
        grad_norm = 0.0
        frozen_behaviour: dict[int, TrainInferenceCorrection] = {}
        for epoch in range(cfg.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for index, chunk in enumerate(micro):
                share = sum(len(s.completion_ids) for s in chunk) / total_tokens
                terms = self._loss_terms(chunk, frozen_behaviour, index)
                (terms.total * share).backward()
                if epoch == cfg.epochs - 1:
                    for name, value in terms.figures().items():
                        sums[name] += value * share
            grad_norm = self._step()
        self.updates += 1
        seconds = time.perf_counter() - started
        return {**sums, **gap_figures(frozen_behaviour.values()), "grad_norm": grad_norm,
                "lr": self.optimizer.param_groups[0]["lr"],
                "update_seconds": seconds, "tokens": float(total_tokens),
                "tokens_per_s": total_tokens * cfg.epochs / seconds if seconds > 0 else 0.0,
                "samples": float(len(samples)),
                "advantage_mean": sum(s.advantage for s in samples) / len(samples)}

    def _loss_terms(self, chunk: Sequence[Sample], frozen_behaviour: dict[int, TrainInferenceCorrection],
                    index: int) -> LossTerms:
        """Micro-batch ``index``'s loss terms (trainer/losses.py): PPO's clipped surrogate, the entropy and the
        KL to the reference. The ratio's denominators are frozen at the first epoch's pass (``frozen_behaviour``):
        recorded ones where the sample has them, else the current policy's then (on-policy, ratio 1); on rows
        served by these very weights, the trainer's own with truncated importance weights
        (``train_inference_correction``)."""
        cfg = self.config
        with self._autocast():
            logits, targets, mask = self._forward(self.model, chunk)
        # The ratio's log-probabilities: each row under the sampler that drew it (see the module doc).
        logprobs = policy_token_logprobs(logits, targets, [s.temperature for s in chunk], [s.top_p for s in chunk])
        if index not in frozen_behaviour:
            same = torch.tensor([s.same_weights and s.behaviour_logprobs is not None for s in chunk],
                                device=logprobs.device)
            frozen_behaviour[index] = train_inference_correction(
                logprobs.detach(), self._behaviour_tensor(chunk, logprobs.detach(), mask), mask, same,
                cap=cfg.tis_cap)
        frozen = frozen_behaviour[index]
        advantages = torch.tensor([s.advantage for s in chunk], device=logprobs.device)
        surrogate = ppo_clipped_loss(logprobs, frozen.denominators, advantages, mask, clip_eps=cfg.clip_eps,
                                     clip_ratio_c=cfg.clip_ratio_c, token_weights=frozen.weights)
        with contextlib.nullcontext() if cfg.entropy_coef > 0 else torch.no_grad():
            entropy = masked_mean(entropy_from_logits(logits), mask)
        kl_ref = torch.zeros(())
        if cfg.kl_coef > 0:
            with torch.no_grad(), self._reference_context() as ref, self._autocast():
                ref_logits, _, _ = self._forward(ref, chunk)
                ref_logprobs = token_logprobs(ref_logits, targets)
            kl_ref = masked_mean(kl_k3(ref_logprobs, token_logprobs(logits, targets)), mask)
        return loss_terms(surrogate, entropy, kl_ref, entropy_coef=cfg.entropy_coef, kl_coef=cfg.kl_coef)

    def _step(self) -> float:
        """Clip the gradient's norm and take one optimizer step (none when the norm is not finite); the norm."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.scheduler.step()
        return grad_norm

    def _behaviour_tensor(self, chunk: Sequence[Sample], current: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Recorded behaviour logprobs laid out like the targets; the current policy's where none were recorded."""
        out = current.clone()
        width = out.shape[1]
        for row, s in enumerate(chunk):
            if s.behaviour_logprobs is not None:
                c = len(s.behaviour_logprobs)
                out[row, width - c:] = torch.tensor(s.behaviour_logprobs, dtype=out.dtype, device=out.device)
        return out

    # -- evaluation helpers ----------------------------------------------------------

    @torch.no_grad()
    def sequence_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Current per-token logprobs of each sample's completion, under its sampler (what the ratio uses)."""
        self.model.eval()
        try:
            with self._autocast():
                logits, targets, mask = self._forward(self.model, samples)
            lp = policy_token_logprobs(logits, targets, [s.temperature for s in samples], [s.top_p for s in samples])
            return [lp[row, mask.shape[1] - len(s.completion_ids):].tolist() for row, s in enumerate(samples)]
        finally:
            self.model.train()

    # -- saving ----------------------------------------------------------------------

    @property
    def kind(self) -> str:
        return "FULL" if self.full else "LORA"

    def save(self, out_dir: Path) -> Path:
        """Write the weights the way serving loads them: a peft adapter, or a full model with its tokenizer."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out_dir, safe_serialization=True)
        if self.full:
            self.tokenizer.save_pretrained(out_dir)
        return out_dir


def completion_logits(model, batch: Sequence[Sample], *, pad_id: int,
                      device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits predicting each completion token (B, C, V), target ids (B, C), mask (B, C)).

    Rows are left-padded so every completion ends in the last column: the
    logits are then only computed for the last C+1 positions
    (``logits_to_keep``), not for the whole prompt — with a 150k vocabulary
    the full logits would dominate memory. Row r's first completion token is
    predicted at column C − len(completion_r).
    """
    longest_c = max(len(s.completion_ids) for s in batch)
    longest = max(len(s.prompt_ids) + len(s.completion_ids) for s in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), longest), dtype=torch.long)
    targets = torch.full((len(batch), longest_c), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest_c))
    for row, s in enumerate(batch):
        seq = s.prompt_ids + s.completion_ids
        ids[row, longest - len(seq):] = torch.tensor(seq)
        attn[row, longest - len(seq):] = 1
        c = len(s.completion_ids)
        # A completion shorter than the longest sits at the right end of the target window too.
        targets[row, longest_c - c:] = torch.tensor(s.completion_ids)
        mask[row, longest_c - c:] = 1.0
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    ids, attn, positions = ids.to(device), attn.to(device), positions.to(device)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, logits_to_keep=longest_c + 1,
                use_cache=False)
    logits = kept_logits(out.logits, longest_c + 1, longest)
    logits = logits[:, :-1, :]  # position t predicts token t+1: the last one predicts nothing we have
    return logits, targets.to(device), mask.to(device)


def kept_logits(logits: torch.Tensor, keep: int, sequence_length: int) -> torch.Tensor:
    """The last ``keep`` positions of a forward pass asked for ``logits_to_keep=keep``.

    A model that ignores ``logits_to_keep`` returns logits for the whole sequence; reading its first
    columns as if they were the last would silently train on prompt positions. The full length is sliced;
    any other length is an error.
    """
    got = logits.shape[1]
    if got == keep:
        return logits
    if got == sequence_length:
        return logits[:, -keep:, :]
    raise RuntimeError(f"the model returned logits for {got} positions; asked for the last {keep} of "
                       f"{sequence_length}: it neither honours nor ignores logits_to_keep")


def _prefilled(model, prompts: Sequence[Sequence[int]], pad_id: int) -> CachedDecoder:
    """A decoder holding ``prompts``, each distinct prompt run through the model once: a group of K samples
    of one prompt (GRPO, RLOO) repeats it K times, and the prefill is most of a short completion's cost."""
    distinct: dict[tuple[int, ...], int] = {}
    row_of = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    if len(distinct) == len(prompts):
        return CachedDecoder.for_prompts(model, prompts, pad_id=pad_id)
    decoder = CachedDecoder.for_prompts(model, list(distinct), pad_id=pad_id)
    if not decoder.resizable:  # a cache whose rows cannot be copied: prefill every row
        return CachedDecoder.for_prompts(model, prompts, pad_id=pad_id)
    decoder.keep(row_of)  # each distinct prompt's row copied into every row that repeats it
    return decoder


@torch.no_grad()
def sample_completions(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, generator: torch.Generator | None = None, eos_id: int | None = None,
                       pad_id: int = 0) -> list[tuple[list[int], list[float]]]:
    """Sample a completion per prompt: (token ids, their logprobs under the distribution sampled).

    Draws from ``sampling_log_probs`` at ``temperature`` and ``top_p`` and records
    that distribution's logprob of each drawn token: the behaviour logprobs a
    ``Sample`` with the same temperature and top-p is trained against (what
    serving records too). Offline runs and tests generate their own episodes
    with this. Greedy is refused: its completions could not be trained on.
    """
    if temperature <= GREEDY_TEMPERATURE:
        raise ValueError(f"temperature {temperature} is greedy: sample at a temperature above {GREEDY_TEMPERATURE}")
    was_training = model.training
    model.eval()
    try:
        decoder = _prefilled(model, prompts, pad_id)
        out: list[tuple[list[int], list[float]]] = [([], []) for _ in prompts]
        done = [False] * len(prompts)
        for step in range(max_new_tokens):
            logp = sampling_log_probs(decoder.logits, temperature, top_p)
            nxt = torch.multinomial(logp.exp().cpu(), 1, generator=generator).squeeze(-1)
            for row in range(len(prompts)):
                if done[row]:
                    continue
                token = int(nxt[row])
                out[row][0].append(token)
                out[row][1].append(float(logp[row, token]))
                if eos_id is not None and token == eos_id:
                    done[row] = True
            if all(done) or step == max_new_tokens - 1:
                break
            decoder.step(nxt.to(decoder.logits.device))
        return out
    finally:
        model.train(was_training)
