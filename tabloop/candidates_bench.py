"""``tabloop bench candidates``: choosing among a request's candidates, measured on *train* tasks only.

Issue 41, item 2. Per task: greedy plus ``samples`` draws at ``temperature`` (``trainer.proof.evaluate
.sample_draws``, as every bench samples), each shown as Continue shows it and decided by the simulated user
(``trainer.proof.simulate.decision_rows``, ``UserModel`` — exact by default); then every distinct candidate
read once more by the policy as prompt + candidate + the suffix's first tokens (``policy.value_model
.score_candidates``). The tasks are ``--tasks`` of the ``stdlib:train`` split (the loop bench's train tasks:
``resolve_dataset("stdlib:train", seed)``, no context files), a seeded sample, cut by source file into a
*fit* half and a *validation* half (``split_by_file``): every learned chooser is fit on the fit half (its
hidden-state projection and any show threshold too) and every figure reported is the validation half's.
Nothing reads ``stdlib:heldout`` but ``--heldout`` (``run_heldout_choosers``): every held-out task read once by
the choosers that fit nothing, so nothing is chosen on them.

The choosers (``CHOOSERS``): greedy always shown (a plain server), the first sample always shown (sampling
at the exploration temperature), the oracle best of the candidates (the ceiling), a majority vote, the
suffix's likelihood after the candidate, the posterior log p(candidate, suffix | prompt), the consensus
choosers (each candidate against the others as stand-ins for the truth, ``policy.agreement``), and logistic
heads (``policy.value_model``) on the logprob figures alone (what the issue found does not beat greedy), on
every figure, and on every figure plus the policy's hidden state (at the candidate's end, or after the
suffix) projected on its top principal components; that head and the logprob one also with a show
threshold on P(accept) × characters (the show-gate's rule: the highest that keeps ``TABLOOP_GATE_KEEP_CHARS``
of the accepted characters on the fit half's cross-fitted choices). Each with its figures clustered by task and
its paired-by-task difference from greedy (``trainer.proof.served``). Last line: one JSON object.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import time
from pathlib import Path
from typing import Callable, Sequence

import click
import numpy as np

from infra.errors import TabloopError
from policy.fim import prompt_format, prompt_token_ids
from policy.agreement import consensus_choice, kept_utility, similar_chars_utility
from policy.models import use_torch_threads
from policy.shown import first_line
from policy.show_gate import choose_threshold
from policy.value_model import (BASE_FEATURES, ValueModel, choose, expected_chars, fit_projection, fit_value_model,
                                request_features, score_candidates)
from rewards.spec import RewardSpec
from tabloop.loop_bench import resolve_model
from trainer.build_models import build_named_model
from trainer.proof.evaluate import load_policy, sample_draws
from trainer.proof.intervals import INTERVALS_NOTE
from trainer.proof.served import figures, paired_figures
from trainer.proof.simulate import UserModel, decision_rows
from trainer.proof.tasks import resolve_dataset

REPORTED = ("accept_rate_shown", "shown_share", "accepted_chars_per_request", "kept_chars_per_request")
LOGPROB_COLUMNS = tuple(BASE_FEATURES.index(n) for n in ("cand_mean_logprob", "cand_min_logprob", "cand_sum_logprob",
                                                         "log_chars", "agreement", "same_as_greedy"))
"""The logprob-only head: the candidate's own figures and the agreement, no suffix, no hidden state (the
issue's chooser that did not beat greedy)."""


def split_by_file(tasks: Sequence, seed: int = 0) -> list[str]:
    """"fit" or "validation" for each task, by a hash of its source file: the tasks of one file are on one
    side, so a chooser is never validated on a file it was fit on; adding a file moves no other."""
    out = []
    for t in tasks:
        digest = hashlib.sha256(f"{seed}:value-split:{t.filepath or t.task_id}".encode()).digest()
        out.append("fit" if digest[0] % 2 == 0 else "validation")
    return out


