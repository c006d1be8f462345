"""The training math, as pure functions: advantages, the PPO objective, KL and entropy.

Everything here is a function of tensors (or lists of floats) in, numbers out:
no model, no I/O, no hidden state. Each is small enough to check by hand, and
``tests/test_losses.py`` does.

Shapes: ``B`` sequences of at most ``T`` completion tokens, right-padded;
``mask`` is 1.0 on real completion tokens and 0.0 on padding (and on prompt
tokens, which never enter the loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

import torch

from policy.sampling import GREEDY_TEMPERATURE, sampling_log_probs


# -- advantages ---------------------------------------------------------------


@dataclass(frozen=True)
class BaselineState:
    """Per-project running mean of the reward: ``means[p]`` after ``counts[p]`` episodes."""

    means: Mapping[str, float]
    counts: Mapping[str, int]

    @classmethod
    def empty(cls) -> "BaselineState":
        return cls({}, {})


def baseline_advantages(rewards: Sequence[float], projects: Sequence[str], state: BaselineState, *,
                        decay: float = 0.99) -> tuple[list[float], BaselineState]:
    """Advantage = reward − the project's running mean reward *before* this batch; then update the mean.

    Why a baseline: with Cursor's rewards (+0.75 accepted, −0.25 rejected) or
    the reference's 0/1, the sign of the raw reward says little; against the
    project's usual reward, an accept is better than usual (pushed up) and a
    reject worse (pushed down), so rejects get a gradient too.

    A project seen for the first time has no mean yet: its baseline is the mean
    of its rewards in this batch. The mean is an exponential moving average
    over episodes (``decay`` per episode), so it follows a policy that improves,
    but for the first ``1/(1-decay)`` episodes it is the plain average (the EMA
    is bias-corrected by its count).
    """
    if len(rewards) != len(projects):
        raise ValueError(f"{len(rewards)} rewards but {len(projects)} projects")
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    means, counts = dict(state.means), dict(state.counts)
    batch_sums: dict[str, list[float]] = {}
    for r, p in zip(rewards, projects):
        batch_sums.setdefault(p, []).append(r)
    baseline = {p: means[p] if p in means else sum(rs) / len(rs) for p, rs in batch_sums.items()}
    advantages = [r - baseline[p] for r, p in zip(rewards, projects)]
    for r, p in zip(rewards, projects):
        n = counts.get(p, 0) + 1
        # Bias-corrected EMA: weight 1/n while n is small (the plain mean), at least 1-decay later.
        weight = max(1.0 / n, 1.0 - decay)
        means[p] = means.get(p, r) + weight * (r - means.get(p, r))
        counts[p] = n
    return advantages, BaselineState(means, counts)


def _group_indices(rewards: Sequence[float], groups: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """Positions of each group's samples, in order of first appearance."""
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards but {len(groups)} group ids")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return members


def grpo_advantages(rewards: Sequence[float], groups: Sequence[Hashable], *, eps: float = 1e-6,
                    scale_by_std: bool = True) -> list[float]:
    """GRPO: each sample's reward minus its group's mean, divided by the group's standard deviation.

    A group is the k samples drawn for one prompt. The standard deviation is the
    population one (divide by k), as in the DeepSeekMath paper; a group whose
    rewards are all equal gets advantage 0 everywhere (no signal, no division
    blow-up thanks to ``eps``). A group of one sample has advantage 0.
    """
    members = _group_indices(rewards, groups)
    out = [0.0] * len(rewards)
    for idx in members.values():
        rs = [rewards[i] for i in idx]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs))
        for i in idx:
            centred = rewards[i] - mean
            out[i] = centred / (std + eps) if scale_by_std else centred
    return out


def rloo_advantages(rewards: Sequence[float], groups: Sequence[Hashable]) -> list[float]:
    """RLOO (REINFORCE leave-one-out): each reward minus the mean of the *other* samples of its group.

    Equals k/(k−1) · (r_i − group mean). Unbiased, because a sample's baseline
    does not depend on the sample itself. Needs k ≥ 2: a group of one has no
    others to compare with and is an error rather than a silent zero.
    """
    members = _group_indices(rewards, groups)
    out = [0.0] * len(rewards)
    for g, idx in members.items():
        if len(idx) < 2:
            raise ValueError(f"RLOO needs at least 2 samples per group; group {g!r} has 1")
        total = sum(rewards[i] for i in idx)
        for i in idx:
            out[i] = rewards[i] - (total - rewards[i]) / (len(idx) - 1)
    return out


