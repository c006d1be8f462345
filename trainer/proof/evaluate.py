"""Offline evaluation: sample completions of a dataset's tasks with a policy, score them, summarise.

``tabloop eval --scorer exact|tests|judge DATASET [--policy V]``:

* the policy is the base model (``TABLOOP_MODEL``), or policy version ``V``
  as published on ``tabloop.weights`` (its ``uri`` and ``kind``, loaded the way
  the serving engine loads it), or a directory of weights (full model, or a
  LoRA adapter over the base model) — ``load_policy``;
* completions are generated the way the front door's engine would serve them
  (the FIM prompt trimmed to the prompt budget without losing a FIM token,
  generation stopped at the end-of-text token and at Continue's stop strings)
  and then cut the way Continue shows them (one line when the cursor is after
  text on its line);
* every run reports exact match, line match (what the default simulated user
  accepts), edit similarity and the share of empty suggestions; ``tests`` adds
  pass@1 (the task's tests in the sandbox), ``judge`` the LLM judge's 0–10 score,
  ``user`` what a simulated user (``--rule``, ``--threshold``) makes of the
  suggestions: accept rate among shown, share shown, accepted characters per
  request, kept characters per request (of what was accepted, what agrees with
  the true code) and mean reward — the figures of ``tabloop bench loop``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from infra.bus import read_topic
from policy.fim import earliest_stop, prompt_format, prompt_token_ids
from policy.models import load_model
from policy.sampling import sampling_log_probs
from policy.shown import kept_token_count, single_line_mode
from rewards.judge import JudgeClient
from rewards import sandbox
from rewards.spec import RewardSpec, RewardSpecs
from schemas.topics import WEIGHTS
from trainer.build_models import build_named_model
from trainer.metrics import Scored, summarize, user_figures
from trainer.proof.simulate import CONTINUE_STOPS, UserModel, decision_rows
from trainer.proof.tasks import FimTask, iter_batches

SCORERS = ("exact", "tests", "judge", "user")


def scorer_reward_spec(settings, scorer: str) -> RewardSpec:
    """The rewards ``scorer`` reports: for ``user`` the settings' default spec, the one the streams worker
    rewards episodes with; Cursor's otherwise. Only the user scorer reads the spec file, so a bad one
    (ValueError, naming it) does not stop an exact-match run."""
    return RewardSpecs.from_settings(settings).default if scorer == "user" else RewardSpec()


# -- the policy ------------------------------------------------------------------------------

def load_policy(settings, policy: str | None = None, *, model_spec: str | None = None, device: str = "cpu"):
    """(model, tokenizer, label) for ``policy``: None or "0" → the base model; a version number → that
    version from ``tabloop.weights``; a directory → its weights (a LoRA adapter if it has
    adapter_config.json, else a full model)."""
    base_spec = model_spec or build_named_model(settings)
    model, tokenizer = load_model(base_spec, device=device)
    if policy is None or policy == "0":
        return model, tokenizer, f"{Path(base_spec).name or base_spec} (base)"
    path = Path(policy)
    if path.is_dir():
        kind = "LORA" if (path / "adapter_config.json").is_file() else "FULL"
        return apply_weights(model, str(path), kind, device), tokenizer, f"{path.name} ({kind.lower()})"
    if not policy.isdigit():
        raise ValueError(f"--policy must be a version number or a weights directory, got {policy!r}")
    uri, kind = published_version(settings, int(policy), base_spec)
    return apply_weights(model, uri, kind, device), tokenizer, f"v{policy}"


def published_version(settings, version: int, base_model: str) -> tuple[str, str]:
    """(uri, kind) of ``version`` of ``base_model`` on the weights topic: the hook between the trainer's
    weight store and evaluation is the same WeightVersion event serving replicas load from."""
    found = None
    for r in read_topic(settings, WEIGHTS.name, from_beginning=True):
        rec = r.event.record if r.event is not None else None
        if rec and rec["version"] == version and rec["base_model"] == base_model:
            found = rec  # the last record of that version wins (compacted topic: its latest status)
    if found is None:
        raise ValueError(f"policy version {version} of {base_model} is not on {WEIGHTS.name}")
    return found["uri"], found["kind"]


def apply_weights(base: torch.nn.Module, uri: str, kind: str, device: str = "cpu") -> torch.nn.Module:
    """The base model with a version's weights, as serving's engine builds it."""
    path = uri.removeprefix("file://")
    if kind == "LORA":
        from peft import PeftModel  # lazy: only a LoRA version's weights need peft (half a second to import)

        return PeftModel.from_pretrained(copy.deepcopy(base), path).merge_and_unload().eval()
    if kind == "FULL":
        return load_model(path, device=device)[0]
    raise ValueError(f"unknown weight kind {kind!r} (expected LORA or FULL)")


# -- sampling ------------------------------------------------------------------------------------

class _StopWhenDone(StoppingCriteria):
    """Per row: done at a stop string, or at a newline for single-line tasks."""

    def __init__(self, tokenizer, prompt_len: int, single_line: list[bool], stops: Sequence[str]):
        self.tokenizer, self.prompt_len, self.single_line, self.stops = tokenizer, prompt_len, single_line, stops

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = []
        for row, single in zip(input_ids, self.single_line):
            text = self.tokenizer.decode(row[self.prompt_len:], skip_special_tokens=False)
            done.append(earliest_stop(text, self.stops) >= 0 or (single and "\n" in text))
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def cut_completion(text: str, prefix: str, stops: Sequence[str] = CONTINUE_STOPS) -> str:
    """What Continue would insert: up to the first stop string; one line when the cursor follows text."""
    at = earliest_stop(text, stops)
    if at >= 0:
        text = text[:at]
    if single_line_mode(prefix):
        text = text.split("\n", 1)[0]
    return text.rstrip()


@dataclass(frozen=True)
class Draw:
    """One sampled completion of one task, with what the front door's show-gate scores it on."""

    task_index: int
    draw: int
    completion: str
    """As Continue shows it (``cut_completion``)."""
    line: str
    """The first line of the generated text (cut at the first stop string): the line the door holds and scores."""
    line_logprobs: tuple[float, ...]
    """Behaviour log-probabilities (``policy.sampling.sampling_log_probs`` at the sampling temperature and
    top-p, as the door logs them; at ``sample_draws``' ``gate_temperature`` when given) of the tokens whose
    text ends within ``line``, plus the one that ended it."""
    line_token_ids: tuple[int, ...] = ()
    """Those tokens' ids."""


