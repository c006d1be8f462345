"""`tabloop bench loop`: the whole loop on this machine, and what it does to held-out tasks.

What runs (nothing is a stand-in):

1. a Kafka broker of its own (free port, a state dir of its own) and the topics;
2. the supervisor `tabloop up` runs (``tabloop.supervisor.Supervisor``): the front
   door, the streams worker, the online trainer and the history sink, each a
   child process, with settings that make the trainer publish a version per
   policy update, and a join that turns a completion left without feedback
   for ``--ignored-ttl`` seconds into an IGNORED episode (reward 0): an empty
   suggestion is never shown and never answered, and these episodes are what
   lets the trainer compare "showed nothing" with "showed something rejected"
   (with rejects alone every reward is equal and every advantage 0);
3. simulated Continue users (``trainer.proof.simulate``) on the standard library's
   *train* split for ``--minutes``: real streamed completions, real accept /
   reject decisions, feedback through all three routes;
4. once the users stop and the components are stopped (Kafka still up),
   each served (weight version, show-gate version) pair is evaluated on the
   *held-out* tasks (all of ``stdlib:heldout`` unless ``--heldout`` says fewer)
   with the policy users were served: per weight version (0, the base model,
   included; loaded the way `tabloop eval --policy V` loads it,
   ``trainer.proof.evaluate.load_policy``) ``--draws`` completions per task are
   sampled once at the door's temperature with their behaviour log-probabilities
   (``sample_draws``), then every gate version the door served with that weight
   version (from the simulator's ``X-Tabloop-Gate-Version``; its GateVersion on
   ``tabloop.gates``) decides on those same draws (``trainer.proof.served``):
   with exploration (the served policy, ε from the gate, a seeded coin) and
   without (the gate's own decision). "No gate" is evaluated for every weight
   version. The simulated user's rule decides each shown suggestion. Two fixed
   baselines come beside them, what a plain server gives: version 0 greedy, always
   shown (``reference``), and version 0 greedy shown when the model's mean token
   probability on the line reaches a threshold chosen on ``--threshold-tasks``
   train-split tasks by the show-gate's rule (``reference.threshold_baseline``;
   ``trainer.proof.served.ConfidenceThreshold``).

Per evaluated pair (``versions``, ordered by version then gate, no gate first):
``accept_rate_shown`` (accepted / shown), ``shown_share`` (shown / requests; an
empty or hidden suggestion is not shown), ``accepted_chars_per_request``,
``kept_chars_per_request`` (of the accepted characters, those that agree with the
task's true continuation: ``trainer.proof.simulate.kept_characters``; a half-right
line accepted in full counts half) and ``reward_mean`` (the reward spec's reward of
each request's outcome), ``n`` requests (tasks × draws), each with two 90 %
intervals: ``intervals_by_task`` (clustered by task, ``trainer.proof.intervals``:
the ones to read; the draws of a task are not independent) and ``intervals`` (the
first kind, kept: Wilson over draws for the rates, normal over per-task means for
the rest); ``vs_reference``: each figure minus the greedy always-show reference's
on the same tasks, paired by task; and the same for the gate without exploration
in ``deterministic``. The figures of the train-split traffic each version served
online come along as ``online``. Nothing is chosen on held-out tasks: they are
only measured. The table printed at the end (also ``table.md``) says which
interval it shows.

``feedback_to_policy_s``: from the first feedback the users sent to the end of
the first completion served by a trained policy or gate (the front door's
``X-Tabloop-Policy-Version`` ≥ 1 or ``X-Tabloop-Gate-Version`` ≥ 1, as the
simulator recorded them). Version 1 of either is trained on the first decided
episodes, which hold the first feedback.

``--team NAME`` (issue 28, item 5) runs the same loop with one team's users (``trainer.proof.teams``: the
tasks whose cursor is before a string literal, the rest of the line in the team's quotes, a user who wants
the team's quotes): LoRA updates, the show-gate off; its goal is the team's held-out accept rate among
shown up 50 % relative to version 0.

Also in the result: ``episodes`` (the join's episodes of the users' project by outcome, and how many
IGNORED ones were empty suggestions) and ``updates`` (per promoted version: the batch's mean reward,
accept rate and policy loss, from its WeightVersion's metrics).

Everything the figures come from is written to ``--out``: ``requests.jsonl``
(each simulated request), ``heldout.jsonl`` (each held-out completion, its
decision and reward), ``loop.json`` (the result, also the last stdout line),
``loop.png`` (the plot), ``table.md`` (the printed table) and ``system.log`` (the components' output).
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import click

from infra.bus import ensure_topics, read_topic
from infra.errors import TabloopError
from infra.files import log_tail
from infra.kafka_broker import KafkaLaunchError, LocalKafka, free_port
from policy.fim import prompt_format, prompt_token_ids
from policy.models import ModelLoadError, read_continuations
from policy.named_models import NAMED_MODELS
from policy.sampling import GREEDY_TEMPERATURE
from policy.show_gate import Gate
from policy.shown import shown_text, single_line_mode
from policy.value_model import candidate_continuations, posterior_pick
from policy.weight_store import read_weight_records
from rewards.spec import RewardSpecs, acceptance_reward
from schemas.topics import EPISODES, GATES
from serving.completions import sampling_temperature
from tabloop import supervisor as sv
from tabloop.bench import stop_cleanly_on_sigterm
from trainer.build_models import build_named_model
from trainer.proof.evaluate import load_policy, sample_draws
from trainer.proof.intervals import INTERVALS_NOTE, LEVEL
from trainer.proof.seeds import compare_seeds, read_runs, seeds_table
from trainer.proof.served import (ConfidenceThreshold, choose_confidence_threshold, figures, paired_figures,
                                  relative_change, served_rows)
from trainer.proof.simulate import SimConfig, Simulation, UserModel, decision_rows, outcome_of, records_jsonl
from trainer.proof.tasks import resolve_dataset
from trainer.proof.teams import TEAMS, TeamUsers, quote_rule, quote_tasks, team_task
from trainer.training_config import LoraTraining

FIGURES = ("accept_rate_shown", "shown_share", "accepted_chars_per_request", "reward_mean")
KEPT = "kept_chars_per_request"
"""Issue 41, item 4: of the accepted characters, those the user keeps."""
REPORTED = ("accept_rate_shown", "shown_share", "accepted_chars_per_request", KEPT, "reward_mean")
"""Every figure an evaluated policy gets, in the order the table and the plot show them."""

# Cursor's Tab RL result, the goal on held-out tasks (issue 7): accept rate among shown suggestions up by 28 %
# relative, 20 % fewer suggestions shown, no fewer accepted characters per request; and a trained policy
# serving within a minute of the first feedback.
GOAL_ACCEPT_RATE_GAIN = 0.28
GOAL_SHOWN_DROP = 0.20
GOAL_FEEDBACK_TO_POLICY_S = 60.0
GOAL_TEAM_ACCEPT_RATE_GAIN = 0.50
"""Issue 28, item 5: a team's held-out accept rate among shown, relative to version 0."""
SIM_PROJECT = "bench-loop"