# -- per-token quantities -----------------------------------------------------


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log π(target) at each position: ``logits`` (B, T, V) and ``targets`` (B, T) → (B, T)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


# The floor of a sampled token's log-probability under the current policy. A token outside the current
# top-p nucleus has π = 0 exactly (log −inf): its ratio is then 0, but −inf poisons the arithmetic around it
# (0 · inf = NaN in a masked mean, e^{+inf} in the k3 estimate). Clamped here, its ratio is e^{−50 − log μ}
# (about 1e-22 or less: "this policy would no longer draw it") and finite, and the clamp passes no gradient —
# right, since which tokens are in the nucleus is not differentiable. −50 is far below any token a sampler
# draws (a logprob of −50 is a chance of 2e-22) and far above float32's underflow (about −87).
LOGPROB_FLOOR = -50.0


def policy_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperatures: Sequence[float],
                          top_ps: Sequence[float]) -> torch.Tensor:
    """log π_T,p(target) per position, each row under its own sampler: (B, T, V), (B, T), B temps/top-ps → (B, T).

    The log-probability the importance ratio needs: that of the distribution the served token was drawn
    from (``sampling_log_probs`` at the row's temperature and top-p), floored at ``LOGPROB_FLOOR``. A greedy
    row is an error: a point mass has no ratio to weigh (callers drop greedy episodes before they get here).
    """
    if not (len(temperatures) == len(top_ps) == logits.shape[0] == targets.shape[0]):
        raise ValueError(f"{logits.shape[0]} rows of logits, {targets.shape[0]} of targets, "
                         f"{len(temperatures)} temperatures and {len(top_ps)} top-ps")
    rows: list[torch.Tensor | None] = [None] * len(temperatures)
    # Rows drawn with the same sampler share one pass over the vocabulary.
    by_sampler: dict[tuple[float, float], list[int]] = {}
    for row, key in enumerate(zip(temperatures, top_ps)):
        by_sampler.setdefault((float(key[0]), float(key[1])), []).append(row)
    for (temperature, top_p), idx in by_sampler.items():
        if temperature <= GREEDY_TEMPERATURE:
            raise ValueError(f"temperature {temperature} is greedy: a point mass carries no importance weight; "
                             f"greedy episodes are dropped before training")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        sel = torch.tensor(idx, device=logits.device)
        logp = sampling_log_probs(logits.index_select(0, sel), temperature, top_p)
        picked = logp.gather(-1, targets.index_select(0, sel).unsqueeze(-1)).squeeze(-1).clamp(min=LOGPROB_FLOOR)
        for j, row in enumerate(idx):
            rows[row] = picked[j]
    return torch.stack(rows)  # type: ignore[arg-type]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is 1 (0 when the mask is empty)."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def completion_mask(prompt_lengths: Sequence[int], completion_lengths: Sequence[int],
                    total_length: int) -> torch.Tensor:
    """(B, total_length) mask of completion tokens in rows laid out as [prompt | completion | padding].

    The loss is taken on completion tokens only: the prompt is the user's code,
    not the policy's action.
    """
    mask = torch.zeros((len(prompt_lengths), total_length))
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        if p + c > total_length:
            raise ValueError(f"row {row}: prompt {p} + completion {c} tokens exceed the length {total_length}")
        mask[row, p:p + c] = 1.0
    return mask


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor
    """The PPO clipped surrogate, to minimise (negated objective)."""
    clip_fraction: float
    """Share of completion tokens whose ratio left [1−ε, 1+ε] in the direction the clip cuts."""
    approx_kl: float
    """KL(behaviour ‖ current) estimated from the same tokens (k3 estimator)."""
    ratio_mean: float
    dual_clip_fraction: float = 0.0
    """Share of completion tokens with A < 0 whose loss the dual clip capped at −c·A (stale episodes)."""


DUAL_CLIP_RATIO = 3.0
"""Default ``clip_ratio_c``: verl's default, and TRL's cap on the vLLM importance weight."""


