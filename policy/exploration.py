"""Exploit by default, explore on a budget: the sampler a completion is served with, as pure functions.

What a user is shown is the policy's best guess, its greedy completion (the argmax at every token). A share
of the requests (``TABLOOP_EXPLORATION_SHARE``, 0.1) is an *exploration sample* instead: drawn at the
exploration temperature (``TABLOOP_DEFAULT_TEMPERATURE``, 0.7) from the sampler's own distribution
(``policy.sampling.sampling_log_probs``). Sampling every request at 0.7 cost users a fifth of the characters
they accepted against a plain server serving the same model greedily (issue 41).

Which requests the rule applies to (``temperature``):

- an operator's override (``TABLOOP_EXPLORATION_TEMPERATURE``) serves every request at it, and no coin is
  flipped;
- a client that asks for a temperature at or above ``TABLOOP_MIN_TEMPERATURE`` (0.1) keeps its own, and no
  coin is flipped: it asked for samples, and its tokens are samples at that temperature;
- a client that sends none (Continue's autocomplete) or a near-greedy one (older Continue's 0.01, an
  explicit 0) is subject to the coin: greedy, or with probability ``share`` sampled at the exploration
  temperature.

The coin (``explores``) is a hash of the completion id and a seed, not a random draw: the same completion is
an exploration sample in every process and on every replay, a seeded run explores exactly the requests a
test can compute, and nothing the client sends (its prompt, its temperature) moves it. It is independent of
the completion's content, so the explored episodes are an unbiased sample of the sampling policy at the
exploration temperature, and their recorded per-token log-probabilities (those of the distribution they
were drawn from) are exact importance-weight denominators given the coin: conditioning on "explored" needs
no correction. Greedy episodes are point masses (log-probability 0 per token), which no importance ratio can
weigh (the trainer and off-policy evaluation leave them out: ``trainer.episodes.drop_reason``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

GREEDY = 0.0
"""The temperature a request the coin leaves alone is served at: the argmax (``policy.sampling``)."""
COIN_SALT = "tabloop-explore"
"""Keeps the coin independent of other hashes of the completion id (the promotion gate's held-out share,
``trainer.promotion.in_gate_holdout``, hashes the bare id: a shared hash would hold out exactly the explored
episodes, or none of them)."""


def explores(completion_id: str, share: float, seed: int = 0) -> bool:
    """The exploration coin: whether the request ``completion_id`` is an exploration sample, with probability
    ``share`` over completion ids. Deterministic in (completion id, seed); 0 never explores, 1 always does.

    >>> explores("cmpl-a", 0.0), explores("cmpl-a", 1.0)
    (False, True)
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the exploration share must be in [0, 1], got {share}")
    if share == 0.0:
        return False
    if share == 1.0:
        return True
    digest = hashlib.sha256(f"{COIN_SALT}/{seed}/{completion_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < share


def subject_to_coin(requested: float | None, *, min_temperature: float, override: float | None = None) -> bool:
    """Whether a request is served by the coin: no override, and the client sent no temperature or one
    below ``min_temperature`` (a client asking for a real temperature keeps it)."""
    return override is None and (requested is None or requested < min_temperature)


@dataclass(frozen=True)
class Sampling:
    """How one request is served, as ``CompletionServed`` records it."""

    temperature: float
    """What the tokens are drawn at (≤ ``policy.sampling.GREEDY_TEMPERATURE``: the argmax)."""
    explored: bool
    """The coin said explore: sampled at the exploration temperature instead of greedy."""
    exploration_share: float | None
    """The probability the coin had of saying explore; None when no coin was flipped (the client's own
    temperature, or the operator's override)."""


def served_temperature(requested: float | None, explored: bool, *, exploration_temperature: float,
                       min_temperature: float, override: float | None = None) -> float:
    """The temperature a request is served at, given the coin's answer (ignored where it does not apply)."""
    if override is not None:
        return override
    if not subject_to_coin(requested, min_temperature=min_temperature):
        return float(requested)
    return exploration_temperature if explored else GREEDY


def choose_sampling(requested: float | None, completion_id: str, *, share: float, seed: int,
                    exploration_temperature: float, min_temperature: float,
                    override: float | None = None) -> Sampling:
    """The rule in full: the coin where it applies (``explores``), and the temperature it gives."""
    flipped = subject_to_coin(requested, min_temperature=min_temperature, override=override)
    explored = flipped and explores(completion_id, share, seed)
    return Sampling(served_temperature(requested, explored, exploration_temperature=exploration_temperature,
                                       min_temperature=min_temperature, override=override),
                    explored, share if flipped else None)