def file_folds(tasks: Sequence, folds: int, seed: int = 0) -> list[int]:
    """A fold per task for cross-fitting on the fit half, by source file like ``split_by_file``."""
    return [int.from_bytes(hashlib.sha256(f"{seed}:value-fold:{t.filepath or t.task_id}".encode()).digest()[:4],
                           "big") % folds for t in tasks]


# -- the choosers (pure, over one request's candidates) ------------------------------------------------

def oracle(req: dict) -> int | None:
    """The candidate with the most accepted characters (greedy on ties): the ceiling."""
    return choose([float(c) for c in req["accepted_chars"]], req["texts"])


def majority(req: dict) -> int | None:
    """The text most candidates agree on (greedy on ties)."""
    texts = req["texts"]
    return choose([float(sum(1 for u in texts if u == t)) for t in texts], texts)


def by_column(name: str) -> Callable[[dict], int | None]:
    """The candidate highest on one feature (greedy on ties)."""
    col = BASE_FEATURES.index(name)
    return lambda req: choose(list(req["base"][:, col]), req["texts"])


def head_values(model, req: dict, hidden: str | None) -> list[float]:
    x = model.features(req["base"], req[hidden] if hidden else None)
    return expected_chars(model.accept_probability(x), req["texts"])


def fit_head(requests: Sequence[dict], *, columns: Sequence[int] = (), hidden: str | None = None, pca: int = 8,
             l2: float = 1.0):
    """A logistic head on the requests' distinct shown candidates (a duplicate adds nothing the agreement
    feature does not say), with the hidden-state projection fit on the same candidates."""
    base, hid, y = [], [], []
    for req in requests:
        seen = set()
        for i, t in enumerate(req["texts"]):
            if t is None or t in seen:
                continue
            seen.add(t)
            base.append(req["base"][i])
            y.append(bool(req["accepted"][i]))
            if hidden:
                hid.append(req[hidden][i])
    base = np.asarray(base)
    projection = fit_projection(np.asarray(hid), pca) if hidden else None
    shell = ValueModel(coef=np.zeros(0), intercept=0.0, mean=np.zeros(0), scale=np.ones(0), columns=tuple(columns),
                       projection=projection)
    x = shell.features(base, np.asarray(hid) if hidden else None)
    return fit_value_model(x, y, l2=l2, columns=columns, projection=projection)


def cross_fitted_threshold(requests: Sequence[dict], folds: Sequence[int], keep: float, *, hidden: str | None,
                           pca: int, l2: float, columns: Sequence[int] = ()) -> float:
    """The show threshold on P × chars chosen on the fit half's requests by the show-gate's rule
    (``policy.show_gate.choose_threshold``: the highest keeping ``keep`` of the accepted characters), each
    request's chosen candidate valued by a head fit without its fold (in-sample values flatter the head)."""
    values, gains = [], []
    for k in sorted(set(folds)):
        train = [r for r, f in zip(requests, folds) if f != k]
        held = [r for r, f in zip(requests, folds) if f == k]
        if not train or not held:
            continue
        head = fit_head(train, columns=columns, hidden=hidden, pca=pca, l2=l2)
        for req in held:
            v = head_values(head, req, hidden)
            pick = choose(v, req["texts"])
            if pick is None:
                continue
            values.append(v[pick])
            gains.append(float(req["accepted_chars"][pick]))
    return choose_threshold(values, gains, [1.0] * len(values), keep=keep) if values else 0.0


# -- the measurement -------------------------------------------------------------------------------

