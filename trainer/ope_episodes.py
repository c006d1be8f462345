"""`tabloop weights evaluate`: a version's estimated figures on logged episodes, before any user sees it.

Each episode is scored twice: its behaviour log-probability (recorded when it was served) and the
evaluated version's log-probability of the same tokens under the same sampler (its temperature and top-p:
the version would be served the same way). ``trainer.ope`` turns the pairs into estimates.

Greedy episodes (by default most of the traffic: ``policy.exploration``) are point masses and are left out:
the estimates are of the version *sampled* as the exploration samples were, on those episodes, beside their
own logged figures, not of the version's greedy completions, which the log can weigh only where they
happen to equal a logged one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Callable, Iterable, Sequence

import torch

from policy.sampling import GREEDY_TEMPERATURE, sampling_log_probs
from trainer.losses import policy_token_logprobs
from trainer.episodes import episode_sample, episode_sampler
from trainer.metrics import is_empty, user_figures
from trainer.ope import LoggedOutcome, estimate
from trainer.learner import Sample, completion_logits


@dataclass
class LoggedEpisodes:
    """The episodes OPE can weigh, and how many were left out and why."""
    samples: list[Sample] = field(default_factory=list)
    """Each as the trainer would train it (``trainer.episodes.episode_sample``), behaviour logprobs included."""
    shown: list[bool] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str, count: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count


def select_episodes(episodes: Iterable[dict], tokenizer, *, project: str | None = None,
                    since: datetime | None = None, limit: int | None = None,
                    max_prompt_tokens: int = 2048) -> LoggedEpisodes:
    """The episodes of ``project`` joined at or after ``since`` (the newest ``limit`` of them) that carry what
    a weight needs: the served tokens, their behaviour log-probabilities and a sampler that was not greedy —
    read by the trainer's own rules (``episode_sampler``, ``episode_sample``)."""
    picked: list[dict] = []
    out = LoggedEpisodes()
    for ep in episodes:
        if project is not None and ep["project_id"] != project:
            continue
        if since is not None and ep["joined_at"] < since:
            continue
        if not ep["completion_token_ids"] or len(ep["behaviour_logprobs"]) != len(ep["completion_token_ids"]):
            out.skip("no behaviour logprobs")  # feedback on a completion we never served, or an old episode
            continue
        if episode_sampler(ep)[0] <= GREEDY_TEMPERATURE:
            # A point mass: no ratio to weigh it by. What is weighed is the exploration samples (``explored``,
            # the coin's share of the traffic, a hash of the completion id independent of the content) and
            # requests at the client's own temperature: given the coin, each one's recorded probability is
            # exactly its behaviour probability, so the estimate is of the version served as they were
            # (at their temperature and top-p), compared with the logged figures of those same episodes.
            out.skip("greedy")
            continue
        if ep.get("chosen_candidate"):  # picked among candidates after they were drawn: no recorded probability
            out.skip("chosen")
            continue
        picked.append(ep)
    if limit is not None and len(picked) > limit:
        out.skip("older than the newest --limit", len(picked) - limit)
        picked = picked[-limit:]
    for ep in picked:
        out.samples.append(episode_sample(ep, tokenizer, max_prompt_tokens=max_prompt_tokens))
        out.shown.append(not is_empty(ep["completion_text"]))
        out.accepted.append(ep["outcome"] == "ACCEPTED")
        out.rewards.append(float(ep["reward"]))
    return out


def end_token_ids(tokenizer, logged: LoggedEpisodes) -> set[int]:
    """Tokens that end a completion at once: the tokenizer's end of text, and whatever first token ended a
    logged completion that showed nothing (serving's other stop tokens, e.g. a chat model's end of turn)."""
    ends = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for sample, shown in zip(logged.samples, logged.shown):
        if not shown and len(sample.completion_ids) == 1:
            ends.add(sample.completion_ids[0])
    return ends


