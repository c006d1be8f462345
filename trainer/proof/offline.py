"""Offline GRPO / RLOO: ``tabloop train --offline --algo grpo|rloo --group-size K --scorer exact|tests|judge DATASET``.

One update, in order:

1. the next ``prompts_per_update`` tasks of the dataset (a seeded shuffle, pass after pass);
2. ``K`` completions of each task's FIM prompt sampled from the current policy
   at the configured temperature and top-p, with the logprob of every sampled
   token under that sampler's distribution (the behaviour logprobs); the update
   recomputes the current policy's logprobs under the same sampler, so the
   ratio is exactly 1 before the step. A
   completion ends where the editor would end it — a stop string, a newline in
   single-line mode, the end-of-text token — and only those tokens are trained
   on: the reward says nothing about tokens nobody saw;
3. the text the editor would show scored by the scorer: exact match with a
   solution (1/0), the task's tests in the sandbox (1/0), the LLM judge's
   score / 10 (a sample the judge could not score is left out), or a simulated
   user's decision as the online trainer would see it (``user``: +0.75 accepted,
   −0.25 rejected, 0 for an empty suggestion, which nobody is shown);
4. advantages within each task's group — GRPO (reward − group mean) / group
   std, or RLOO (reward − mean of the others) — from ``trainer.losses``;
   a group whose rewards are all equal carries no signal and is left out;
5. one policy update with ``PolicyTrainer.update``, the step the online
   trainer takes (PPO's clipped loss against the behaviour logprobs).

Every ``save_every`` updates, and after the last, the policy is a new version
in the weight store. Its manifest's ``training`` names the algorithm, group
size, scorer and dataset, its ``metrics`` hold the mean rewards (and the
held-out evaluation before/after, on the last version). The manifest carries
the parent's episode-topic offsets and reward baseline unchanged, so the online
trainer resumes from an offline version exactly where it stopped. With a
reachable broker the version is announced on ``tabloop.weights`` (CANDIDATE,
or PROMOTED when asked).
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from infra.bus import EventProducer, broker_answers, ensure_topics
from policy.fim import earliest_stop, prompt_token_ids
from policy.sampling import GREEDY_TEMPERATURE
from policy.shown import single_line_mode
from policy.weight_store import WeightStore, version_event
from rewards.spec import RewardSpec
from schemas.topics import EPISODES
from trainer.build_models import build_named_model
from trainer.learner import PolicyTrainer, Sample, sample_completions
from trainer.losses import grpo_advantages, rloo_advantages
from trainer.metrics import Scored
from trainer.online import load_policy, update_config
from trainer.proof.evaluate import cut_completion, evaluate, score_judge, score_tests, scorer_reward_spec
from trainer.proof.simulate import CONTINUE_STOPS, UserModel, decision_rows
from trainer.proof.tasks import FimTask, resolve_dataset

ALGOS = ("grpo", "rloo")
SCORERS = ("exact", "tests", "judge", "user")

Scorer = Callable[[Sequence[FimTask], Sequence[str]], list]
"""(tasks, shown completions) → one reward per completion: a float, or None when it could not be scored."""


# -- from sampled groups to training items (pure) ---------------------------------------------


@dataclass(frozen=True)
class GroupSample:
    """One of the K completions of a prompt: its tokens, their behaviour logprobs, what it earned."""

    completion_ids: list[int]
    behaviour_logprobs: list[float]
    reward: float | None
    """None: the scorer had no verdict (a judge error): the sample is left out, not counted as 0."""


@dataclass(frozen=True)
class TrainingBatch:
    samples: list[Sample]
    """(prompt ids, completion ids, behaviour logprobs, advantage): what the policy update trains on."""
    rewards: list[float]
    """Every scored reward of the update, trained on or not: the update's mean reward is over these."""
    groups: int
    groups_with_signal: int
    groups_without_signal: int
    """Groups whose scored rewards were all equal (or fewer than two): advantage 0 everywhere, left out."""
    unscored: int