def sample_candidates(settings, model, tokenizer, tasks: Sequence, *, samples: int, temperature: float,
                      max_tokens: int, seed: int, batch_size: int, say) -> tuple[list[list[str]], dict]:
    """Each task's completions: greedy first, then the samples; and the seconds each pass took."""
    def progress_of(what: str, total: int):
        done, shown_at = [0], [time.monotonic()]

        def progress(k: int) -> None:
            done[0] += k
            if time.monotonic() - shown_at[0] >= 30 or done[0] == total:
                shown_at[0] = time.monotonic()
                say(f"bench candidates: {done[0]}/{total} {what}")
        return progress

    common = dict(top_p=1.0, max_new_tokens=max_tokens, max_prompt_tokens=settings.max_prompt_tokens, seed=seed,
                  batch_size=batch_size, gate_temperature=1.0)
    t0 = time.monotonic()
    greedy = sample_draws(model, tokenizer, tasks, draws=1, temperature=0.0, progress=progress_of("greedy", len(tasks)),
                          **common)
    t1 = time.monotonic()
    sampled = sample_draws(model, tokenizer, tasks, draws=samples, temperature=temperature,
                           progress=progress_of("samples", len(tasks) * samples), **common) if samples else []
    t2 = time.monotonic()
    out = [[d.completion] for d in greedy]
    for d in sampled:
        out[d.task_index].append(d.completion)
    return out, {"greedy_s": round(t1 - t0, 1), "samples_s": round(t2 - t1, 1)}


def read_candidates(settings, model, tokenizer, tasks: Sequence, texts: Sequence[Sequence[str | None]], say) -> list:
    """Each task's candidates read by ``score_candidates`` (distinct texts once; nothing shown reads as ""), the
    prompt rendered and trimmed as the front door does; ``say``: progress every 30 s. The bench's reading,
    with the hidden states its learned heads read; the door reads with ``policy.models.read_continuations``."""
    fmt = prompt_format(tokenizer)
    budget = min(settings.max_prompt_tokens,
                 getattr(tokenizer, "model_max_length", settings.max_prompt_tokens) or settings.max_prompt_tokens)
    out, shown_at = [], time.monotonic()
    for n, (task, cands) in enumerate(zip(tasks, texts), 1):
        prompt_ids = prompt_token_ids(tokenizer, task.fim_prompt(), budget, fmt)[0]
        distinct = list(dict.fromkeys(t or "" for t in cands))
        reads = dict(zip(distinct, score_candidates(model, tokenizer, prompt_ids, distinct, task.suffix)))
        out.append([reads[t or ""] for t in cands])
        if time.monotonic() - shown_at >= 30 or n == len(tasks):
            shown_at = time.monotonic()
            say(f"read {n}/{len(tasks)} tasks' candidates")
    return out


def build_requests(tasks: Sequence, completions: Sequence[Sequence[str]], reads: Sequence[Sequence], user, spec
                   ) -> list[dict]:
    """Per task: its candidates' shown texts, the user's decision on each, and their features."""
    requests = []
    for i, (task, cands, rs) in enumerate(zip(tasks, completions, reads)):
        rows = decision_rows([task] * len(cands), list(cands), user, spec)
        texts = [r["shown"] for r in rows]
        requests.append({"task_index": i, "task_id": task.task_id, "texts": texts, "rows": rows,
                         "accepted": [bool(r["accepted"]) for r in rows],
                         "accepted_chars": [r["accepted_chars"] for r in rows],
                         "base": request_features(texts, rs),
                         "hidden_end": np.stack([r.hidden_end for r in rs]),
                         "hidden_suffix": np.stack([r.hidden_suffix for r in rs])})
    return requests


def chosen_rows(requests: Sequence[dict], picks: Sequence[int | None], tasks: Sequence, user, spec) -> list[dict]:
    """The decision row of each request's chosen candidate (nothing shown when None), tagged by task."""
    out = []
    for req, pick in zip(requests, picks):
        if pick is None:
            row = dict(decision_rows([tasks[req["task_index"]]], [""], user, spec)[0])
        else:
            row = dict(req["rows"][pick])
        row.update(task_index=req["task_index"], candidate=pick)
        out.append(row)
    return out


