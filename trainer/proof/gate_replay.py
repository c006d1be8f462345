"""The show-gate's online learner replayed on sampled draws of *train* tasks: which way of choosing the
threshold (``policy.show_gate.KEPT_BY``, ``keep``) makes gates that hide what users reject, judged on other
train tasks. Nothing here reads a held-out task: this is where the gate's rule may be chosen.

The train split is cut in two by a seeded shuffle. The first part is the traffic: its draws arrive one by one
at the door as the loop's users would send them; the serving gate (none at first) decides each line with its
exploration coin, the decided lines enter the learner's window, and the learner refits and judges each
candidate as ``trainer.show_gate_learner.GateLearner`` does (``replay_learner``: the same ``fit_gate`` and
``judge_candidate``, and its schedule ``fit_due``: a fit tried on every new line while no gate serves, then
one every ``refit_every``). The second part
judges every promoted gate on its own draws (``trainer.proof.served``: with exploration, as served, and the
gate's own decision), beside always-show on the same draws.

One model version throughout (the loop also refits after weight versions move the logprobs): this isolates
the gate's rule from the LM's learning.
"""

from __future__ import annotations

import functools
import json
import random
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from policy.show_gate import Decided, FitConfig, Gate, fit_gate, line_features
from rewards.spec import RewardSpec
from trainer.proof.evaluate import load_policy, sample_draws
from trainer.proof.served import figures, relative_change, served_rows
from trainer.proof.simulate import UserModel
from trainer.proof.tasks import resolve_dataset
from trainer.show_gate_learner import fit_due, judge_candidate


@dataclass(frozen=True)
class Line:
    """A draw's first line as the learner sees it once the user decided."""

    features: tuple[float, ...]
    accepted: bool
    accepted_chars: float
    line_chars: float


def lines_of(draws: Sequence, rows: Sequence[dict]) -> list[Line | None]:
    """Each draw as a Line (its always-show row from ``trainer.proof.served.served_rows`` with no gate), None
    where the line is empty and nothing is shown (no gate decides it)."""
    out: list[Line | None] = []
    for d, row in zip(draws, rows):
        if row["shown"] is None or not d.line.strip():
            out.append(None)
            continue
        out.append(Line(tuple(line_features(d.line, d.line_logprobs)), bool(row["accepted"]),
                        float(row["accepted_chars"]), float(len(row["shown"]))))
    return out


def replay_learner(lines: Sequence[Line | None], config: FitConfig, *, refit_every: int = 20,
                   window: int = 2000, seed: int = 0) -> list[dict]:
    """Every candidate the learner would fit on this traffic, in order: ``at`` (lines arrived), ``decided``
    (lines in the window), ``version``, ``threshold``, ``status``, ``reason``, ``metrics`` and ``gate``. A
    PROMOTED candidate serves the lines after it."""
    rng = random.Random(f"{seed}:replay")
    log: deque[Decided] = deque(maxlen=window)
    serving: Gate | None = None
    serving_version: int | None = None
    new, version = 0, 0
    fits: list[dict] = []
    for at, line in enumerate(lines, 1):
        if line is None:
            continue
        shown, p = (True, 1.0) if serving is None else serving.decide(serving.score(line.features), rng)
        if not shown:
            continue
        log.append(Decided(line.features, line.accepted, line.accepted_chars, p, line.line_chars))
        new += 1
        if not fit_due(len(log), new, serving=serving is not None, min_decided=config.min_decided,
                       refit_every=refit_every):
            continue
        new = 0
        fit = fit_gate(list(log), config, version=version + 1)
        if fit is None:
            continue
        version += 1
        metrics, status, reason = judge_candidate(list(log), fit, config, serving=serving,
                                                  serving_version=serving_version)
        fits.append({"at": at, "decided": len(log), "version": version, "threshold": fit.gate.threshold,
                     "status": status, "reason": reason, "metrics": metrics, "gate": fit.gate})
        if status == "PROMOTED":
            serving, serving_version = fit.gate, version
    return fits


def judge_gate(gate: Gate | None, tasks: Sequence, draws: Sequence, user, spec, *, seed: int = 0) -> dict:
    """A gate's figures on the judging draws: as served (exploration) and its own decision."""
    return {"served": figures(served_rows(tasks, draws, gate, user, spec, explore=True, seed=seed)),
            "decided": figures(served_rows(tasks, draws, gate, user, spec, explore=False, seed=seed))}


RULES = (("expected", 0.95), ("realised", 0.99))
"""The threshold rules replayed by default: the settings' default (chosen by this replay,
``docs/bench-loop/gate-replay/``) and the issue's first proposal."""


def traffic_order(lines: Sequence[Line | None], order: int, seed: int = 0) -> list[Line | None]:
    """The traffic in its ``order``-th arrival order: 0 as sampled, others a seeded shuffle. The same lines
    in another order ask how much of a rule's early behaviour (when its first gate is promoted, how much that
    gate hides) is the luck of which lines came first."""
    out = list(lines)
    if order:
        random.Random(f"{seed}:order:{order}").shuffle(out)
    return out


def relative_to(served: dict, always: dict) -> dict:
    """A gate's served figures as relative changes from always-show's on the same draws."""
    return {k: relative_change(served[k], always[k])
            for k in ("accept_rate_shown", "shown_share", "accepted_chars_per_request")}