def training_items(prompts: Sequence[Sequence[int]], groups: Sequence[Sequence[GroupSample]],
                   algo: str, *, temperature: float = 1.0, top_p: float = 1.0) -> TrainingBatch:
    """Turn each prompt's group of samples into training items with group-relative advantages.

    ``groups[i]`` are the samples of ``prompts[i]``. Unscored samples drop out
    first; a group left with fewer than two samples, or with all rewards equal,
    has no group-relative signal and drops out too (GRPO would give it zeros,
    RLOO cannot take a group of one). Advantages are computed over the
    remaining samples of all groups at once, each group against itself.
    ``temperature``/``top_p``: the sampler the groups were drawn with, which
    the update's ratio is taken under.
    """
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {', '.join(ALGOS)}, got {algo!r}")
    if len(prompts) != len(groups):
        raise ValueError(f"{len(prompts)} prompts but {len(groups)} groups")
    kept: list[tuple[int, GroupSample]] = []
    rewards: list[float] = []
    unscored = without_signal = 0
    for g, group in enumerate(groups):
        scored = [s for s in group if s.reward is not None]
        unscored += len(group) - len(scored)
        rewards.extend(s.reward for s in scored)
        if len(scored) < 2 or len({s.reward for s in scored}) == 1:
            without_signal += 1
            continue
        kept.extend((g, s) for s in scored)
    ids = [g for g, _ in kept]
    kept_rewards = [s.reward for _, s in kept]
    advantages = grpo_advantages(kept_rewards, ids) if algo == "grpo" else rloo_advantages(kept_rewards, ids)
    samples = [Sample(list(prompts[g]), list(s.completion_ids), list(s.behaviour_logprobs), a, temperature, top_p)
               for (g, s), a in zip(kept, advantages)]
    return TrainingBatch(samples, rewards, len(groups), len(groups) - without_signal, without_signal, unscored)


def shown_token_count(decoded_prefixes: Sequence[str], *, single_line: bool, stops: Sequence[str]) -> int:
    """How many of a sampled completion's tokens the editor acts on.

    ``decoded_prefixes[n]`` is the text of the first ``n + 1`` tokens. The
    completion ends with the token that completes the first stop string (or the
    first newline in single-line mode): that token is kept, since choosing to
    stop is part of the action; everything after it is dropped. No stop: all
    tokens count.
    """
    for n, text in enumerate(decoded_prefixes):
        if earliest_stop(text, stops) >= 0 or (single_line and "\n" in text):
            return n + 1
    return len(decoded_prefixes)


# -- sampling and scoring ------------------------------------------------------------------------


def prompt_ids(tokenizer, task: FimTask, max_prompt_tokens: int) -> list[int]:
    """The task's prompt in the model's own format, as token ids trimmed to the budget, as the front door
    renders and trims it (``policy.fim.prompt_token_ids``)."""
    budget = min(max_prompt_tokens, getattr(tokenizer, "model_max_length", max_prompt_tokens) or max_prompt_tokens)
    return prompt_token_ids(tokenizer, task.fim_prompt(), budget)[0]


@dataclass(frozen=True)
class Sampled:
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    shown: str
    """What Continue would insert (cut at the stop, one line in single-line mode)."""


def sample_groups(model, tokenizer, prompts: Sequence[list[int]], tasks: Sequence[FimTask], group_size: int, *,
                  max_new_tokens: int, temperature: float, generator, pad_id: int, top_p: float = 1.0,
                  rows_per_batch: int = 32) -> list[list[Sampled]]:
    """K completions per prompt from ``model``, each cut where the editor would cut it."""
    rows = [(i, p) for i, p in enumerate(prompts) for _ in range(group_size)]
    drawn: list[tuple[list[int], list[float]]] = []
    for start in range(0, len(rows), rows_per_batch):
        chunk = [p for _, p in rows[start:start + rows_per_batch]]
        drawn.extend(sample_completions(model, chunk, max_new_tokens=max_new_tokens, temperature=temperature,
                                        top_p=top_p, generator=generator, eos_id=tokenizer.eos_token_id, pad_id=pad_id))
    groups: list[list[Sampled]] = [[] for _ in prompts]
    for (i, _), (ids, logprobs) in zip(rows, drawn):
        task = tasks[i]
        single = single_line_mode(task.prefix)
        decoded = [tokenizer.decode(ids[:n + 1], skip_special_tokens=False) for n in range(len(ids))]
        n = shown_token_count(decoded, single_line=single, stops=CONTINUE_STOPS)
        groups[i].append(Sampled(ids[:n], logprobs[:n], cut_completion(decoded[n - 1], task.prefix)))
    return groups