def sampled_requests(settings, model_spec: str, picked: Sequence, described: str, *, samples: int,
                     temperature: float, max_tokens: int, rule: str, threshold: float, seed: int, batch_size: int,
                     cache: Path | None, say) -> tuple[list[dict], dict, UserModel, RewardSpec]:
    """Sample every task's candidates and read them (the slow part, kept in ``cache`` when given and read back
    from it when it was made with the same settings), then each task's request (``build_requests``) as the
    simulated user (``rule``, ``threshold``) decides them; ``described``: the tasks, for the first line said."""
    user, spec = UserModel(rule, threshold), RewardSpec()
    say(f"bench candidates: {described}, greedy + {samples} at T {temperature}, {max_tokens} new tokens")
    key = {"model": model_spec, "tasks": [t.task_id for t in picked], "samples": samples, "temperature": temperature,
           "max_tokens": max_tokens, "seed": seed, "max_prompt_tokens": settings.max_prompt_tokens}
    cached = None
    if cache is not None and cache.is_file():
        cached = pickle.loads(cache.read_bytes())
        if cached.get("key") != key:
            say(f"bench candidates: {cache} was made with other settings; sampling again")
            cached = None

    def keep(state: dict) -> None:
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_bytes(pickle.dumps(state))

    model = tokenizer = None
    if cached is None or "reads" not in cached:
        model, tokenizer, _ = load_policy(settings, None, model_spec=model_spec)
    if cached is None:
        completions, timing = sample_candidates(settings, model, tokenizer, picked, samples=samples,
                                                temperature=temperature, max_tokens=max_tokens, seed=seed,
                                                batch_size=batch_size, say=say)
        cached = {"key": key, "completions": completions, "timing": timing}
        keep(cached)  # the samples are the slow part: kept before the reads
    if "reads" not in cached:
        shown = [[r["shown"] for r in decision_rows([t] * len(c), list(c), user, spec)]
                 for t, c in zip(picked, cached["completions"])]
        t0 = time.monotonic()
        cached["reads"] = read_candidates(settings, model, tokenizer, picked, shown, say)
        cached["timing"].update(read_s=round(time.monotonic() - t0, 1),
                                distinct_read=sum(len(set(t or "" for t in s)) for s in shown))
        keep(cached)
    completions, reads, timing = cached["completions"], cached["reads"], cached["timing"]
    return build_requests(picked, completions, reads, user, spec), timing, user, spec


def rule_utility(user: UserModel) -> Callable[[str, str], float]:
    """What a candidate is worth to ``user`` if the reference were the truth: its characters when the user's
    rule takes its first line against the reference's, else nothing (the consensus chooser that knows the
    simulated user's rule: how much knowing it is worth, not a chooser a real team could serve)."""
    return lambda candidate, reference: float(len(candidate)) if user.takes_line(candidate, first_line(reference)) \
        else 0.0


def parameter_free_choosers(samples: int, temperature: float, user: UserModel
                            ) -> dict[str, Callable[[dict], int | None]]:
    """The choosers that fit nothing: a plain server (greedy), sampling, the ceiling, the ones that read
    only the request (agreement, the suffix's likelihood, the posterior), and the consensus choosers (each
    candidate against the others as stand-ins for the truth, ``policy.agreement``)."""
    return {
        "greedy, always shown": lambda req: 0 if req["texts"][0] is not None else None,
        f"first sample at T {temperature}, always shown": lambda req: (1 if len(req["texts"]) > 1
                                                                        and req["texts"][1] is not None else None),
        f"oracle best of {samples + 1}": oracle,
        "majority vote": majority,
        "(a) suffix likelihood after candidate": by_column("suffix_mean_logprob"),
        "posterior: log p(candidate) + log p(suffix after it)": by_column("posterior_gap"),
        "consensus: expected kept chars": lambda req: consensus_choice(req["texts"], kept_utility),
        "consensus: expected similar chars": lambda req: consensus_choice(req["texts"], similar_chars_utility),
        "consensus: expected accepted chars, knowing the user's rule": (
            lambda req: consensus_choice(req["texts"], rule_utility(user))),
    }


