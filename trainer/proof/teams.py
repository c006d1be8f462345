"""`tabloop bench teams`: two simulated teams with different conventions, a shared policy against a policy per team.

The teams (``TEAMS``) write string literals with different quotes: one team's
code says 'name', the other's "name". Both are derived from the same task set:
a task puts the cursor right before a plain string literal in a standard-library
line (``quote_tasks``), and each team's version of it has the same prompt and the
rest of the line re-quoted in the team's style (``team_task``). The prompt does
not say which team is asking, as a project id does not reach the model. A team's
simulated user (``TeamUsers``) takes a suggestion only if it is close to the
team's true line (edit similarity at least ``threshold``) and its first string
literal is quoted the team's way.

What runs: from the base model, three LoRA policies with the same update budget
and the same offline RLOO updates as ``tabloop train --offline``
(``trainer.proof.offline.offline_update``): the shared policy on both teams'
tasks (each scored by its own team's users), and one policy per team on that
team's tasks only. Then the base model and each policy complete the held-out
tasks greedily, and each team's users decide, as they would online: each team's
accept rate among shown under the shared policy and under its own.
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from policy.models import load_model
from policy.shown import first_line
from rewards.spec import RewardSpec
from trainer.learner import PolicyTrainer, UpdateConfig
from trainer.metrics import user_figures
from trainer.proof.evaluate import evaluate
from trainer.proof.offline import OfflineConfig, offline_update, task_schedule
from trainer.proof.simulate import UserModel, decision_rows
from trainer.proof.tasks import FimTask, code_lines, source_files, split_of
from trainer.training_config import LoraTraining

TEAMS = {"single": "'", "double": '"'}
"""Team name -> the quote its code writes string literals with."""

# A one-line string literal: an optional prefix (f, r, b, u, rb…) not glued to a word, a quote not part of a
# triple quote, then no quote, backslash or newline before the same quote closes it.
_STRING = re.compile(r"""(?<![\w'"])([rRbBuUfF]{0,2})(['"])([^'"\\\n]*)\2(?!['"])""")
_OPENING_QUOTE = re.compile(r"""(?<![\w'"])[rRbBuUfF]{0,2}(['"])""")

# Where the rest of the line most likely starts with a string: a message, a separator, a key, an encoding.
_STRING_CONTEXT = re.compile(r"(raise \w+\(|\b(print|warn|error|info|debug|warning|exception|write|startswith|"
                             r"endswith|get|join|split|encode|decode|replace|getattr|hasattr|setattr)\()$")


def requote(code: str, quote: str) -> str:
    """``code`` with every one-line string literal quoted with ``quote`` (its prefix kept); literals holding a
    quote or a backslash, and triple-quoted ones, are left as they are."""
    if quote not in ("'", '"'):
        raise ValueError(f"a quote is ' or \", got {quote!r}")
    return _STRING.sub(lambda m: f"{m.group(1)}{quote}{m.group(3)}{quote}", code)


def quote_rule(text: str, team: str) -> str:
    """The rule baseline of the team loop (issue 41, item 5): every quote character of the other kind in
    ``text`` replaced by the team's, what one regex knows of the team's habit. Applied to version 0's greedy
    completions it is the baseline a learned team policy has to beat. Not ``requote``: that one rewrites only
    closed one-line literals, and a suggestion often stops inside its literal.

    >>> quote_rule('print("a", x["k"])', "single")
    "print('a', x['k'])"
    """
    quote = TEAMS[team]
    return text.replace("'" if quote == '"' else '"', quote)


def first_literal_quote(text: str) -> str | None:
    """The opening quote of the first string literal in ``text`` (f'..' and r".." count), closed or not: a
    suggestion may stop inside it. None: there is none."""
    m = _OPENING_QUOTE.search(text)
    return m.group(1) if m else None


def quote_tasks(split: str, *, seed: int = 0, limit: int | None = None, prefix_lines: int = 40,
                suffix_lines: int = 12, max_middle_chars: int = 40) -> list[FimTask]:
    """A task per standard-library code line (of ``split``'s files) with a string literal right after a call's
    opening parenthesis that usually takes one (``raise X(``, ``.split(``, ``print(`` …): the cursor goes
    right before the literal, the middle is the rest of the line. There, what the model writes is mostly a
    string, and its quotes are the choice that tells the teams apart."""
    tasks = []
    for rel, path in source_files():
        if split_of(rel) != split:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        lines = text.splitlines(keepends=True)
        for i in code_lines(text):
            line = lines[i].rstrip("\n")
            m = _STRING.search(line)
            if m is None or len(line) - m.start() > max_middle_chars or not _STRING_CONTEXT.search(line[:m.start()]):
                continue  # no literal, a long rest of the line, or not where a string is what comes next
            col = m.start()
            tasks.append(FimTask(task_id=f"{rel}:{i + 1}:{col}",
                                 prefix="".join(lines[max(0, i - prefix_lines):i]) + line[:col],
                                 suffix="\n" + "".join(lines[i + 1:i + 1 + suffix_lines]), middle=line[col:],
                                 filepath=rel, source="source"))
    if not tasks:
        raise ValueError(f"no string-literal tasks in the standard library's {split} split")
    if limit is not None and limit < len(tasks):
        tasks = random.Random(f"{seed}:teams:{split}").sample(tasks, limit)
    return tasks


def team_task(task: FimTask, team: str) -> FimTask:
    """The team's version of ``task``: the same prompt, the rest of the line in the team's quotes."""
    return replace(task, middle=requote(task.middle, TEAMS[team]), source=f"team:{team}")


def team_of(task: FimTask) -> str:
    if not task.source.startswith("team:") or task.source[5:] not in TEAMS:
        raise ValueError(f"task {task.task_id} is no team's (source {task.source!r})")
    return task.source[5:]


@dataclass(frozen=True)
class TeamUsers:
    """Each team's simulated user: the similarity user of ``tabloop eval`` (``UserModel``) on the team's line,
    who also wants the team's quotes."""

    threshold: float = 0.3

    def accepts(self, task: FimTask, shown: str, *, run_tests: Callable[[str, str], bool] | None = None) -> bool:
        return (first_literal_quote(first_line(shown)) == TEAMS[team_of(task)]
                and UserModel("similarity", self.threshold).accepts(task, shown))


@dataclass(frozen=True)
class TeamsConfig(OfflineConfig, LoraTraining):
    """Each policy's training: offline RLOO updates (``OfflineConfig``) of LoRA adapters (``LoraTraining``)
    from the base model; and the teams' users and held-out tasks."""

    what = "bench teams"

    algo: str = "rloo"
    updates: int = 16
    """RLOO updates of each policy (the shared one and each team's)."""
    group_size: int = 6
    max_new_tokens: int = 16
    """Of the training samples and of the held-out completions."""
    lr: float = 5e-4
    threshold: float = 0.3
    """A team's user takes a suggestion this close to its line (edit similarity), and in its quotes."""
    train_limit: int | None = None
    """At most this many train tasks (None: all)."""
    heldout: int = 64
    """Held-out tasks each policy completes greedily."""
    max_prompt_tokens: int = 256
    ignored_reward: float = 0.0
    """The reward of showing nothing (the reward spec's ``ignored``; rejected is -0.25, accepted 0.75). At 0,
    silence is the safe answer to a user whose taste the policy does not know; at -0.25 it is a miss."""

    def __post_init__(self) -> None:
        OfflineConfig.__post_init__(self)
        LoraTraining.__post_init__(self)
        if self.updates < 1 or self.heldout < 1 or self.prompts_per_update < 2:
            raise ValueError("updates and heldout must be at least 1, prompts_per_update at least 2 "
                             "(the shared policy's updates hold both teams' prompts)")


def schedule(train: Sequence[FimTask], config: TeamsConfig, teams: Sequence[str]) -> list[list[FimTask]]:
    """A policy's updates: the same task order for every policy, each task as one of ``teams`` asks it (the
    shared policy: both, alternating, so each update holds both teams; a team's own policy: that team)."""
    return [[team_task(train[i], teams[(u + k) % len(teams)]) for k, i in enumerate(picked)]
            for u, picked in enumerate(task_schedule(len(train), config.prompts_per_update, config.updates,
                                                     config.seed))]


def run_teams_bench(model_spec: str, config: TeamsConfig, out_dir: Path, *,
                    log: Callable[[str], None] | None = None) -> dict:
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    train = quote_tasks("train", seed=config.seed, limit=config.train_limit)
    heldout = quote_tasks("heldout", seed=config.seed, limit=config.heldout)
    users, spec = TeamUsers(config.threshold), RewardSpec(ignored=config.ignored_reward)
    say(f"bench teams: {len(train)} train tasks, {len(heldout)} held-out tasks, model {model_spec}")

    def score(tasks, completions):
        return [row["reward"] for row in decision_rows(tasks, completions, users, spec)]

    def held_out(model, tokenizer, label: str) -> tuple[dict, list[dict]]:
        model.eval()
        _, scored = evaluate(model, tokenizer, heldout, scorer="exact", temperature=0.0,
                             max_new_tokens=config.max_new_tokens, batch_size=16,
                             max_prompt_tokens=config.max_prompt_tokens, seed=config.seed, log=lambda _: None)
        completions = [s.completion for s in scored]
        figures, rows = {}, []
        for team in TEAMS:
            decided = decision_rows([team_task(t, team) for t in heldout], completions, users, spec)
            figures[team] = {**user_figures(decided),
                             "accepted": sum(r["accepted"] for r in decided),
                             "shown": sum(r["shown"] is not None for r in decided)}
            rows += [{"policy": label, "team": team, **r} for r in decided]
        quotes = [first_literal_quote(first_line(c)) for c in completions]
        figures["first_quote"] = {name: quotes.count(q) for name, q in TEAMS.items()}
        say(f"bench teams: {label} on held-out: " + "; ".join(
            f"{team} accepts {figures[team]['accepted']}/{figures[team]['shown']} shown" for team in TEAMS)
            + f"; first quotes {figures['first_quote']}")
        return figures, rows

    base_model, tokenizer = load_model(model_spec)
    results, all_rows = {}, []
    results["base"], rows = held_out(base_model, tokenizer, "base")
    all_rows += rows
    del base_model
    schedules = {"shared": schedule(train, config, list(TEAMS)),
                 **{f"team:{team}": schedule(train, config, [team]) for team in TEAMS}}
    training = {}
    for label, updates in schedules.items():
        model, tokenizer = load_model(model_spec)
        policy = PolicyTrainer(model, tokenizer, UpdateConfig(lr=config.lr, warmup_updates=0, micro_batch=8),
                               lora_rank=config.lora_rank, seed=config.seed)
        generator = torch.Generator().manual_seed(config.seed)
        curve = []
        for u, tasks in enumerate(updates):
            step = offline_update(policy, tasks, config, score, generator)
            curve.append({k: step.get(k) for k in ("reward_mean", "groups_with_signal", "samples_trained",
                                                   "approx_kl", "update_seconds", "sample_seconds")})
            say(f"bench teams: {label} update {u + 1}/{len(updates)}: reward {step['reward_mean']:.3f}, "
                f"{step['groups_with_signal']}/{step['groups']} groups with signal")
        training[label] = curve
        results[label], rows = held_out(policy.model, tokenizer, label)
        all_rows += rows
        del policy, model
    comparison = {team: {"shared": results["shared"][team]["accept_rate_shown"],
                         "own": results[f"team:{team}"][team]["accept_rate_shown"],
                         "base": results["base"][team]["accept_rate_shown"]} for team in TEAMS}
    for team, c in comparison.items():
        # Showing nothing leaves the accept rate among shown undefined (None): then it is not beaten, and the
        # other figures (share shown, accepted characters, mean reward) say what happened.
        c["own_beats_shared"] = c["own"] is not None and (c["shared"] is None or c["own"] > c["shared"])
        for figure in ("shown_share", "accepted_chars_per_request", "reward_mean"):
            c[figure] = {label: results[key][team][figure] for label, key in
                         (("base", "base"), ("shared", "shared"), ("own", f"team:{team}"))}
    result = {"bench": "teams", "model": model_spec, "config": config.__dict__, "train_tasks": len(train),
              "heldout_tasks": len(heldout), "heldout": results, "comparison": comparison, "training": training,
              "wall_s": round(time.monotonic() - started, 1)}
    (out_dir / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in all_rows))
    (out_dir / "teams.json").write_text(json.dumps(result, indent=1))
    return result