def ppo_clipped_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, *, clip_eps: float = 0.2, clip_ratio_c: float = DUAL_CLIP_RATIO,
                     token_weights: torch.Tensor | None = None) -> PolicyLoss:
    """PPO's clipped surrogate against the behaviour policy that generated the tokens, with dual clip.

    ratio_t = exp(log π(a_t) − log μ(a_t)), with μ the logprobs the serving
    replica recorded when it sampled the completion (an off-policy correction:
    the episode may come from an older version than the one being trained).
    Per token: −min(ratio·A, clip(ratio, 1−ε, 1+ε)·A), with the sequence's
    advantage A on each of its tokens; averaged over completion tokens.

    Dual clip (Ye et al. 2020, verl's ``clip_ratio_c``): for A < 0 PPO's min
    keeps the *unclipped* term when the ratio is large, so one stale episode
    whose token the current policy now likes 20× more adds a loss of 20·|A|
    and a gradient to match. The per-token loss for A < 0 is capped at
    −c·A (c > 1): past ratio c it is constant, with no gradient.
    ``clip_ratio_c=math.inf`` turns the cap off.

    ``token_weights`` (B, T), constants: each token's loss multiplied by its weight (the truncated importance
    weight of ``train_inference_correction``, when ``behaviour_logprobs`` are the trainer's own).

    ``logprobs``/``behaviour_logprobs``/``mask``: (B, T); ``advantages``: (B,).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be greater than 1, got {clip_ratio_c}")
    log_ratio = logprobs - behaviour_logprobs
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None].to(ratio.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    ppo = -torch.minimum(unclipped, clipped)
    negative = adv < 0
    capped = torch.minimum(ppo, -clip_ratio_c * adv)
    per_token = torch.where(negative, capped, ppo)
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    loss = masked_mean(per_token, mask)
    with torch.no_grad():
        was_clipped = (clipped < unclipped).float()  # min() picked the clipped term: no gradient there
        clip_fraction = float(masked_mean(was_clipped, mask))
        dual_clip_fraction = float(masked_mean((negative & (ppo > -clip_ratio_c * adv)).float(), mask))
        # k3 with p = current, q = behaviour: the tokens were drawn from the behaviour policy, so this
        # estimates KL(behaviour ‖ current).
        approx_kl = float(masked_mean(kl_k3(logprobs, behaviour_logprobs), mask))
        ratio_mean = float(masked_mean(ratio, mask))
    return PolicyLoss(loss, clip_fraction, approx_kl, ratio_mean, dual_clip_fraction)


@dataclass(frozen=True)
class TrainInferenceCorrection:
    """What ``train_inference_correction`` gives the surrogate: its denominators and token weights."""

    denominators: torch.Tensor
    """(B, T): the trainer's own logprobs where a row was served by the weights being trained (its ratio starts
    at 1), the server's elsewhere."""
    weights: torch.Tensor
    """(B, T): min(π_trainer / μ_server, cap) on those rows' tokens, 1 elsewhere."""
    gap_mean: float
    """Mean |log π_trainer − log μ_server| over those rows' tokens (0 with none): the train–inference gap."""
    gap_max: float
    tokens: int
    """How many tokens the gap is measured on."""