def measure_choosers(choosers: dict, requests: Sequence[dict], tasks: Sequence, user, spec) -> dict:
    """Each chooser's figures on ``requests`` (clustered by task), its difference from greedy's (paired by
    task), how often it showed another text than greedy's and how often nothing."""
    rows = {name: chosen_rows(requests, [c(r) for r in requests], tasks, user, spec) for name, c in choosers.items()}
    base = rows["greedy, always shown"]
    return {name: {**figures(r), "vs_greedy": paired_figures(r, base),
                   "chose_other_than_greedy": sum(1 for x, q in zip(r, requests) if x["candidate"] is not None
                                                  and q["texts"][x["candidate"]] != q["texts"][0]),
                   "hidden": sum(1 for x in r if x["candidate"] is None)}
            for name, r in rows.items()}


def run_heldout_choosers(settings, model_spec: str, *, samples: int = 4, temperature: float = 0.7,
                         max_tokens: int = 32, rule: str = "exact", threshold: float = 0.8, batch_size: int = 16,
                         seed: int = 0, cache: Path | None = None, say: Callable[[str], None] = print) -> dict:
    """Every ``stdlib:heldout`` task, read once, by the choosers that fit nothing (``parameter_free_choosers``):
    nothing is fit or chosen on held-out tasks, so what they measure there is what a user would get. The
    learned heads are left out (they fit on train tasks; this run samples none)."""
    started = time.monotonic()
    picked = list(resolve_dataset("stdlib:heldout", seed=seed))
    requests, timing, user, spec = sampled_requests(
        settings, model_spec, picked, f"all {len(picked)} held-out tasks, read once by the parameter-free choosers",
        samples=samples, temperature=temperature, max_tokens=max_tokens, rule=rule, threshold=threshold, seed=seed,
        batch_size=batch_size, cache=cache, say=say)
    return {"bench": "candidates", "model": model_spec, "split": "stdlib:heldout", "seed": seed,
            "tasks": len(picked), "samples": samples, "temperature": temperature, "max_tokens": max_tokens,
            "max_prompt_tokens": settings.max_prompt_tokens, "user": {"rule": rule, "threshold": threshold},
            "heldout": measure_choosers(parameter_free_choosers(samples, temperature, user), requests, picked, user,
                                        spec),
            "timing": timing, "wall_s": round(time.monotonic() - started, 1)}