@torch.no_grad()
def version_logprobs(model, logged: LoggedEpisodes, *, pad_id: int, end_ids: set[int], batch_size: int = 8,
                     device: str = "cpu", progress: Callable[[int, int], None] | None = None
                     ) -> tuple[list[float], list[float]]:
    """(log π_V(y|x) per episode, π_V(nothing shown | x) per episode) under each episode's own sampler.

    The model is left in the mode it came in (the promotion gate scores the policy the trainer goes on
    training)."""
    was_training = model.training
    model.eval()
    try:
        return _version_logprobs(model, logged, pad_id=pad_id, end_ids=end_ids, batch_size=batch_size,
                                 device=device, progress=progress)
    finally:
        model.train(was_training)


def _version_logprobs(model, logged: LoggedEpisodes, *, pad_id: int, end_ids: set[int], batch_size: int,
                      device: str, progress: Callable[[int, int], None] | None) -> tuple[list[float], list[float]]:
    seq_logprobs: list[float] = []
    abstain: list[float] = []
    ends = torch.tensor(sorted(end_ids), dtype=torch.long)
    for start in range(0, len(logged.samples), batch_size):
        chunk = logged.samples[start:start + batch_size]
        logits, targets, mask = completion_logits(model, chunk, pad_id=pad_id, device=device)
        lp = policy_token_logprobs(logits, targets, [s.temperature for s in chunk], [s.top_p for s in chunk])
        seq_logprobs.extend((lp * mask).sum(-1).tolist())
        width = logits.shape[1]
        for row, s in enumerate(chunk):
            first = logits[row, width - len(s.completion_ids)].unsqueeze(0)
            dist = sampling_log_probs(first, s.temperature, s.top_p).exp()[0]
            abstain.append(float(dist.index_select(0, ends.to(dist.device)).sum()) if len(ends) else 0.0)
        if progress is not None:
            progress(min(start + batch_size, len(logged.samples)), len(logged.samples))
    return seq_logprobs, abstain


def logged_outcomes(logged: LoggedEpisodes, target_logprobs: Sequence[float],
                    abstain_probs: Sequence[float]) -> list[LoggedOutcome]:
    return [LoggedOutcome(sum(sample.behaviour_logprobs), t, shown, accepted, reward, p)
            for sample, t, shown, accepted, reward, p in zip(logged.samples, target_logprobs, logged.shown,
                                                              logged.accepted, logged.rewards, abstain_probs)]


def evaluate_logged(model, tokenizer, logged: LoggedEpisodes, *, clip: float = 10.0, level: float = 0.9,
                    ignored_reward: float = 0.0, batch_size: int = 8, device: str = "cpu",
                    progress: Callable[[int, int], None] | None = None) -> dict:
    """The version's estimates on ``logged`` (``trainer.ope.estimate``), the log's own figures and the skips."""
    if not logged.samples:
        raise ValueError("no logged episode to evaluate on"
                         + (f" ({', '.join(f'{n} {why}' for why, n in logged.skipped.items())})"
                            if logged.skipped else ""))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    target, abstain = version_logprobs(model, logged, pad_id=int(pad or 0), end_ids=end_token_ids(tokenizer, logged),
                                       batch_size=batch_size, device=device, progress=progress)
    not_shown = [r for r, s in zip(logged.rewards, logged.shown) if not s]
    # Nothing shown earns what the log says it earned (the reward spec's ignored value, composite weights
    # and all); with no such episode, the spec's.
    ignored = sum(not_shown) / len(not_shown) if not_shown else ignored_reward
    result = estimate(logged_outcomes(logged, target, abstain), clip=clip, level=level, ignored_reward=ignored)
    # The log's own figures beside the estimates (the behaviour policies' own, the same formulas as bench loop).
    rows = [{"shown": "" if shown else None, "accepted": accepted, "accepted_chars": 0, "reward": reward}
            for shown, accepted, reward in zip(logged.shown, logged.accepted, logged.rewards)]
    logged_own = {k: v for k, v in user_figures(rows).items()
                  if k in ("accept_rate_shown", "shown_share", "reward_mean")}
    return {**result.as_dict(), "clip": clip, "level": level, "logged": logged_own,
            "skipped": dict(logged.skipped)}