@torch.no_grad()
def sample_draws(model, tokenizer, tasks: Sequence[FimTask], *, draws: int = 1, max_new_tokens: int = 48,
                 temperature: float = 0.0, top_p: float = 1.0, batch_size: int = 8, max_prompt_tokens: int = 2048,
                 seed: int = 0, with_context: bool = False, gate_temperature: float | None = None,
                 progress: Callable[[int], None] | None = None) -> list[Draw]:
    """``draws`` completions per task (draw-major: every task's draw 0, then draw 1 …), each with the first
    line and its tokens' behaviour log-probabilities, sampled as the front door's engine serves them.

    Sampling is transformers' (softmax(z / T), nucleus ``top_p``); the log-probabilities are recomputed from
    the raw logits with ``sampling_log_probs``, the door's definition (at top-p 1, what the simulated users
    send, the two distributions are the same). ``gate_temperature``: the line's log-probabilities are taken
    at that temperature instead, as the door computes its show-gate's figures (``default_temperature``, the
    exploration temperature, whatever the request was drawn at: greedy draws' own are all 0)."""
    fmt = prompt_format(tokenizer)  # the served model's prompt format, as the front door renders it
    stops = tuple(dict.fromkeys([*CONTINUE_STOPS, *fmt.stop_words]))
    budget = min(max_prompt_tokens, getattr(tokenizer, "model_max_length", max_prompt_tokens) or max_prompt_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    out: list[Draw] = []
    generator_seed = seed
    indexed = list(enumerate(tasks))
    for d in range(draws):
        for batch in iter_batches(indexed, batch_size):
            rows = []
            for _, t in batch:
                rows.append(prompt_token_ids(tokenizer, t.fim_prompt(with_context=with_context), budget, fmt)[0])
            width = max(len(r) for r in rows)
            # Left padding: every row's next token comes right after its own prompt.
            input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
            stop = _StopWhenDone(tokenizer, width, [single_line_mode(t.prefix) for _, t in batch], stops)
            sampling = temperature > 0
            torch.manual_seed(generator_seed)
            generator_seed += 1
            generated = model.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sampling,
                temperature=temperature if sampling else None, top_p=top_p if sampling else None, top_k=None,
                pad_token_id=pad, eos_token_id=tokenizer.eos_token_id,
                stopping_criteria=StoppingCriteriaList([stop]), output_logits=True, return_dict_in_generate=True)
            new = generated.sequences[:, width:]
            scale = temperature if gate_temperature is None else gate_temperature
            logprobs = torch.stack([sampling_log_probs(step, scale, top_p) for step in generated.logits], 1)
            chosen = logprobs.gather(-1, new[:, :logprobs.shape[1], None]).squeeze(-1)
            for row_index, ((i, t), row) in enumerate(zip(batch, new)):
                ids = row.tolist()
                if tokenizer.eos_token_id in ids:  # what follows the end of sequence is padding
                    ids = ids[:ids.index(tokenizer.eos_token_id) + 1]
                text = tokenizer.decode(ids, skip_special_tokens=False)
                at = earliest_stop(text, stops)
                line = (text[:at] if at >= 0 else text).split("\n", 1)[0]
                ends = []
                for k in range(len(ids)):
                    ends.append(len(tokenizer.decode(ids[:k + 1], skip_special_tokens=False)))
                    if ends[-1] > len(line):
                        break
                scored = kept_token_count(ends, len(line))  # the door's own rule
                out.append(Draw(task_index=i, draw=d, completion=cut_completion(text, t.prefix, stops), line=line,
                                line_logprobs=tuple(float(x) for x in chosen[row_index, :scored]),
                                line_token_ids=tuple(ids[:scored])))
            if progress:
                progress(len(batch))
    return out