def run_candidates_bench(settings, model_spec: str, *, tasks: int = 200, samples: int = 4, temperature: float = 0.7,
                         max_tokens: int = 32, rule: str = "exact", threshold: float = 0.8, pca: int = 8,
                         l2: float = 1.0, folds: int = 5, batch_size: int = 16, seed: int = 0,
                         cache: Path | None = None, say: Callable[[str], None] = print) -> dict:
    """Sample, read, fit on the fit half, report on the validation half (module docstring). ``cache``: a file
    the sampled candidates and their reads are kept in, and read back from when it is there (choosers can be
    re-run without resampling; delete it to resample)."""
    started = time.monotonic()
    every = list(resolve_dataset("stdlib:train", seed=seed))
    picked = random.Random(f"{seed}:candidates").sample(every, min(tasks, len(every)))
    halves = split_by_file(picked, seed)
    described = f"{len(picked)} train tasks ({halves.count('fit')} fit, {halves.count('validation')} validation)"
    requests, timing, user, spec = sampled_requests(
        settings, model_spec, picked, described, samples=samples, temperature=temperature, max_tokens=max_tokens,
        rule=rule, threshold=threshold, seed=seed, batch_size=batch_size, cache=cache, say=say)
    fit = [r for r, h in zip(requests, halves) if h == "fit"]
    val = [r for r, h in zip(requests, halves) if h == "validation"]
    fit_folds = file_folds([picked[r["task_index"]] for r in fit], folds, seed)

    heads = {
        "logprob head (no suffix, no hidden)": dict(columns=LOGPROB_COLUMNS, hidden=None),
        "value head: all figures": dict(hidden=None),
        "value head: all figures + hidden at candidate end (PCA)": dict(hidden="hidden_end"),
        "value head: all figures + hidden after suffix (PCA)": dict(hidden="hidden_suffix"),
    }
    fitted = {name: fit_head(fit, pca=pca, l2=l2, **kw) for name, kw in heads.items()}
    gated = {  # the heads that also decide whether to show: the full one, and the logprob one to compare
        "(c) value head + hidden": ("value head: all figures + hidden at candidate end (PCA)",
                                    {"hidden": "hidden_end"}),
        "(c') logprob head": ("logprob head (no suffix, no hidden)", {"columns": LOGPROB_COLUMNS, "hidden": None}),
    }
    thresholds = {label: cross_fitted_threshold(fit, fit_folds, settings.gate_keep_chars, pca=pca, l2=l2, **kw)
                  for label, (_, kw) in gated.items()}

    choosers = parameter_free_choosers(samples, temperature, user)
    for name, kw in heads.items():
        choosers[name] = (lambda m, h: lambda req: choose(head_values(m, req, h), req["texts"]))(
            fitted[name], kw.get("hidden"))
    for label, (name, kw) in gated.items():
        choosers[f"{label}, shown when P×chars ≥ {thresholds[label]:.3g}"] = (
            lambda m, h, t: lambda req: choose(head_values(m, req, h), req["texts"], threshold=t))(
            fitted[name], kw.get("hidden"), thresholds[label])

    def measure(reqs):
        return measure_choosers(choosers, reqs, picked, user, spec)

    validation = measure(val)
    result = {
        "bench": "candidates", "model": model_spec, "split": "stdlib:train", "seed": seed,
        "tasks": len(picked), "fit_tasks": len(fit), "validation_tasks": len(val),
        "fit_files": len({picked[r["task_index"]].filepath for r in fit}),
        "validation_files": len({picked[r["task_index"]].filepath for r in val}),
        "samples": samples, "temperature": temperature, "max_tokens": max_tokens,
        "max_prompt_tokens": settings.max_prompt_tokens, "user": {"rule": rule, "threshold": threshold},
        "pca": pca, "l2": l2, "folds": folds, "keep_chars": settings.gate_keep_chars,
        "show_thresholds": {label: round(t, 6) for label, t in thresholds.items()}, "features": list(BASE_FEATURES),
        "heads": {name: {"coef": [round(float(c), 4) for c in m.coef], "intercept": round(m.intercept, 4),
                         "columns": [BASE_FEATURES[c] for c in m.columns] if m.columns else list(BASE_FEATURES),
                         "hidden": heads[name].get("hidden")} for name, m in fitted.items()},
        "validation": validation,
        "fit_in_sample": {name: {k: v[k] for k in ("n", *REPORTED)} for name, v in measure(fit).items()},
        "timing": timing, "wall_s": round(time.monotonic() - started, 1),
    }
    return result


def results_table(result: dict) -> str:
    """The validation half's figures (or, for a held-out run, the held-out tasks') as markdown: each chooser's
    figures with their interval clustered by task, and accepted and kept characters per request minus greedy's,
    paired by task."""
    measured = "heldout" if "heldout" in result else "validation"
    def cell(entry, key):
        value, (low, high) = entry.get(key), (entry.get("intervals_by_task") or {}).get(key) or (None, None)
        if value is None:
            return "–"
        return f"{value:.3f}" if low is None else f"{value:.3f} [{low:.3f}, {high:.3f}]"

    def delta(entry, key):
        d = entry["vs_greedy"][key]
        if d.get("value") is None:
            return "–"
        if d.get("low") is None:
            return f"{d['value']:+.3f}"
        return f"{d['value']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"

    tasks = 'all held-out tasks' if measured == 'heldout' else 'validation half'
    head = [f"chooser ({tasks})", "n", "accept rate among shown", "share shown", "accepted chars/req", "kept chars/req",
            "Δ accepted chars/req vs greedy", "Δ kept chars/req vs greedy", "≠ greedy"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "|".join("---:" for _ in head[1:]) + "|"]
    for name, e in result[measured].items():
        lines.append("| " + " | ".join([name, str(e["n"]), *(cell(e, k) for k in REPORTED),
                                        delta(e, "accepted_chars_per_request"), delta(e, "kept_chars_per_request"),
                                        str(e["chose_other_than_greedy"])]) + " |")
    lines.append("")
    lines.append(f"{INTERVALS_NOTE}; Δ: minus greedy always shown on the same tasks; ≠ greedy: requests where the "
                 "chooser showed another text than greedy's.")
    return "\n".join(lines)