def make_scorer(name: str, *, judge_config=None, user_model: UserModel = UserModel(),
                reward_spec: RewardSpec = RewardSpec(), test_workers: int = 2) -> Scorer:
    """The reward of a shown completion under scorer ``name`` (the same scorers as ``tabloop eval``).

    ``user``: the reward ``reward_spec`` gives ``user_model``'s decision, the reward the online trainer gets
    from the episode of that decision."""
    if name == "exact":
        def exact(tasks, completions):
            return [1.0 if Scored(t.task_id, c, t.middle, t.solutions, single_line_mode(t.prefix)).exact else 0.0
                    for t, c in zip(tasks, completions)]
        return exact
    if name == "tests":
        return lambda tasks, completions: [1.0 if ok else 0.0
                                           for ok in score_tests(tasks, completions, workers=test_workers)]
    if name == "judge":
        if judge_config is None:
            raise ValueError("the judge scorer needs a judge: --judge-url, --judge-model and JUDGE_API_KEY "
                             "(or TABLOOP_JUDGE_* / LLMASJUDGE_* settings)")
        # The judge's 0–10 scale brought to 0–1 like the other scorers; a missing score stays missing.
        return lambda tasks, completions: [None if s is None else s / 10.0
                                           for s, _ in score_judge(judge_config, tasks, completions)]
    if name == "user":
        return lambda tasks, completions: [row["reward"] for row in
                                           decision_rows(tasks, completions, user_model, reward_spec)]
    raise ValueError(f"scorer must be one of {', '.join(SCORERS)}, got {name!r}")


# -- one update ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OfflineConfig:
    algo: str = "grpo"
    group_size: int = 8
    prompts_per_update: int = 4
    max_new_tokens: int = 48
    temperature: float = 1.0
    """The sampler's temperature. The behaviour logprobs are recorded, and the ratio recomputed, under this
    same tempered (and top-p) distribution, so any value above greedy is trained consistently; greedy
    (≤ GREEDY_TEMPERATURE) samples nothing to weigh and is refused."""
    top_p: float = 1.0
    """The sampler's top-p nucleus (1.0: the whole vocabulary)."""
    max_prompt_tokens: int = 2048
    rows_per_batch: int = 32

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise ValueError(f"--algo must be one of {', '.join(ALGOS)}, got {self.algo!r}")
        if self.group_size < 2:
            raise ValueError(f"--group-size must be at least 2 (advantages compare samples of one prompt), "
                             f"got {self.group_size}")
        if self.prompts_per_update < 1:
            raise ValueError(f"--prompts-per-update must be at least 1, got {self.prompts_per_update}")
        if self.temperature <= GREEDY_TEMPERATURE:
            raise ValueError(f"--temperature must be above {GREEDY_TEMPERATURE} (greedy completions carry no "
                             f"importance weight to train with), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def offline_update(policy: PolicyTrainer, tasks: Sequence[FimTask], config: OfflineConfig, score: Scorer,
                   generator) -> dict:
    """Sample, score, compute group advantages, update once. Returns the update's figures."""
    started = time.perf_counter()
    tok = policy.tokenizer
    prompts = [prompt_ids(tok, t, config.max_prompt_tokens) for t in tasks]
    groups = sample_groups(policy.model, tok, prompts, tasks, config.group_size,
                           max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                           top_p=config.top_p, generator=generator, pad_id=policy.pad_id,
                           rows_per_batch=config.rows_per_batch)
    expanded = [t for t, g in zip(tasks, groups) for _ in g]
    rewards = score(expanded, [s.shown for g in groups for s in g])
    if len(rewards) != len(expanded):
        raise RuntimeError(f"the scorer returned {len(rewards)} rewards for {len(expanded)} completions")
    it = iter(rewards)
    scored_groups = [[GroupSample(s.completion_ids, s.behaviour_logprobs, next(it)) for s in g] for g in groups]
    batch = training_items(prompts, scored_groups, config.algo, temperature=config.temperature, top_p=config.top_p)
    sampled_s = time.perf_counter() - started
    metrics = policy.update(batch.samples) if batch.samples else None
    shown = [s.shown for g in groups for s in g]
    return {
        "reward_mean": sum(batch.rewards) / len(batch.rewards) if batch.rewards else float("nan"),
        "samples": len(expanded),
        "samples_trained": len(batch.samples),
        "groups": batch.groups,
        "groups_with_signal": batch.groups_with_signal,
        "unscored": batch.unscored,
        "empty_share": sum(not s.strip() for s in shown) / len(shown),
        "updated": metrics is not None,
        "sample_seconds": sampled_s,
        **({k: metrics[k] for k in ("policy_loss", "approx_kl", "clip_fraction", "entropy", "grad_norm", "lr",
                                    "update_seconds")} if metrics else {}),
    }