def generate(model, tokenizer, tasks: Sequence[FimTask], *, max_new_tokens: int = 48, temperature: float = 0.0,
             top_p: float = 1.0, batch_size: int = 8, max_prompt_tokens: int = 2048, seed: int = 0,
             with_context: bool = False, progress: Callable[[int], None] | None = None) -> list[str]:
    """One completion per task (cut as Continue shows it)."""
    return [d.completion for d in sample_draws(
        model, tokenizer, tasks, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        batch_size=batch_size, max_prompt_tokens=max_prompt_tokens, seed=seed, with_context=with_context,
        progress=progress)]


# -- scoring ----------------------------------------------------------------------------------------

def score_tests(tasks: Sequence[FimTask], completions: Sequence[str], *, workers: int = 2,
                timeout_s: float = 10.0) -> list[bool]:
    """Whether each task's file with its completion passes the task's tests (in the sandbox)."""
    missing = [t.task_id for t in tasks if t.test is None]
    if missing:
        raise ValueError(f"the tests scorer needs tasks with tests; {len(missing)} of {len(tasks)} have none "
                         f"(e.g. {missing[0]}): use a dataset such as humaneval")
    # One uid per worker: runs of one uid share its process limit and could signal each other.
    def run(i: int) -> bool:
        uid = 65534 - (i % workers)
        return sandbox.run_tests(tasks[i].source_with(completions[i]), tests=tasks[i].test, timeout_s=timeout_s,
                                 uid=uid, gid=65534).passed

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(run, range(len(tasks))))