def write_result(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "candidates.json").write_text(json.dumps(result, indent=1))
    (out_dir / "table.md").write_text(results_table(result) + "\n")


@click.command("candidates")
@click.option("--model", default=None,
              help="demo, smollm2, a model directory or a hub id (default: TABLOOP_MODEL).")
@click.option("--tasks", type=click.IntRange(min=8), default=200, show_default=True,
              help="Train-split tasks (a seeded sample), cut by file into fit and validation halves.")
@click.option("--samples", type=click.IntRange(min=0), default=4, show_default=True,
              help="Sampled candidates per task beside greedy.")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=0.7, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--rule", type=click.Choice(["exact", "similarity"]), default="exact", show_default=True)
@click.option("--threshold", type=click.FloatRange(0, 1), default=0.8, show_default=True)
@click.option("--pca", type=click.IntRange(min=0), default=8, show_default=True,
              help="Principal components of the hidden state the heads read.")
@click.option("--l2", type=click.FloatRange(min=0), default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench-candidates", show_default=True)
@click.option("--cache", type=click.Path(dir_okay=False), default=None,
              help="Keep the sampled candidates and their reads here, and reuse them when present.")
@click.option("--heldout", "on_heldout", is_flag=True,
              help="Instead: every stdlib:heldout task, read once, by the choosers that fit nothing (no head is "
                   "fit, nothing is chosen on them); --tasks, --pca and --l2 do not apply.")
@click.pass_context
def bench_candidates(ctx, model, tasks, samples, temperature, max_tokens, rule, threshold, pca, l2, seed, out_dir,
                     cache, on_heldout) -> None:
    """Choosing among greedy and sampled candidates by reading the suffix (policy/value_model.py), fit and
    measured on train tasks only, split by file; with --heldout, the choosers that fit nothing on every held-out
    task, read once. Last line: JSON."""
    settings = ctx.find_root().obj
    use_torch_threads(settings.torch_threads)
    model_spec = resolve_model(settings, model) if model else build_named_model(settings)
    say = lambda m: click.echo(m, err=True)  # noqa: E731
    common = dict(samples=samples, temperature=temperature, max_tokens=max_tokens, rule=rule, threshold=threshold,
                  seed=seed, cache=Path(cache) if cache else None, say=say)
    try:
        if on_heldout:
            result = run_heldout_choosers(settings, model_spec, **common)
        else:
            result = run_candidates_bench(settings, model_spec, tasks=tasks, pca=pca, l2=l2, **common)
    except ValueError as exc:
        raise TabloopError(str(exc)) from None
    write_result(result, Path(out_dir))
    if on_heldout:
        say("bench candidates: all held-out tasks\n" + results_table(result))
        print(json.dumps({"bench": "candidates", "split": result["split"], "tasks": result["tasks"],
                          "heldout": {name: {k: e[k] for k in ("n", *REPORTED)}
                                      | {"accepted_chars_vs_greedy": e["vs_greedy"]["accepted_chars_per_request"]}
                                      for name, e in result["heldout"].items()}, "wall_s": result["wall_s"]}))
        return
    say("bench candidates: validation half\n" + results_table(result))
    print(json.dumps({"bench": "candidates", "tasks": result["tasks"],
                      "validation_tasks": result["validation_tasks"],
                      "validation": {name: {k: e[k] for k in ("n", *REPORTED)}
                                     | {"accepted_chars_vs_greedy": e["vs_greedy"]["accepted_chars_per_request"]}
                                     for name, e in result["validation"].items()},
                      "show_thresholds": result["show_thresholds"], "wall_s": result["wall_s"]}))