@dataclass(frozen=True)
class LoopBenchConfig(LoraTraining):
    """The loop bench's run: its users and tasks, the online trainer's LoRA updates (``LoraTraining``: its
    ``lr`` and ``lora_rank`` become ``TABLOOP_TRAINER_LR`` and ``TABLOOP_TRAINER_LORA_RANK``), the release
    settings, and the held-out evaluation."""

    what = "bench loop"

    minutes: float = 15.0
    users: int = 4
    model: str = "demo"
    engine: str = "transformers"
    """The front door's engine: transformers (in the door) or vllm (a vLLM replica the bench's supervisor starts
    from the environment ``tabloop vllm install`` made; every LoRA version hot-loads into it)."""
    vllm_dtype: str = "float32"
    """``--engine vllm``: the replica's dtype (``TABLOOP_VLLM_DTYPE``); bfloat16 to see the train–inference gap."""
    candidate_samples: int = 0
    """``TABLOOP_CANDIDATE_SAMPLES``: the door shows the likeliest of greedy and this many samples once the suffix
    is read after each (``serving.completions``); the held-out evaluation mirrors it (``chosen_draws``)."""
    heldout: int | None = None
    """Held-out tasks evaluated at every version (None: all of the split)."""
    draws: int = 2
    """Completions sampled per held-out task and weight version."""
    team: str | None = None
    """One team's users (``trainer.proof.teams.TEAMS``) on that team's tasks, the show-gate off."""
    train_limit: int | None = None
    """Use at most this many train-split tasks (None: all)."""
    rule: str = "exact"
    threshold: float = 0.8
    max_tokens: int = 32
    batch_size: int = 16
    """Episodes per policy update; every update is a version."""
    batch_wait_s: float = 20.0
    exploration_temperature: float | None = None
    eval_batch_size: int = 16
    max_evals: int | None = None
    """Evaluate at most this many versions (0 and the last always, the rest evenly spaced); None: every one."""
    eval_temperature: float | None = None
    """None: the temperature the door serves the users at (``serving.completions.sampling_temperature``)."""
    threshold_tasks: int = 100
    """Train-split tasks (at most) the confidence-threshold baseline's threshold is chosen on, from version 0's
    greedy completions of them; 0: no such baseline."""
    healthy_timeout_s: float = 600.0
    keep_state: bool = False
    abandon_share: float = 0.15
    """Share of requests a user types past and drops after the first chunk (the simulator's default). Such a
    completion gets no feedback, so with ``ignored_ttl_s`` it becomes an IGNORED episode: reward 0, above a
    reject, for text no user decided on; 0 keeps IGNORED episodes to suggestions that showed nothing."""
    max_staleness: int = 16
    """The trainer drops episodes from policies this many versions older: a version per update comes every
    few seconds, and an IGNORED episode arrives ``ignored_ttl_s`` after serving."""
    save_every: int = 1
    """Updates per published version."""
    canary_share: float = 0.0
    """> 0: every version goes out as a canary on this share of requests, and the trainer decides it."""
    canary_min_episodes: int = 50
    promote_gate: str = "none"
    """none, ope or shadow (``TABLOOP_PROMOTE_GATE``): with ope or shadow every version carries the gate's
    estimate, and ``ope_vs_canary`` compares it with what its canary measured."""
    gate_share: float = 0.1
    gate_min_episodes: int = 100
    ignored_ttl_s: float | None = 15.0
    """A served completion with no feedback this long becomes an IGNORED episode (reward ``ignored``, 0):
    an empty suggestion is never shown, so no feedback ever comes for it, and without these episodes the
    trainer never sees the outcome "showed nothing" to compare a reject with. None: no IGNORED episodes
    (the join's default, as Cursor's spec leaves them out)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.minutes <= 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")
        if self.users < 1 or (self.heldout is not None and self.heldout < 1) or self.draws < 1:
            raise ValueError("users, heldout and draws must be at least 1")
        if self.threshold_tasks < 0:
            raise ValueError(f"threshold_tasks must be 0 or more, got {self.threshold_tasks}")
        if self.team is not None and self.team not in TEAMS:
            raise ValueError(f"team must be one of {', '.join(TEAMS)}, got {self.team!r}")
        if not 0 <= self.abandon_share < 1:
            raise ValueError(f"abandon_share must be in [0, 1), got {self.abandon_share}")
        if self.ignored_ttl_s is not None and self.ignored_ttl_s <= 0:
            raise ValueError(f"ignored_ttl_s must be positive or None, got {self.ignored_ttl_s}")
        if self.promote_gate not in ("none", "ope", "shadow"):
            raise ValueError(f"promote_gate must be none, ope or shadow, got {self.promote_gate!r}")
        if not 0 <= self.canary_share < 1 or not 0 < self.gate_share < 1:
            raise ValueError("canary_share must be in [0, 1) and gate_share in (0, 1)")
        if self.save_every < 1 or self.canary_min_episodes < 1 or self.gate_min_episodes < 1:
            raise ValueError("save_every, canary_min_episodes and gate_min_episodes must be at least 1")
        if not 0 <= self.candidate_samples <= 8:
            raise ValueError(f"candidate_samples must be in 0..8, got {self.candidate_samples}")
        if self.engine not in ("transformers", "vllm"):
            raise ValueError(f"engine must be transformers or vllm, got {self.engine!r}")
        if self.rule not in ("exact", "similarity"):
            raise ValueError(f"the loop bench's users decide by exact or similarity, got {self.rule!r} "
                             "(the standard library's tasks have no tests)")


# -- the figures (pure) ------------------------------------------------------------------------

def heldout_rows(version: int, tasks: Sequence, completions: Sequence[str], user_model, spec) -> list[dict]:
    """One row per held-out request (``trainer.proof.simulate.decision_rows``), tagged with the version."""
    return [{"version": version, **row} for row in decision_rows(tasks, completions, user_model, spec)]


def versions_to_evaluate(published: Sequence[int], max_evals: int | None) -> list[int]:
    """0 and the published versions; with ``max_evals``, at most that many: 0, the last, and evenly spaced
    ones in between (evaluation takes minutes per version on a CPU; the loop makes one every few seconds)."""
    every = [0, *published]
    if max_evals is None or len(every) <= max_evals:
        return every
    if max_evals < 2:
        raise ValueError(f"max_evals must be at least 2 (the base model and the last version), got {max_evals}")
    step = (len(every) - 1) / (max_evals - 1)
    return sorted({every[round(i * step)] for i in range(max_evals)})


def versions_served(published: Iterable[int], pairs: dict[int, list[int]]) -> list[int]:
    """The published versions that served users, in order (``pairs``: ``served_pairs``). One published after
    the users stopped served nobody: evaluating it as "the last version" would not measure what users were
    served, and would leave out the gate that served last."""
    return sorted(v for v in published if v in pairs)


def feedback_to_policy_s(records: Iterable[dict]) -> float | None:
    """Seconds from the first feedback sent to the end of the first completion served by a policy version ≥ 1
    or a gate version ≥ 1, both trained on feedback (records as ``trainer.proof.simulate.RequestRecord``
    dicts); None when either never happened."""
    records = list(records)
    sent = [r["feedback_sent_at"] for r in records if r.get("feedback_sent_at") is not None]
    trained = [r["sent_at"] + r["latency_ms"] / 1000 for r in records
               if r.get("error") is None and r.get("sent_at") is not None
               and ((r.get("policy_version") or 0) >= 1 or (r.get("gate_version") or 0) >= 1)]
    if not sent or not trained:
        return None
    return round(min(trained) - min(sent), 2)


def episode_outcomes(episodes: Iterable[dict], project: str) -> dict:
    """How the join labelled ``project``'s episodes: count per outcome, and how many IGNORED ones were
    empty suggestions (nothing to show; the case that teaches "show less")."""
    counts = {"ACCEPTED": 0, "REJECTED": 0, "PARTIAL": 0, "IGNORED": 0, "ignored_empty": 0}
    for ep in episodes:
        if ep["project_id"] != project:
            continue
        counts[ep["outcome"]] = counts.get(ep["outcome"], 0) + 1
        if ep["outcome"] == "IGNORED" and not (ep.get("completion_text") or "").strip():
            counts["ignored_empty"] += 1
    return counts


def trainer_figures(weight_records: Iterable[dict], base_model: str) -> list[dict]:
    """Per promoted version, what its updates saw and did (the metrics its WeightVersion carries): mean
    reward and accept rate of the batch, the policy loss (0 when every advantage was 0), and the
    train–inference gap on the episodes its own weights served (``logprob_gap_*``: the server's logprobs
    against the trainer's on the same tokens; ~0 when both compute in fp32)."""
    out = []
    for version, record in sorted(_first_promotions(weight_records, base_model).items()):
        m = record.get("metrics") or {}
        out.append({"version": version, **{k: round(m[k], 6) if k in m else None for k in (
            "reward_mean", "accept_rate", "policy_loss", "approx_kl", "staleness_mean", "logprob_gap_mean",
            "logprob_gap_max", "logprob_gap_tokens")}})
    return out


def ope_vs_canary(weight_records: Iterable[dict], base_model: str) -> dict:
    """Per version, the promotion gate's estimate of its accept rate among shown (with its interval and
    effective sample size) and the accept rate its canary then measured on live traffic; ``inside`` where
    both exist: whether the measurement fell in the interval."""
    rows: dict[int, dict] = {}
    for r in weight_records:
        if r["base_model"] != base_model or r["version"] == 0:
            continue
        m = r.get("metrics") or {}
        row = rows.setdefault(r["version"], {"version": r["version"]})
        if "ope_accept_rate_shown" in m:
            row.update(estimate=m["ope_accept_rate_shown"], low=m["ope_accept_rate_shown_low"],
                       high=m["ope_accept_rate_shown_high"], ess=m.get("ope_ess"), held_out=m.get("ope_held_out"),
                       serving_version=m.get("ope_serving_version"),
                       serving_accept_rate=m.get("ope_serving_accept_rate_shown"),
                       gate_passed=m.get("ope_gate_passed"))
        if "canary_candidate_accept_rate" in m and r["status"] in ("PROMOTED", "ROLLED_BACK"):
            row.update(measured=m["canary_candidate_accept_rate"], canary_episodes=m.get("canary_candidate_episodes"),
                       decision=r["status"])
    compared = [row for row in rows.values() if "estimate" in row and "measured" in row]
    for row in compared:
        row["inside"] = row["low"] <= row["measured"] <= row["high"]
    return {"versions": [rows[v] for v in sorted(rows)], "compared": len(compared),
            "inside": sum(row["inside"] for row in compared)}


def _first_promotions(weight_records: Iterable[dict], base_model: str) -> dict[int, dict]:
    """Each trained version of ``base_model`` (not 0) → the WeightVersion record that first promoted it."""
    out: dict[int, dict] = {}
    for r in weight_records:
        if r["base_model"] == base_model and r["version"] != 0 and r["status"] == "PROMOTED":
            out.setdefault(r["version"], r)
    return out


def served_pairs(records: Iterable[dict]) -> dict[int, list[int]]:
    """Weight version → the gate versions the door served with it (sorted; completions with no gate add
    none), from the simulator's records of answered requests."""
    pairs: dict[int, set[int]] = {}
    for r in records:
        if r.get("error") is None and r.get("policy_version") is not None:
            gates = pairs.setdefault(r["policy_version"], set())
            if r.get("gate_version") is not None:
                gates.add(r["gate_version"])
    return {v: sorted(g) for v, g in sorted(pairs.items())}


def gates_by_version(gate_records: Iterable[dict], project: str) -> dict[int, dict]:
    """Gate version → its promoted GateVersion record, as the door would have served it to ``project``:
    the project's own gate where it has one of that version, else the shared one (project "")."""
    own, shared = {}, {}
    for r in gate_records:
        if r["status"] != "PROMOTED":
            continue
        if r.get("project_id") == project:
            own.setdefault(r["version"], r)
        elif not r.get("project_id"):
            shared.setdefault(r["version"], r)
    return {**shared, **own}


def goal(first: dict, last: dict, to_policy_s: float | None, chars_difference: dict | None = None,
         kept_difference: dict | None = None) -> dict:
    """Issue 28's goal for the show-gate loop, comparing the last served pair's held-out figures with version
    0's served policy. Accepted characters per request are "not lower" when the paired difference's interval
    (``chars_difference``, last − first over the same tasks) reaches 0; without it, when the last's is at
    least the first's. ``kept_difference``, the same for kept characters, comes along (issue 41)."""
    accept_gain = relative_change(last["accept_rate_shown"], first["accept_rate_shown"])
    shown_change = relative_change(last["shown_share"], first["shown_share"])
    chars_first, chars_last = first["accepted_chars_per_request"], last["accepted_chars_per_request"]
    if chars_difference is not None and chars_difference.get("high") is not None:
        chars_ok = chars_difference["high"] >= 0
    else:
        chars_ok = chars_last is not None and chars_first is not None and chars_last >= chars_first
    checks = {
        "accept_rate_up_28pct": accept_gain is not None and accept_gain >= GOAL_ACCEPT_RATE_GAIN,
        "shown_down_20pct": shown_change is not None and shown_change <= -GOAL_SHOWN_DROP,
        "accepted_chars_not_lower": chars_ok,
        "feedback_to_policy_under_60s": to_policy_s is not None and to_policy_s < GOAL_FEEDBACK_TO_POLICY_S,
    }
    return {"accept_rate_rel_change": accept_gain, "shown_share_rel_change": shown_change,
            "accepted_chars_change": None if chars_last is None or chars_first is None
            else round(chars_last - chars_first, 4), "accepted_chars_difference": chars_difference,
            "kept_chars_difference": kept_difference, **checks, "met": all(checks.values())}


def team_goal(first: dict, last: dict, difference: dict | None = None) -> dict:
    """Issue 28's goal for the team loop: the team's held-out accept rate among shown up 50 % relative to
    version 0, the last version's Wilson interval beside version 0's; the same clustered by task, and
    ``difference`` (last − first, paired by task) with whether its interval is above 0."""
    gain = relative_change(last["accept_rate_shown"], first["accept_rate_shown"])
    intervals = {label: e.get("intervals", {}).get("accept_rate_shown")
                 for label, e in (("first", first), ("last", last))}
    by_task = {label: e.get("intervals_by_task", {}).get("accept_rate_shown")
               for label, e in (("first", first), ("last", last))}
    return {"accept_rate_rel_change": gain, "accept_rate_shown_intervals": intervals,
            "accept_rate_shown_intervals_by_task": by_task, "accept_rate_difference": difference,
            "difference_above_zero": (difference is not None and difference.get("low") is not None
                                      and difference["low"] > 0),
            "interval_above_first": (intervals["last"] is not None and intervals["last"][0] is not None
                                     and first["accept_rate_shown"] is not None
                                     and intervals["last"][0] > first["accept_rate_shown"]),
            "accept_rate_up_50pct": gain is not None and gain >= GOAL_TEAM_ACCEPT_RATE_GAIN,
            "met": gain is not None and gain >= GOAL_TEAM_ACCEPT_RATE_GAIN}


# -- the plot ----------------------------------------------------------------------------------

def plot(result: dict, path: Path) -> Path:
    """Each figure per weight version: the served policy on held-out tasks with its interval clustered by task
    (no gate, and the last gate served with each version), the greedy always-show reference of version 0
    (dotted), the same under its confidence threshold (dash-dotted), and the train-split traffic served online
    (dashed)."""
    import matplotlib  # lazy: only the plot needs it, and pyplot must load after the Agg backend is chosen

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    online = {o["version"]: o for o in result.get("online", [])}
    reference = result.get("reference") or {}
    threshold = reference.get("threshold_baseline") or {}
    titles = {"accept_rate_shown": "accept rate among shown", "shown_share": "share of requests shown",
              "accepted_chars_per_request": "accepted chars per request", KEPT: "kept chars per request",
              "reward_mean": "mean reward"}
    no_gate = [v for v in result["versions"] if v.get("gate_version") is None]
    gated: dict[int, dict] = {}
    for v in result["versions"]:
        if v.get("gate_version") is not None:
            gated[v["version"]] = v  # the last gate served with each version
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), sharex=True)
    axes.flat[-1].axis("off")
    axes.flat[-1].text(0.0, 0.5, textwrap.fill(f"Error bars: {INTERVALS_NOTE}.", 45), fontsize=8, va="center")
    for ax, key in zip(axes.flat, REPORTED):
        for label, series, marker in (("held-out, served (no gate)", no_gate, "o"),
                                      ("held-out, served (with its gate)", [gated[k] for k in sorted(gated)], "s")):
            if not series:
                continue
            xs = [v["version"] for v in series]
            ys = [v[key] if v.get(key) is not None else float("nan") for v in series]
            bars = [_error_bar(v, key) for v in series]
            ax.errorbar(xs, ys, yerr=[[lo for lo, _ in bars], [hi for _, hi in bars]], marker=marker, capsize=3,
                        label=label)
        if reference.get(key) is not None:
            ax.axhline(reference[key], linestyle=":", color="grey", label="v0 greedy, always shown")
        if threshold.get(key) is not None:
            ax.axhline(threshold[key], linestyle="-.", color="grey", alpha=0.7,
                       label="v0 greedy, confidence threshold")
        ov = sorted(online)
        if ov:
            ax.plot(ov, [online[v][key] if online[v].get(key) is not None else float("nan") for v in ov],
                    linestyle="--", marker=".", alpha=0.6, label="train split (served online)")
        ax.set_title(titles[key])
        ax.tick_params(labelbottom=True)
        ax.grid(alpha=0.3)
    for ax in axes.flat:
        ax.set_xlabel("policy version")
    axes[0][0].legend(fontsize=7)
    f2p = result.get("feedback_to_policy_s")
    fig.suptitle(f"tabloop bench loop: {result['model_label']}, {result['minutes']} min, {result['users']} users, "
                 f"{result['heldout_tasks']} held-out tasks; feedback→policy "
                 f"{'n/a' if f2p is None else f'{f2p:.1f} s'}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _error_bar(entry: dict, key: str) -> tuple[float, float]:
    """(below, above) the figure to its interval's ends, clustered by task (the first kind in results written
    before those); (0, 0) without one."""
    value = entry.get(key)
    interval = (entry.get("intervals_by_task") or entry.get("intervals") or {}).get(key)
    if value is None or interval is None or None in interval:
        return 0.0, 0.0
    return max(0.0, value - interval[0]), max(0.0, interval[1] - value)


# -- the run -------------------------------------------------------------------------------------

def bench_settings(base, config: LoopBenchConfig, state_dir: Path, model_spec: str):
    """The bench's system: its own state dir, broker and ports, open auth on loopback, and a trainer that
    publishes (and promotes) a version per update."""
    update = {
        "state_dir": state_dir, "kafka_bootstrap": f"127.0.0.1:{free_port()}", "serve_host": "127.0.0.1",
        "completions_port": free_port(), "feedback_port": free_port(), "history_port": free_port(),
        "auth": "open", "model": model_spec, "weight_store": "", "clickhouse_url": "",
        # --engine vllm: one replica the supervisor starts and supervises, on a port of the bench's own.
        "engine": config.engine, "vllm_urls": "", "vllm_replicas": 1, "vllm_port": free_port(),
        "vllm_dtype": config.vllm_dtype,
        "trainer_device": "cpu", "trainer_batch_size": config.batch_size,
        "trainer_micro_batch": min(8, config.batch_size),
        "trainer_batch_wait_s": config.batch_wait_s, "trainer_save_every": config.save_every, "trainer_lr": config.lr,
        "trainer_warmup_updates": 0, "trainer_lora_rank": config.lora_rank, "trainer_full_finetune": False,
        "auto_promote": True, "canary_share": config.canary_share, "canary_min_episodes": config.canary_min_episodes,
        "promote_gate": config.promote_gate, "promote_gate_share": config.gate_share,
        "promote_gate_min_episodes": config.gate_min_episodes,
        "exploration_temperature": config.exploration_temperature,
        "candidate_samples": config.candidate_samples,
        # With open auth every user shares one rate-limit bucket; a refused feedback would turn a decision
        # into an IGNORED episode, so the limiter (not what this bench measures) stays out of the way.
        "rate_limit_per_minute": max(base.rate_limit_per_minute, 100_000),
        "trainer_max_staleness": config.max_staleness,
        # The team loop measures what LoRA updates alone teach (issue 28, item 5): no show-gate.
        "show_gate": base.show_gate if config.team is None else False,
    }
    if config.ignored_ttl_s is not None:
        # The join closes a completion as IGNORED once its partition's event time passes served_at + TTL;
        # the users' traffic moves event time on, and a partition idle for idle_close_s follows the wall
        # clock, so the IGNORED episodes reach the trainer about TTL seconds after serving.
        update.update(emit_ignored=True, completion_ttl_s=config.ignored_ttl_s,
                      idle_close_s=min(base.idle_close_s, 5.0))
    return base.model_copy(update=update)


def resolve_model(base, model: str) -> str:
    """``demo``/``smollm2`` (``NAMED_MODELS``): that model of the configured state dir (built there once, then
    reused); else a path or hub id as given."""
    if model in NAMED_MODELS:
        return build_named_model(base.model_copy(update={"model": model}))
    return model


def run_loop_bench(base_settings, config: LoopBenchConfig, out_dir: Path, *,
                   log: Callable[[str], None] | None = None) -> dict:
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    model_spec = resolve_model(base_settings, config.model)
    state_dir = Path(tempfile.mkdtemp(prefix="tabloop-bench-loop-"))
    settings = bench_settings(base_settings, config, state_dir, model_spec)
    # The spec the bench's streams worker rewards the users' episodes with, so that the figures' rewards are
    # the ones the trainer learned from.
    spec = RewardSpecs.from_settings(settings).for_project(SIM_PROJECT)
    train, heldout, user_model = tasks_and_user(config)
    say(f"bench loop: {len(train)} train tasks, {len(heldout)} held-out tasks"
        f"{f' of team {config.team}' if config.team else ''}, model {model_spec}, state {state_dir}")

    broker = LocalKafka(settings)
    supervisor = thread = None
    system_log = open(out_dir / "system.log", "w")
    restore_sigterm = stop_cleanly_on_sigterm()
    try:
        broker.start()
        ensure_topics(settings)
        supervisor = sv.Supervisor(settings, out=system_log)
        # The supervisor's own thread starts every child, so their parent-death signal follows this run.
        thread = threading.Thread(target=supervisor.run, name="bench-loop-supervisor", daemon=True)
        thread.start()
        _wait_healthy(supervisor, config.healthy_timeout_s, out_dir / "system.log")
        say(f"bench loop: every component healthy after {time.monotonic() - started:.0f}s; "
            f"{config.users} users for {config.minutes} min")

        sim_config = SimConfig(
            completions_url=f"http://127.0.0.1:{settings.completions_port}",
            feedback_url=f"http://127.0.0.1:{settings.feedback_port}", users=config.users, requests=None,
            duration_s=config.minutes * 60, rule=config.rule, threshold=config.threshold,
            max_tokens=config.max_tokens, seed=config.seed, project=SIM_PROJECT, progress_every_s=30,
            abandon_share=config.abandon_share)
        report = asyncio.run(Simulation(train, sim_config, log=say, user_model=user_model).run())
        records = [asdict(r) for r in report.records]
        (out_dir / "requests.jsonl").write_text(records_jsonl(report))
        sim_summary = report.summary()
        say(f"bench loop: the users made {sim_summary['completed']} requests; stopping the components")
        supervisor.stop()
        thread.join(120)

        weight_records = read_weight_records(settings)
        published = _published(weight_records, model_spec)
        outcomes = episode_outcomes((r.event.record for r in read_topic(settings, EPISODES.name)
                                     if r.event is not None), SIM_PROJECT)
        trained = trainer_figures(weight_records, model_spec)
        estimates = ope_vs_canary(weight_records, model_spec)
        if config.promote_gate != "none":
            say(f"bench loop: gate estimates vs canary measurements: {estimates['inside']} of "
                f"{estimates['compared']} measured accept rates inside the estimate's interval")
        say(f"bench loop: episodes {outcomes}; updates with a non-zero loss: "
            f"{sum(1 for t in trained if t['policy_loss'])} of {len(trained)}")
        gate_records = [r.event.record for r in read_topic(settings, GATES.name) if r.event is not None]
        pairs = served_pairs(records)
        temperature = served_temperature(settings, sim_config, config)
        say(f"bench loop: versions published: {sorted(published) or 'none'}; gate versions served: "
            f"{sorted({g for gs in pairs.values() for g in gs}) or 'none'}; evaluating the served policy on "
            f"held-out tasks at temperature {temperature}, {config.draws} draws")
        evaluated = evaluate_served(settings, model_spec, config, heldout, user_model, spec, published, pairs,
                                    gates_by_version(gate_records, SIM_PROJECT), temperature, say, train=train)
        versions, reference, rows_all, differences = evaluated
        (out_dir / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_all))
    finally:
        if supervisor is not None and thread is not None and thread.is_alive():
            supervisor.stop()
            thread.join(120)
        if supervisor is not None:
            supervisor.probes.close()  # its Kafka probe process, before the broker goes
        broker.stop()
        system_log.close()
        if not config.keep_state:
            shutil.rmtree(state_dir, ignore_errors=True)
        restore_sigterm()

    to_policy = feedback_to_policy_s(records)
    first_feedback = min((r["feedback_sent_at"] for r in records if r["feedback_sent_at"]), default=None)
    for v in versions:  # publication times relative to the first feedback, as feedback_to_policy_s is
        if v["published_s"] is not None and first_feedback is not None:
            v["published_s"] = round(v["published_s"] - first_feedback, 2)
    online = [{"version": v, **{k: part[k] for k in ("completed", "shown", "accepted", *FIGURES[:3], KEPT)}}
              for v, part in report.by_version().items()]
    online_rewards = _online_rewards(records, spec)
    for o in online:
        o["reward_mean"] = online_rewards.get(o["version"])
    result = {
        "bench": "loop", "model": model_spec, "model_label": Path(model_spec).name or model_spec,
        "seed": config.seed,
        "minutes": config.minutes, "users": config.users, "rule": config.rule if config.team is None else "team",
        "user_threshold": config.threshold, "train_tasks": len(train),
        "team": config.team, "heldout_tasks": len(heldout), "draws": config.draws,
        "eval_temperature": temperature, "interval_level": LEVEL, "intervals_note": INTERVALS_NOTE,
        "versions": versions, "reference": reference, "threshold_tasks": config.threshold_tasks,
        "differences_last_vs_first": differences,
        "served_pairs": {str(v): g for v, g in pairs.items()}, "feedback_to_policy_s": to_policy,
        "goal": (None if not versions
                 else team_goal(versions[0], versions[-1], differences["accept_rate_shown"]) if config.team
                 else goal(versions[0], versions[-1], to_policy, differences["accepted_chars_per_request"],
                           differences[KEPT])),
        "online": online, "simulation": {k: sim_summary[k] for k in (
            "requests", "completed", "abandoned", "errors", "shown", "accepted", "feedback_sent", "feedback_errors",
            "latency_p50_ms", "latency_p95_ms", "ttft_p50_ms")},
        "engine": config.engine, "vllm_dtype": config.vllm_dtype if config.engine == "vllm" else None,
        "candidate_samples": config.candidate_samples,
        "trainer": {"batch_size": config.batch_size, "lr": config.lr, "lora_rank": config.lora_rank,
                    "exploration_temperature": config.exploration_temperature,
                    "max_staleness": config.max_staleness, "show_gate": settings.show_gate},
        "show_gate": None if not settings.show_gate else {
            "kept_by": settings.gate_kept_by, "keep_chars": settings.gate_keep_chars,
            "exploration": settings.gate_exploration, "min_decided": settings.gate_min_decided,
            "refit_every": settings.gate_refit_every, "window": settings.gate_window},
        "abandon_share": config.abandon_share,
        "episodes": outcomes, "updates": trained, "ignored_ttl_s": config.ignored_ttl_s,
        "ope_vs_canary": estimates,
        "release": {"save_every": config.save_every, "canary_share": config.canary_share,
                    "canary_min_episodes": config.canary_min_episodes, "promote_gate": config.promote_gate,
                    "gate_share": config.gate_share, "gate_min_episodes": config.gate_min_episodes},
        "versions_published": len(published), "gate_versions_promoted": len(gates_by_version(gate_records,
                                                                                              SIM_PROJECT)),
        "wall_s": round(time.monotonic() - started, 1),
        "files": {name: str(out_dir / name) for name in
                  ("loop.json", "loop.png", "table.md", "requests.jsonl", "heldout.jsonl", "system.log")},
    }
    (out_dir / "loop.json").write_text(json.dumps(result, indent=1))
    plot(result, out_dir / "loop.png")
    table = results_table(result)
    (out_dir / "table.md").write_text(table + "\n")
    say(f"bench loop: held-out figures\n{table}")
    return result