def train_inference_correction(trainer_logprobs: torch.Tensor, server_logprobs: torch.Tensor, mask: torch.Tensor,
                               same_weights: torch.Tensor, *, cap: float) -> TrainInferenceCorrection:
    r"""The train–inference mismatch, measured and corrected (truncated importance sampling).

    A row ``same_weights`` was served by the very weights the update starts from: its server logprobs μ and
    the trainer's π_old are the same policy computed twice, and differ only by the server's numerics (vLLM casts
    to bf16 by default: up to 0.25 nats a token measured, issue 43). PPO's ratio π_θ/μ then starts off 1 on
    every token and clips on noise. So on those rows the ratio's denominator is π_old (detached: ratio 1 at the
    first step) and each token's loss is weighed by w = min(π_old/μ, ``cap``): the importance weight from
    the distribution the tokens were drawn from (μ) to the one the surrogate assumes (π_old), truncated so
    that a token the server found much less likely than the trainer does cannot dominate (Yao et al. 2025;
    the cap, like verl's and TRL's, is a few). ``cap`` 0: no correction (μ is the denominator, as for rows
    served by older weights, whose π_old the trainer does not hold); the gap is measured either way.

    By hand: π_old = 0.5, μ = 0.4 → w = 1.25; π_old = 0.9, μ = 0.3 → 3, capped at 2.

    >>> import math
    >>> t = torch.tensor([[math.log(0.5), math.log(0.9)]]); s = torch.tensor([[math.log(0.4), math.log(0.3)]])
    >>> c = train_inference_correction(t, s, torch.ones(1, 2), torch.tensor([True]), cap=2.0)
    >>> [round(w, 4) for w in c.weights[0].tolist()], round(c.gap_max, 4), c.tokens
    ([1.25, 2.0], 1.0986, 2)
    """
    rows = same_weights.to(torch.bool)[:, None] & (mask > 0)
    gap = (trainer_logprobs - server_logprobs).abs()
    tokens = int(rows.sum())
    gap_mean = float(gap[rows].mean()) if tokens else 0.0
    gap_max = float(gap[rows].max()) if tokens else 0.0
    if cap <= 0:
        return TrainInferenceCorrection(server_logprobs, torch.ones_like(server_logprobs), gap_mean, gap_max, tokens)
    denominators = torch.where(rows, trainer_logprobs, server_logprobs)
    weights = torch.where(rows, torch.exp(trainer_logprobs - server_logprobs).clamp(max=cap),
                          torch.ones_like(server_logprobs))
    return TrainInferenceCorrection(denominators, weights, gap_mean, gap_max, tokens)


def gap_figures(corrections) -> dict[str, float]:
    """An update's train–inference figures from its micro-batches' corrections: the mean and largest
    |log π_trainer − log μ_server| over the tokens of rows served by the weights being trained, how many
    tokens that is (0: none such this update, the figures 0)."""
    corrections = list(corrections)
    tokens = sum(c.tokens for c in corrections)
    return {"logprob_gap_mean": sum(c.gap_mean * c.tokens for c in corrections) / tokens if tokens else 0.0,
            "logprob_gap_max": max((c.gap_max for c in corrections), default=0.0),
            "logprob_gap_tokens": float(tokens)}


def kl_k3(logprobs_p: torch.Tensor, logprobs_q: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(q ‖ p) from samples of q: exp(log p − log q) − (log p − log q) − 1.

    John Schulman's "k3" estimator: unbiased, and never negative (x − 1 − log x ≥ 0),
    unlike the plain log-ratio. Used for the KL to the reference policy (p =
    reference, q = current) and for the approximate KL of an update.
    """
    log_ratio = logprobs_p - logprobs_q
    return torch.exp(log_ratio) - log_ratio - 1.0


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position: (B, T, V) → (B, T), in nats."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


# -- the loss, term by term -----------------------------------------------------


@dataclass(frozen=True)
class LossTerms:
    """One micro-batch's loss, each term named: ``total`` = ``policy.loss`` − entropy_coef · ``entropy`` +
    kl_coef · ``kl_ref`` (a term enters only with its coefficient above 0)."""

    policy: PolicyLoss
    """PPO's clipped surrogate against the behaviour policy (``ppo_clipped_loss``), with its diagnostics."""
    entropy: torch.Tensor
    """Mean entropy of the model's next-token distribution on completion tokens (``entropy_from_logits``)."""
    kl_ref: torch.Tensor
    """Mean KL to the reference policy (``kl_k3``); 0 when there is no KL term."""
    total: torch.Tensor
    """What the update minimises."""

    def figures(self) -> dict[str, float]:
        """The terms as an update reports them, under its metrics' names."""
        return {"policy_loss": self.policy.loss.item(), "approx_kl": self.policy.approx_kl,
                "clip_fraction": self.policy.clip_fraction, "entropy": self.entropy.item(),
                "kl_ref": self.kl_ref.item(), "ratio_mean": self.policy.ratio_mean,
                "dual_clip_fraction": self.policy.dual_clip_fraction}


def loss_terms(policy: PolicyLoss, entropy: torch.Tensor, kl_ref: torch.Tensor, *, entropy_coef: float,
               kl_coef: float) -> LossTerms:
    """The total loss from its terms: the surrogate, minus the entropy bonus, plus the KL penalty."""
    total = policy.loss
    if entropy_coef > 0:
        total = total - entropy_coef * entropy
    if kl_coef > 0:
        total = total + kl_coef * kl_ref
    return LossTerms(policy, entropy, kl_ref, total)