def task_schedule(n_tasks: int, per_update: int, updates: int, seed: int) -> list[list[int]]:
    """Task indices of each update: a seeded shuffle of all tasks, pass after pass, each pass reshuffled."""
    rng = random.Random(f"{seed}:offline")
    order: list[int] = []
    out = []
    for _ in range(updates):
        picked = []
        while len(picked) < min(per_update, n_tasks):
            if not order:
                order = list(range(n_tasks))
                rng.shuffle(order)
            picked.append(order.pop())
        out.append(picked)
    return out


# -- the run -------------------------------------------------------------------------------------------


@dataclass
class OfflineRun:
    """What ``tabloop train --offline`` was asked to do beyond one update's config."""

    dataset: str
    scorer: str
    config: OfflineConfig
    updates: int | None = None
    """None: one pass over the dataset."""
    save_every: int | None = None
    """Updates per weight version; None: one version at the end."""
    seed: int = 0
    """Seeds the datasets' tasks (and a ``limit``'s sample of them), their order (``task_schedule``) and the
    sampling."""
    limit: int | None = None
    """Use at most this many tasks of the dataset (None: all)."""
    eval_dataset: str | None = None
    """Held-out tasks evaluated (greedy, with the run's scorer) before the first update and after the last."""
    eval_limit: int | None = None
    eval_max_new_tokens: int = 48
    publish: bool | None = None
    """True: announce on tabloop.weights (fail when no broker answers); False: never; None: when one answers."""
    promote: bool = False
    """Announce versions as PROMOTED (else CANDIDATE)."""
    judge_config: object = None
    user_model: UserModel = UserModel()
    """The ``user`` scorer's simulated user."""
    reward_spec: RewardSpec | None = None
    """The ``user`` scorer's rewards (None: the settings' default spec)."""
    lr: float | None = None
    """None: the online trainer's (``TABLOOP_TRAINER_LR``)."""
    full: bool | None = None
    """Full fine-tuning, or LoRA; None: ``TABLOOP_TRAINER_FULL_FINETUNE`` (a newest version in the store fixes it:
    ``load_current_policy``)."""


class OfflineError(ValueError):
    """A request the offline trainer can't carry out; the message says why."""


def publish_decision(requested: bool | None, broker_up: bool, bootstrap: str) -> bool:
    """Pure: publish or not. Asked for and no broker is an error, not a silent skip."""
    if requested is True and not broker_up:
        raise OfflineError(f"--publish: no Kafka answers on {bootstrap}; start it (`tabloop kafka start`) "
                           f"or use --no-publish")
    return broker_up if requested is None else requested


def load_current_policy(settings, store, *, lr: float | None = None,
                        full: bool | None = None) -> tuple[PolicyTrainer, object]:
    """The policy to improve: the weight store's newest version (LoRA over the base, or full weights), else the base.

    Returns (policy, parent manifest or None). Loads like the online trainer does, with its update config.
    """
    latest = store.latest()
    if latest is not None and full is not None and full != (latest.kind == "FULL"):
        # The newest version fixes the kind: its weights are a LoRA adapter or a whole model, not both.
        raise OfflineError(f"version {latest.version} in the weight store is {latest.kind}: training continues "
                           f"from it as {latest.kind}; drop {'--full' if full else '--lora'}")
    config = update_config(settings)
    if lr is not None:
        config = dataclasses.replace(config, lr=lr)
    return load_policy(settings, store, latest, config=config, full=full), latest


def _evaluate(policy: PolicyTrainer, tasks, scorer: str, run: OfflineRun, log) -> dict:
    model = policy.model
    was_training = model.training
    model.eval()
    try:
        summary, _ = evaluate(model, policy.tokenizer, tasks, scorer=scorer, judge_config=run.judge_config,
                              user_model=run.user_model, reward_spec=run.reward_spec, log=log, temperature=0.0,
                              max_new_tokens=run.eval_max_new_tokens, max_prompt_tokens=run.config.max_prompt_tokens,
                              seed=run.seed)
    finally:
        model.train(was_training)
    return summary