def tasks_and_user(config: LoopBenchConfig):
    """(train tasks, held-out tasks, the users' decision rule): the standard library's splits and
    ``UserModel(rule, threshold)``; for a team, its string-literal tasks in its quotes and its user."""
    if config.team is None:
        return (resolve_dataset("stdlib:train", seed=config.seed, limit=config.train_limit),
                resolve_dataset("stdlib:heldout", seed=config.seed, limit=config.heldout),
                UserModel(config.rule, config.threshold))
    return ([team_task(t, config.team) for t in quote_tasks("train", seed=config.seed, limit=config.train_limit)],
            [team_task(t, config.team) for t in quote_tasks("heldout", seed=config.seed, limit=config.heldout)],
            TeamUsers(config.threshold))


def served_temperature(settings, sim_config, config: LoopBenchConfig) -> float:
    """The temperature held-out draws are sampled at: ``eval_temperature`` if given, else what the door
    serves the simulated users' requests at (``serving.completions.sampling_temperature``)."""
    if config.eval_temperature is not None:
        return config.eval_temperature
    return sampling_temperature(sim_config.temperature, settings)


def evaluate_served(settings, model_spec: str, config: LoopBenchConfig, heldout, user_model, spec,
                    published: dict, pairs: dict[int, list[int]], gate_records: dict[int, dict],
                    temperature: float, say, train: Sequence = ()) -> tuple[list[dict], dict, list[dict], dict | None]:
    """(entries per served pair, the greedy always-show reference of version 0, every held-out row, the
    paired differences of every figure, last − first). Per weight version the draws are sampled once; no
    gate, then each gate version served with it, decide on them. The reference carries the confidence-threshold
    baseline (``reference["threshold_baseline"]``, its threshold chosen on ``train`` tasks), and every entry
    its paired difference with the reference (``vs_reference``)."""
    def sample(model, tokenizer, tasks, draws: int, temp: float, **kwargs):
        return sample_draws(model, tokenizer, tasks, draws=draws, temperature=temp, top_p=1.0,
                            max_new_tokens=config.max_tokens, batch_size=config.eval_batch_size,
                            max_prompt_tokens=settings.max_prompt_tokens, seed=config.seed, **kwargs)

    entries, rows_all, reference, served_by_entry, greedy = [], [], {}, [], []
    for version in versions_to_evaluate(versions_served(published, pairs), config.max_evals):
        t0 = time.monotonic()
        model, tokenizer, _ = load_policy(settings, str(version), model_spec=model_spec)
        if version == 0:
            # Greedy draws carry the model's own log-probabilities (temperature 1), what a confidence threshold
            # reads; the always-show reference does not look at them.
            greedy_draws = sample(model, tokenizer, heldout, 1, 0.0, gate_temperature=1.0)
            greedy = served_rows(heldout, greedy_draws, None, user_model, spec, explore=False)
            rows_all += [{"version": 0, "gate_version": None, "policy": "reference", **r} for r in greedy]
            reference = {"version": 0, "decoding": "greedy", "gate_version": None, **figures(greedy)}
            say("bench loop: reference (v0 greedy, always shown): " + ", ".join(
                f"{k} {reference[k]}" for k in ("n", *REPORTED)))
            if config.threshold_tasks and train:
                baseline, rows = threshold_baseline(
                    config, settings, train, greedy_draws, greedy, heldout, user_model, spec,
                    lambda tasks, v0=model: sample(v0, tokenizer, tasks, 1, 0.0, gate_temperature=1.0))
                rows_all += [{"version": 0, "gate_version": None, "policy": "reference_threshold", **r} for r in rows]
                reference["threshold_baseline"] = baseline
                say(f"bench loop: reference (v0 greedy, mean token probability ≥ {baseline['threshold']}, chosen on "
                    f"{baseline['train_tasks']} train tasks): "
                    + ", ".join(f"{k} {baseline[k]}" for k in ("n", *REPORTED)))
            if config.team is not None:
                baseline, rows = rule_baseline(config.team, heldout, greedy_draws, greedy, user_model, spec)
                rows_all += [{"version": 0, "gate_version": None, "policy": "reference_rule", **r} for r in rows]
                reference["rule_baseline"] = baseline
                say("bench loop: rule baseline (v0 greedy, quotes rewritten to the team's): "
                    + ", ".join(f"{k} {baseline[k]}" for k in ("n", *REPORTED)))
        # Line log-probabilities as the door gives its show-gate (at the exploration temperature, whatever the
        # draw's): greedy draws' own are all 0. Greedy draws of a task are all the same text: one is enough.
        draws = sample(model, tokenizer, heldout, 1 if temperature <= GREEDY_TEMPERATURE else config.draws,
                       temperature, gate_temperature=settings.default_temperature)
        chooser, samples = None, []
        if config.candidate_samples and temperature <= GREEDY_TEMPERATURE:  # the door's chooser, mirrored
            samples = sample(model, tokenizer, heldout, config.candidate_samples, settings.default_temperature,
                             gate_temperature=settings.default_temperature)
            draws, chooser = chosen_draws(settings, model, tokenizer, heldout, draws, samples)
        sampled_s = round(time.monotonic() - t0, 1)
        for gate_version in [None, *pairs.get(version, [])]:
            gate = None
            if gate_version is not None:
                if gate_version not in gate_records:
                    say(f"bench loop: gate v{gate_version} served with v{version} is not on the gates topic; skipped")
                    continue
                gate = Gate.from_record(gate_records[gate_version])
            served = served_rows(heldout, draws, gate, user_model, spec, explore=True, seed=config.seed)
            decided = served_rows(heldout, draws, gate, user_model, spec, explore=False, seed=config.seed)
            if version == 0 and gate is None and greedy:  # every draw shown: the ceiling chooses among them
                # With the chooser its candidates are the ceiling's (what it chose among), else greedy and the draws.
                sampled = served_rows(heldout, samples, None, user_model, spec, explore=False) if samples else []
                ceiling = oracle_rows(greedy, decided, sampled)
                rows_all += [{"version": 0, "gate_version": None, "policy": "reference_oracle", **r} for r in ceiling]
                candidates = 1 + (config.candidate_samples if samples else len({d.draw for d in draws}))
                reference["oracle"] = {"version": 0, "candidates": candidates, **figures(ceiling),
                                       "vs_reference": paired_figures(ceiling, greedy)}
                say(f"bench loop: ceiling (v0, the best of greedy and {candidates - 1} draws per task): "
                    + ", ".join(f"{k} {reference['oracle'][k]}" for k in ("n", *REPORTED)))
            rows_all += [{"version": version, "gate_version": gate_version, "policy": "served", **r} for r in served]
            if gate is not None:
                rows_all += [{"version": version, "gate_version": gate_version, "policy": "gate", **r}
                             for r in decided]
            entry = {"version": version, "gate_version": gate_version, **figures(served),
                     "vs_reference": paired_figures(served, greedy) if greedy else None,
                     "deterministic": {**figures(decided),
                                       "vs_reference": paired_figures(decided, greedy) if greedy else None},
                     "gate_threshold": None if gate is None else gate.threshold,
                     "published_s": published.get(version), "sampled_s": sampled_s, "chooser": chooser}
            entries.append(entry)
            served_by_entry.append(served)
            say(f"bench loop: v{version} gate {gate_version}: " + ", ".join(
                f"{k} {entry[k]}" for k in ("n", *REPORTED)))
        del model
    differences = paired_figures(served_by_entry[-1], served_by_entry[0]) if entries else None
    return entries, reference, rows_all, differences