def order_summary(order: int, fits: Sequence[dict], judge: Callable[[Gate], dict], always: dict) -> dict:
    """One arrival order's fits in brief: how many were tried before the first promotion, the decided lines
    it was fit on, and the first and the last promoted gate judged (``judge``) beside always-show."""
    promoted = [f for f in fits if f["status"] == "PROMOTED"]
    out: dict = {"order": order, "fits": len(fits), "promoted": len(promoted),
                 "tried_before_first": next((i for i, f in enumerate(fits) if f["status"] == "PROMOTED"), None)}
    for name, f in (("first", promoted[0] if promoted else None), ("last", promoted[-1] if promoted else None)):
        if f is None:
            out[name] = None
            continue
        served = judge(f["gate"])["served"]
        out[name] = {"version": f["version"], "at": f["at"], "lines_decided": f["decided"],
                     "threshold": round(f["threshold"], 4),
                     "relative": relative_to(served, always)}
    return out


def run_gate_replay(settings, model_spec: str, *, traffic: int, judging: int, draws: int = 1,
                    temperature: float = 0.7, max_tokens: int = 32, rule: str = "similarity",
                    threshold: float = 0.5, rules: Sequence[tuple[str, float]] = RULES,
                    min_decided: Sequence[int] = (), orders: int = 1, seed: int = 0,
                    say: Callable[[str], None] = print) -> dict:
    """Sample the draws, replay the learner under each rule (and each first-fit size in ``min_decided``; the
    settings' by default), judge its promoted gates; the result as JSON. Everything else is the learner's as
    ``settings`` configure it (exploration, refit interval, window, prompt length). With ``orders`` > 1 the
    same traffic is also replayed in other arrival orders (``traffic_order``), each summarised by
    ``order_summary``; every promoted gate of the sampled order is judged in full."""
    if orders < 1:
        raise ValueError(f"orders must be at least 1, not {orders}")
    started = time.monotonic()
    tasks = list(resolve_dataset("stdlib:train", seed=seed))
    random.Random(f"{seed}:gate-replay").shuffle(tasks)
    if traffic + judging > len(tasks):
        raise ValueError(f"{traffic} traffic + {judging} judging tasks, the train split has {len(tasks)}")
    traffic_tasks, judging_tasks = tasks[:traffic], tasks[traffic:traffic + judging]
    user, spec = UserModel(rule, threshold), RewardSpec()
    model, tokenizer, _ = load_policy(None, model_spec=model_spec)

    def sample(some, n, what):
        say(f"gate replay: sampling {len(some)} {what} tasks × {n} at T = {temperature}")
        total, done, shown_at = len(some) * n, [0], [time.monotonic()]

        def progress(k: int) -> None:
            done[0] += k
            if time.monotonic() - shown_at[0] >= 30 or done[0] == total:
                shown_at[0] = time.monotonic()
                say(f"gate replay: {done[0]}/{total} {what} draws")

        return sample_draws(model, tokenizer, some, draws=n, temperature=temperature, top_p=1.0,
                            max_new_tokens=max_tokens, max_prompt_tokens=settings.max_prompt_tokens, seed=seed,
                            progress=progress)

    traffic_draws = sample(traffic_tasks, 1, "traffic")
    traffic_lines = lines_of(traffic_draws, served_rows(traffic_tasks, traffic_draws, None, user, spec,
                                                        explore=False))
    judging_draws = sample(judging_tasks, draws, "judging")
    always = judge_gate(None, judging_tasks, judging_draws, user, spec, seed=seed)["served"]

    @functools.cache  # the sampled order's first and last gates are judged for its summary too
    def judge(gate: Gate) -> dict:
        return judge_gate(gate, judging_tasks, judging_draws, user, spec, seed=seed)

    result = {"bench": "gate-replay", "model": model_spec, "split": "stdlib:train", "traffic_tasks": traffic,
              "judging_tasks": judging, "judging_draws": draws, "temperature": temperature,
              "user": {"rule": rule, "threshold": threshold}, "orders": orders,
              "refit_every": settings.gate_refit_every, "always_show": always, "rules": []}
    for kept_by, keep in rules:
        for first_fit in min_decided or (settings.gate_min_decided,):
            config = replace(FitConfig.from_settings(settings), kept_by=kept_by, keep=keep, min_decided=first_fit)
            name = f"{kept_by} {keep} (first fit at {first_fit})"
            fits = replay_learner(traffic_lines, config, refit_every=settings.gate_refit_every,
                                  window=settings.gate_window, seed=seed)
            judged = []
            for f in fits:
                if f["status"] != "PROMOTED":
                    continue
                figs = judge(f["gate"])
                s = figs["served"]
                judged.append({"version": f["version"], "at": f["at"], "lines_decided": f["decided"],
                               "threshold": round(f["threshold"], 4), **figs,
                               "relative": relative_to(s, always)})
                say(f"gate replay: {name}: v{f['version']} after {f['at']} lines, threshold "
                    f"{f['threshold']:.3f}: accept {s['accept_rate_shown']} shown {s['shown_share']} "
                    f"chars {s['accepted_chars_per_request']} ({judged[-1]['relative']})")
            by_order = [order_summary(0, fits, judge, always)]
            for order in range(1, orders):
                order_fits = replay_learner(traffic_order(traffic_lines, order, seed), config,
                                            refit_every=settings.gate_refit_every, window=settings.gate_window,
                                            seed=seed + order)
                by_order.append(order_summary(order, order_fits, judge, always))
                first = by_order[-1]["first"]
                say(f"gate replay: {name}, order {order}: " + (
                    f"first promoted after {by_order[-1]['tried_before_first']} rolled back, on "
                    f"{first['lines_decided']} lines: {first['relative']}" if first else
                    f"no gate promoted in {by_order[-1]['fits']} fits"))
            result["rules"].append({"kept_by": kept_by, "keep": keep, "min_decided": first_fit,
                                    "promoted": len(judged), "gates": judged, "orders": by_order,
                                    "fits": [{k: f[k] for k in ("at", "decided", "version", "threshold", "status",
                                                                "reason")} for f in fits]})
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def write_result(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gate-replay.json").write_text(json.dumps(result, indent=1))