def _flat_eval(prefix: str, summary: dict | None) -> dict[str, float]:
    if not summary:
        return {}
    return {f"{prefix}/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float))}


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def run_offline(settings, run: OfflineRun, *, log: Callable[[str], None] | None = None) -> dict:
    """The whole offline run; returns the summary ``tabloop train --offline`` prints as its last line."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if run.scorer not in SCORERS:
        raise OfflineError(f"--scorer must be one of {', '.join(SCORERS)}, got {run.scorer!r}")
    tasks = resolve_dataset(run.dataset, seed=run.seed, limit=run.limit)
    eval_tasks = resolve_dataset(run.eval_dataset, seed=run.seed, limit=run.eval_limit) if run.eval_dataset else None
    needs_tests = run.scorer == "tests" or (run.scorer == "user" and run.user_model.rule == "tests")
    if needs_tests:
        for name, ts in ((run.dataset, tasks), (run.eval_dataset, eval_tasks or [])):
            missing = [t.task_id for t in ts if t.test is None]
            if missing:
                raise OfflineError(f"--scorer {run.scorer} needs tasks with tests; {len(missing)} of {len(ts)} in "
                                   f"{name} have none (e.g. {missing[0]}): use a dataset such as humaneval")
    if run.reward_spec is None:
        run = dataclasses.replace(run, reward_spec=scorer_reward_spec(settings, run.scorer))
    score = make_scorer(run.scorer, judge_config=run.judge_config, user_model=run.user_model,
                        reward_spec=run.reward_spec)
    config = run.config
    n_updates = run.updates or math.ceil(len(tasks) / config.prompts_per_update)
    save_every = run.save_every or n_updates

    publish = False
    if run.publish is not False:
        publish = publish_decision(run.publish, broker_answers(settings), settings.kafka_bootstrap)

    base = build_named_model(settings)
    store = WeightStore(settings.effective_weight_store, base)
    policy, parent = load_current_policy(settings, store, lr=run.lr, full=run.full)
    version = parent.version if parent else 0
    say(f"train --offline: {run.config.algo}, {config.group_size} samples × {config.prompts_per_update} prompts per "
        f"update, {n_updates} updates on {len(tasks)} tasks of {run.dataset} (scorer {run.scorer}); policy "
        f"{base} version {version} ({policy.kind.lower()}) on {policy.device}")

    eval_before = eval_after = None
    if eval_tasks:
        say(f"train --offline: evaluating version {version} on {len(eval_tasks)} tasks of {run.eval_dataset}")
        eval_before = _evaluate(policy, eval_tasks, run.scorer, run, say)

    generator = torch.Generator().manual_seed(run.seed)
    torch.manual_seed(run.seed)
    schedule = task_schedule(len(tasks), config.prompts_per_update, n_updates, run.seed)
    updates: list[dict] = []
    versions: list[dict] = []
    pending: list[dict] = []
    step = parent.trainer_step if parent else 0
    for number, picked in enumerate(schedule, 1):
        figures = offline_update(policy, [tasks[i] for i in picked], config, score, generator)
        step += figures["updated"]
        updates.append({"update": number, **figures})
        pending.append(figures)
        say(f"train --offline: update {number}/{n_updates}: reward {figures['reward_mean']:.3f}, "
            f"{figures['groups_with_signal']}/{figures['groups']} groups with signal, "
            f"{figures['samples_trained']} samples trained"
            + (f", loss {figures['policy_loss']:.4f}, kl {figures['approx_kl']:.4f}" if figures["updated"] else
               " (no update: no group had signal)"))
        last = number == n_updates
        if number % save_every == 0 or last:
            if last and eval_tasks:
                say(f"train --offline: evaluating the trained policy on {len(eval_tasks)} tasks of {run.eval_dataset}")
                eval_after = _evaluate(policy, eval_tasks, run.scorer, run, say)
            if not any(f["updated"] for f in pending):
                # The weights are the parent's: a version would only be a copy of it.
                say(f"train --offline: no policy update since version {parent.version if parent else 0} "
                    f"(no group had signal): no new version")
                continue
            manifest = _save_version(store, policy, parent, run, pending, step, eval_before if last else None,
                                     eval_after if last else None, len(tasks))
            status = None
            if publish:
                status = "PROMOTED" if run.promote else "CANDIDATE"
                _announce(settings, manifest, status)
            say(f"train --offline: version {manifest.version} saved at {manifest.uri}"
                + (f", published as {status}" if status else " (not published)"))
            versions.append({"version": manifest.version, "uri": manifest.uri, "status": status,
                             "reward_mean": manifest.metrics.get("reward_mean")})
            parent, pending = manifest, []

    rewards = [u["reward_mean"] for u in updates]
    quarter = max(1, len(rewards) // 4)
    summary = {
        "mode": "offline", "algo": config.algo, "group_size": config.group_size, "scorer": run.scorer,
        "dataset": run.dataset, "tasks": len(tasks), "prompts_per_update": config.prompts_per_update,
        "base_model": base, "kind": policy.kind,
        "updates": updates,
        "reward_mean_first": _mean(rewards[:quarter]), "reward_mean_last": _mean(rewards[-quarter:]),
        "versions": versions, "published": publish,
        "eval_dataset": run.eval_dataset, "eval_before": eval_before, "eval_after": eval_after,
        **_user_fields(run),
    }
    return _json_safe(summary)


def _user_fields(run: OfflineRun) -> dict:
    """How the ``user`` scorer's user decided: part of what a version was trained on."""
    if run.scorer != "user":
        return {}
    return {"user_rule": run.user_model.rule, "user_threshold": run.user_model.threshold}


def _json_safe(value):
    """NaN (an update whose samples all went unscored) as null: the last line stays strict JSON."""
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 6)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _save_version(store, policy: PolicyTrainer, parent, run: OfflineRun, figures: list[dict], step: int,
                  eval_before: dict | None, eval_after: dict | None, n_tasks: int):
    """Write the policy as the next version; the manifest says how it was trained and what it scored."""
    rewards = [f["reward_mean"] for f in figures]
    metrics = {
        "reward_mean": _mean(rewards), "reward_mean_first_update": rewards[0], "reward_mean_last_update": rewards[-1],
        "updates": float(len(figures)), "updates_applied": float(sum(f["updated"] for f in figures)),
        "samples": float(sum(f["samples"] for f in figures)),
        "samples_trained": float(sum(f["samples_trained"] for f in figures)),
        "group_size": float(run.config.group_size), "prompts_per_update": float(run.config.prompts_per_update),
        "offline": 1.0,
        **_flat_eval("eval_before", eval_before), **_flat_eval("eval_after", eval_after),
    }
    # The online trainer resumes its per-project reward baseline from the newest manifest: pass it on.
    if parent is not None:
        metrics.update({k: v for k, v in parent.metrics.items() if k.startswith(("baseline_mean/", "baseline_count/"))})
    metrics = {k: v for k, v in metrics.items() if not math.isnan(v)}
    training = {"mode": "offline", "algo": run.config.algo, "group_size": run.config.group_size,
                "scorer": run.scorer, "dataset": run.dataset, "tasks": n_tasks,
                "prompts_per_update": run.config.prompts_per_update, "max_new_tokens": run.config.max_new_tokens,
                "temperature": run.config.temperature, "top_p": run.config.top_p, "seed": run.seed,
                "lr": policy.config.lr}
    if run.eval_dataset:
        training["eval_dataset"] = run.eval_dataset
    training.update(_user_fields(run))
    offsets = dict(parent.source_offsets) if parent else {}
    version = store.next_version()
    with tempfile.TemporaryDirectory() as tmp:
        policy.save(Path(tmp))
        return store.save(version, Path(tmp), dict(
            parent_version=parent.version if parent else 0, kind=policy.kind, trainer_step=step,
            # No episodes were read: the topic position stays the parent's, so online training resumes there.
            episodes_consumed=0, episodes_trained=0, episodes_dropped={},
            source_topic=parent.source_topic if parent else EPISODES.name,
            source_offsets_start=offsets, source_offsets=offsets,
            episodes_consumed_total=parent.episodes_consumed_total if parent else 0,
            metrics=metrics, training=training))


def _announce(settings, manifest, status: str) -> None:
    """Publish the version's WeightVersion and wait for Kafka's ack."""
    ensure_topics(settings)
    with EventProducer(settings, client_id="tabloop-train-offline") as producer:
        producer.publish_acked(version_event(manifest, status)).result(60)


__all__ = ["GroupSample", "OfflineConfig", "OfflineError", "OfflineRun", "TrainingBatch", "load_current_policy",
           "make_scorer", "offline_update", "publish_decision", "run_offline", "sample_groups",
           "shown_token_count", "task_schedule", "training_items"]
