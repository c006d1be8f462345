"""The sampler's distribution: what the engine draws each token from, and so what a served token's
behaviour log-probability means. The front door samples from it; the trainer recomputes it for the ratio."""

from __future__ import annotations

import torch

# The sampler's own distribution. The behaviour log-probability of a served token must be taken from the
# distribution the engine actually drew it from — softmax(z / T) cut to the top-p nucleus and renormalised —
# and the trainer must recompute the current policy's log-probability from the same transform, or PPO's
# ratio compares two different distributions (at T = 0.5 even a constant advantage then moves the policy).
GREEDY_TEMPERATURE = 1e-4
"""At or below this temperature the engine takes the argmax: a point mass, not a distribution to weigh."""


def sampling_log_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log π_T,p over the last dimension: the tempered softmax restricted to the top-p nucleus, renormalised.

    The nucleus is the smallest set of most likely tokens whose tempered mass reaches ``top_p`` (always at
    least one token); tokens outside it get −inf. Greedy (``temperature`` ≤ GREEDY_TEMPERATURE) is the point
    mass on the argmax. Differentiable inside the nucleus; the nucleus itself is chosen without gradient.
    """
    if temperature <= GREEDY_TEMPERATURE:
        top = logits.argmax(dim=-1, keepdim=True)
        return torch.full_like(logits, float("-inf"), dtype=torch.float32).scatter(-1, top, 0.0)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    with torch.no_grad():
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
        sorted_p = sorted_logp.exp()
        outside_sorted = torch.cumsum(sorted_p, dim=-1) - sorted_p > top_p
        outside = torch.zeros_like(outside_sorted).scatter(-1, order, outside_sorted)
    kept = logp.masked_fill(outside, float("-inf"))
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)