def chosen_draws(settings, model, tokenizer, tasks: Sequence, greedy: Sequence, samples: Sequence
                 ) -> tuple[list, dict]:
    """(per task the draw the door's candidate chooser shows, what it did): each task's greedy draw and its
    samples, read with the task's suffix after what the editor shows of each by the door's own reading
    (``policy.models.read_continuations``, ``policy.value_model.posterior_pick``), greedy on ties. Tasks without
    a suffix are served greedily, as the door serves them."""
    candidates = [[d] for d in sorted(greedy, key=lambda d: d.task_index)]
    for d in samples:
        candidates[d.task_index].append(d)
    fmt = prompt_format(tokenizer)
    budget = min(settings.max_prompt_tokens,
                 getattr(tokenizer, "model_max_length", settings.max_prompt_tokens) or settings.max_prompt_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    picks = []
    for task, cands in zip(tasks, candidates):
        texts = [shown_text(d.completion, single_line=single_line_mode(task.prefix)) for d in cands]
        if not task.suffix:
            picks.append(0)
            continue
        distinct, cand_ids, continuations = candidate_continuations(texts, task.suffix, tokenizer)
        prompt = prompt_token_ids(tokenizer, task.fim_prompt(), budget, fmt)[0]
        logprobs = (read_continuations(model, None, prompt, continuations, pad)
                    if any(continuations) else [[] for _ in continuations])
        picks.append(posterior_pick(texts, distinct, cand_ids, logprobs))
    chosen = [replace(c[p], draw=0) for c, p in zip(candidates, picks)]
    return chosen, {"candidates": 1 + len(samples) // max(len(tasks), 1), "chose_a_sample": sum(1 for p in picks if p)}


def oracle_rows(*candidates: Sequence[dict]) -> list[dict]:
    """Per task, of its rows in ``candidates`` (each a list of decided rows; greedy's first), the one with the
    most accepted characters, the earliest on ties: what choosing among those completions could win at best,
    the ceiling a value model is measured against (issue 41, item 6). One row per task, in task order."""
    best: dict[int, dict] = {}
    for rows in candidates:
        for row in rows:
            kept = best.get(row["task_index"])
            if kept is None or row["accepted_chars"] > kept["accepted_chars"]:
                best[row["task_index"]] = row
    return [best[t] for t in sorted(best)]


def rule_baseline(team: str, heldout: Sequence, greedy_draws: Sequence, greedy_rows: Sequence[dict], user_model,
                  spec) -> tuple[dict, list[dict]]:
    """(the figures, the held-out rows) of the team loop's rule baseline: version 0's greedy completions with
    every quote rewritten to the team's (``trainer.proof.teams.quote_rule``), always shown: a habit a regex
    knows, which a learned team policy has to beat. Nothing is chosen: the rule has no parameter."""
    ruled = [replace(d, completion=quote_rule(d.completion, team), line=quote_rule(d.line, team))
             for d in greedy_draws]
    rows = served_rows(heldout, ruled, None, user_model, spec, explore=False)
    return {"version": 0, "decoding": "greedy", "gate_version": None, "rule": f"quotes rewritten to {TEAMS[team]}",
            **figures(rows), "vs_reference": paired_figures(rows, greedy_rows)}, rows


def threshold_baseline(config: LoopBenchConfig, settings, train: Sequence, greedy_draws: Sequence,
                       greedy_rows: Sequence[dict], heldout: Sequence, user_model, spec,
                       sample_greedy: Callable[[Sequence], Sequence]) -> tuple[dict, list[dict]]:
    """(the figures, the held-out rows) of the baseline "version 0 greedy, shown when its mean token probability
    reaches a threshold" (``trainer.proof.served.ConfidenceThreshold``). The threshold is chosen on greedy
    completions of up to ``config.threshold_tasks`` train-split tasks (a seeded sample), decided by the same
    user, by the show-gate's rule at ``TABLOOP_GATE_KEEP_CHARS`` (``choose_confidence_threshold``); the
    held-out tasks are only measured. ``greedy_draws``/``greedy_rows``: version 0's greedy held-out draws
    (with temperature-1 log-probabilities) and the always-show reference's rows on them."""
    picked = list(train)
    if len(picked) > config.threshold_tasks:
        picked = random.Random(f"{config.seed}:threshold").sample(picked, config.threshold_tasks)
    train_draws = sample_greedy(picked)
    train_rows = served_rows(picked, train_draws, None, user_model, spec, explore=False)
    threshold = choose_confidence_threshold(train_rows, train_draws, settings.gate_keep_chars)
    rule = ConfidenceThreshold(threshold)
    rows = served_rows(heldout, greedy_draws, rule, user_model, spec, explore=False)
    trained_on = figures(train_rows)
    baseline = {"version": 0, "decoding": "greedy", "gate_version": None, "rule": "mean token probability",
                "threshold": round(threshold, 6), "keep_chars": settings.gate_keep_chars,
                "train_tasks": len(picked), **figures(rows), "vs_reference": paired_figures(rows, greedy_rows),
                "train": {k: trained_on[k] for k in ("n", *REPORTED)}}
    return baseline, rows


def results_table(result: dict) -> str:
    """The held-out figures as a markdown table: the two plain-server baselines (version 0 greedy, always shown;
    the same under a confidence threshold), then every served pair; each figure with its interval clustered by
    task, and accepted and kept characters per request minus the greedy always-show reference's, paired by
    task. Entries without ``intervals_by_task`` (older results) show the figure alone."""

    def cell(entry: dict, key: str) -> str:
        value = entry.get(key)
        if value is None:
            return "–"
        low, high = (entry.get("intervals_by_task") or {}).get(key) or (None, None)
        return f"{value:.3f}" if low is None else f"{value:.3f} [{low:.3f}, {high:.3f}]"

    def delta(entry: dict, key: str) -> str:
        d = (entry.get("vs_reference") or {}).get(key) or {}
        if d.get("value") is None:
            return "–"
        if d.get("low") is None:
            return f"{d['value']:+.3f}"
        return f"{d['value']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"

    titles = {"accept_rate_shown": "accept rate among shown", "shown_share": "share shown",
              "accepted_chars_per_request": "accepted chars/req", KEPT: "kept chars/req", "reward_mean": "mean reward"}
    rows: list[tuple[str, dict]] = []
    reference = result.get("reference") or {}
    if reference:
        rows.append(("v0 greedy, always shown (reference)", reference))
        threshold = reference.get("threshold_baseline")
        if threshold:
            rows.append((f"v0 greedy, mean token prob ≥ {threshold['threshold']:.3g} (chosen on train)", threshold))
        rule = reference.get("rule_baseline")
        if rule:
            rows.append((f"v0 greedy, {rule['rule']} (the rule baseline)", rule))
        ceiling = reference.get("oracle")
        if ceiling:
            label = f"v0, best of {ceiling['candidates']} per task (the oracle: a ceiling, not a policy)"
            rows.append((label, ceiling))
    for v in result.get("versions", []):
        gate = "" if v.get("gate_version") is None else f" + gate v{v['gate_version']}"
        rows.append((f"v{v['version']}{gate}, served", v))
    head = (["policy", "n", *(titles[k] for k in REPORTED), "Δ accepted chars/req vs reference",
             "Δ kept chars/req vs reference"])
    lines = ["| " + " | ".join(head) + " |", "|---|" + "|".join("---:" for _ in head[1:]) + "|"]
    for label, entry in rows:
        cells = [label, str(entry.get("n", "–")), *(cell(entry, k) for k in REPORTED),
                 delta(entry, "accepted_chars_per_request"), delta(entry, KEPT)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"{INTERVALS_NOTE}; Δ: minus v0 greedy always-shown on the same tasks.")
    return "\n".join(lines)


def _wait_healthy(supervisor, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if supervisor.all_healthy():
            return
        crashing = [c for c in supervisor.children if c.restarts >= 3 and not c.healthy]
        if crashing:
            raise RuntimeError(f"{crashing[0].component.name} crashed {crashing[0].restarts} times before becoming "
                               f"healthy; the end of {log_path}:\n{log_tail(log_path)}")
        time.sleep(1)
    waiting = [c.component.name for c in supervisor.children if not c.healthy and c.state != "not installed"]
    raise RuntimeError(f"not healthy within {timeout_s:.0f}s: {', '.join(waiting)}; see {log_path}")


def _published(weight_records: Sequence[dict], base_model: str) -> dict[int, float]:
    """Trained versions of ``base_model`` that were promoted: version → when (epoch seconds)."""
    out = {}
    for version, record in _first_promotions(weight_records, base_model).items():
        at = record["created_at"]
        out[version] = at.timestamp() if hasattr(at, "timestamp") else at / 1000
    return out


def _online_rewards(records: Sequence[dict], spec) -> dict[int, float]:
    """Mean reward of the requests each version served (the users' outcomes; nothing shown: ignored)."""
    sums: dict[int, list[float]] = {}
    for r in records:
        if r["error"] is not None or r["policy_version"] is None:
            continue
        outcome = outcome_of(r["shown"], r["accepted"])
        sums.setdefault(r["policy_version"], []).append(acceptance_reward(spec, outcome))
    return {v: round(sum(xs) / len(xs), 4) for v, xs in sums.items()}


# -- the command ---------------------------------------------------------------------------------

QUICK = {"minutes": 2.0, "users": 2, "heldout": 16, "batch_size": 8, "batch_wait_s": 10.0, "threshold_tasks": 16}


@click.command("loop")
@click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=None,
              help="How long the simulated users work (default 15; --quick: 2).")
@click.option("--users", type=click.IntRange(min=1), default=None, help="Simulated users (default 4).")
@click.option("--model", default="demo", show_default=True,
              help="demo or smollm2 (built once in the configured state dir), or a model directory.")
@click.option("--heldout", type=click.IntRange(min=1), default=None,
              help="Held-out tasks evaluated at every version (default: all of the split; --quick: 16).")
@click.option("--draws", type=click.IntRange(min=1), default=2, show_default=True,
              help="Completions sampled per held-out task and weight version (the served policy samples).")
@click.option("--team", type=click.Choice(sorted(TEAMS)), default=None,
              help="The team loop: that team's users and tasks (trainer.proof.teams), LoRA updates, the "
                   "show-gate off; --threshold defaults to 0.3 there.")
@click.option("--train-limit", type=click.IntRange(min=1), default=None,
              help="Use at most this many train-split tasks (default: all).")
@click.option("--rule", type=click.Choice(["exact", "similarity"]), default="exact", show_default=True,
              help="When a simulated user accepts (online and on held-out tasks).")
@click.option("--threshold", type=click.FloatRange(0, 1), default=None,
              help="The users' similarity threshold (default 0.8; with --team 0.3, the teams bench's).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Episodes per policy update; each update is a version (default 16).")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=1e-4, show_default=True)
@click.option("--lora-rank", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--exploration-temperature", type=click.FloatRange(0, 2), default=None,
              help="Serve at this temperature instead of the users' 0.01.")
@click.option("--eval-temperature", type=click.FloatRange(0, 2), default=None,
              help="Held-out draws at this temperature (default: the one the door serves the users at; "
                   "0: greedy).")
@click.option("--threshold-tasks", type=click.IntRange(min=0), default=None,
              help="Train-split tasks the confidence-threshold baseline's threshold is chosen on (default 100; "
                   "--quick: 16; 0: no such baseline).")
@click.option("--max-evals", type=click.IntRange(min=2), default=None,
              help="Evaluate at most this many versions: 0, the last, and evenly spaced ones (default: all).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--abandon-share", type=click.FloatRange(0, 1, max_open=True), default=0.15, show_default=True,
              help="Share of requests a user types past and drops after the first chunk (no feedback: with "
                   "--ignored-ttl they become IGNORED episodes with reward 0).")
@click.option("--max-staleness", type=click.IntRange(min=0), default=16, show_default=True,
              help="The trainer drops episodes from policies this many versions older.")
@click.option("--ignored-ttl", type=click.FloatRange(min=0), default=15.0, show_default=True,
              help="Seconds after which a served completion with no feedback (an empty suggestion, never "
                   "shown) becomes an IGNORED episode with reward 0; 0: no IGNORED episodes.")
@click.option("--save-every", type=click.IntRange(min=1), default=1, show_default=True,
              help="Updates per published version.")
@click.option("--canary-share", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="> 0: each version goes out as a canary on this share of requests (TABLOOP_CANARY_SHARE).")
@click.option("--canary-min-episodes", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--promote-gate", type=click.Choice(["none", "ope", "shadow"]), default="none", show_default=True,
              help="TABLOOP_PROMOTE_GATE; with ope or shadow, loop.json compares each version's estimate "
                   "with what its canary measured (ope_vs_canary).")
@click.option("--gate-share", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.1,
              show_default=True, help="Share of episodes held out of training for the gate.")
@click.option("--gate-min-episodes", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--engine", type=click.Choice(["transformers", "vllm"]), default="transformers", show_default=True,
              help="The front door's engine; vllm: a vLLM replica the bench's supervisor starts (`tabloop vllm "
                   "install` first), every LoRA version hot-loaded into it.")
@click.option("--vllm-dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="--engine vllm: the replica's dtype (bfloat16: the train-inference gap the trainer reports).")
@click.option("--candidate-samples", type=click.IntRange(0, 8), default=0, show_default=True,
              help="TABLOOP_CANDIDATE_SAMPLES: the door shows the likeliest of greedy and this many samples once "
                   "it has read the suffix after each; the held-out evaluation mirrors it.")
@click.option("--quick", is_flag=True, help="A short smoke run (2 minutes, 2 users, 16 held-out tasks).")
@click.option("--keep-state", is_flag=True, help="Keep the bench's state dir (Kafka data, weights, logs).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench-loop", show_default=True,
              help="Where loop.json, loop.png and the recorded requests go.")
@click.pass_context
def bench_loop(ctx, minutes, users, model, heldout, draws, team, train_limit, rule, threshold, batch_size, lr,
               lora_rank, exploration_temperature, eval_temperature, threshold_tasks, max_evals, max_tokens,
               abandon_share, max_staleness, ignored_ttl, save_every, canary_share, canary_min_episodes, promote_gate,
               gate_share, gate_min_episodes, seed, engine, vllm_dtype, candidate_samples, quick, keep_state,
               out_dir) -> None:
    """The whole system (Kafka, front door, streams, trainer, history) with simulated users on the train
    split; every policy version evaluated on held-out tasks. Last line: JSON; also a PNG plot."""
    defaults = {"minutes": 15.0, "users": 4, "heldout": None, "batch_size": 16, "batch_wait_s": 20.0,
                "threshold_tasks": 100}
    if quick:
        defaults.update(QUICK)
    given = {"minutes": minutes, "users": users, "heldout": heldout, "batch_size": batch_size,
             "threshold_tasks": threshold_tasks}
    chosen = {k: (given.get(k) if given.get(k) is not None else v) for k, v in defaults.items()}
    try:
        if threshold is None:
            threshold = 0.3 if team else 0.8
        config = LoopBenchConfig(**chosen, model=model, train_limit=train_limit, rule=rule, threshold=threshold,
                                 draws=draws, team=team,
                                 lr=lr, lora_rank=lora_rank, exploration_temperature=exploration_temperature,
                                 eval_temperature=eval_temperature, max_evals=max_evals,
                                 max_tokens=max_tokens, seed=seed, keep_state=keep_state,
                                 abandon_share=abandon_share, max_staleness=max_staleness,
                                 ignored_ttl_s=ignored_ttl or None, save_every=save_every,
                                 canary_share=canary_share, canary_min_episodes=canary_min_episodes,
                                 promote_gate=promote_gate, gate_share=gate_share,
                                 gate_min_episodes=gate_min_episodes, engine=engine, vllm_dtype=vllm_dtype,
                                 candidate_samples=candidate_samples)
        result = run_loop_bench(ctx.find_root().obj, config, Path(out_dir))
    except (ValueError, RuntimeError, KafkaLaunchError, ModelLoadError) as exc:
        raise TabloopError(str(exc)) from None
    print(json.dumps(result))


@click.command("loop-seeds")
@click.argument("runs", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Also write seeds.json and seeds.md here.")
def bench_loop_seeds(runs, out_dir) -> None:
    """Several seeds of `bench loop` (their --out directories) read together against the plain server: per
    seed, and pooled with intervals that count a held-out file once (trainer/proof/seeds.py). Last line: JSON."""
    try:
        result = compare_seeds(read_runs([Path(r) for r in runs]))
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        raise TabloopError(f"could not read the runs: {exc}") from None
    table = seeds_table(result)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "seeds.json").write_text(json.dumps(result, indent=1))
        (Path(out_dir) / "seeds.md").write_text(table + "\n")
    click.echo(table, err=True)
    print(json.dumps(result))