async def _judge_all(config, tasks: Sequence[FimTask], completions: Sequence[str]):
    async with JudgeClient(config) as client:
        return await asyncio.gather(*(client.score(t.prefix, t.suffix, c) for t, c in zip(tasks, completions)))


def score_judge(config, tasks: Sequence[FimTask], completions: Sequence[str]) -> list[tuple[float | None, str | None]]:
    """(score, error) per completion from the LLM judge (``rewards.judge``)."""
    return [(r.score, r.error) for r in asyncio.run(_judge_all(config, tasks, completions))]


def evaluate(model, tokenizer, tasks: Sequence[FimTask], *, scorer: str = "exact", samples: int = 1,
             judge_config=None, user_model: UserModel = UserModel(), reward_spec: RewardSpec = RewardSpec(),
             log: Callable[[str], None] | None = None, **generation) -> tuple[dict, list[Scored]]:
    """Sample ``samples`` completions per task, score them; returns (summary, every scored completion).

    pass@1 over several samples is the mean pass rate, the unbiased estimate. The ``user`` scorer's
    figures come from ``user_model``'s decisions and ``reward_spec``'s rewards.
    """
    if scorer not in SCORERS:
        raise ValueError(f"scorer must be one of {', '.join(SCORERS)}, got {scorer!r}")
    if scorer == "judge" and judge_config is None:
        raise ValueError("the judge scorer needs a judge (a rewards.judge.JudgeConfig)")
    if scorer == "tests":
        missing = [t.task_id for t in tasks if t.test is None]
        if missing:
            raise ValueError(f"the tests scorer needs tasks with tests; {len(missing)} of {len(tasks)} have "
                             f"none (e.g. {missing[0]}): use a dataset such as humaneval")
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    expanded = [t for t in tasks for _ in range(samples)]
    done = [0]

    def progress(n: int) -> None:
        done[0] += n
        say(f"eval: {done[0]}/{len(expanded)} completions")

    seed = generation.pop("seed", 0)
    completions = generate(model, tokenizer, expanded, seed=seed, progress=progress, **generation)
    passed: list[bool | None] = [None] * len(expanded)
    judged: list[tuple[float | None, str | None]] = [(None, None)] * len(expanded)
    if scorer == "tests":
        say(f"eval: running {len(expanded)} test programs in the sandbox")
        passed = score_tests(expanded, completions)
    elif scorer == "judge":
        say(f"eval: asking the judge about {len(expanded)} completions")
        judged = score_judge(judge_config, expanded, completions)
    scored = [Scored(task_id=t.task_id, completion=c, reference=t.middle, solutions=t.solutions,
                     single_line=single_line_mode(t.prefix), passed=p, judge=j[0], judge_error=j[1])
              for t, c, p, j in zip(expanded, completions, passed, judged)]
    summary = summarize(scored)
    if scorer == "user":
        summary.update(user_summary(expanded, completions, user_model, reward_spec))
    return summary, scored


def user_summary(tasks: Sequence[FimTask], completions: Sequence[str], user_model: UserModel,
                 reward_spec: RewardSpec) -> dict:
    """The ``user`` scorer's figures: a simulated user's decisions on the completions
    (``trainer.metrics.user_figures``; ``n`` is the summary's already), and beside the accepted characters
    per request the kept ones (``trainer.proof.simulate.kept_characters``: of an accepted suggestion, the
    characters that agree with the task's true continuation)."""
    rows = decision_rows(tasks, completions, user_model, reward_spec)
    figures = user_figures(rows)
    del figures["n"]
    kept = round(sum(r["kept_chars"] for r in rows) / len(rows), 4) if rows else None
    return {**figures, "kept_chars_per_request": kept, "user_rule": user_model.rule,
            "user_threshold": user_model.threshold}


def scored_jsonl(scored: Sequence[Scored]) -> str:
    return "".join(json.dumps(asdict(s)) + "\n" for s in scored)
