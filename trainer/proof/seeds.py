"""Several seeds of `tabloop bench loop`, read together against the plain server (issue 41, item 6).

Each run's ``heldout.jsonl`` holds every held-out request of the policies it evaluated (``policy``: "reference"
for version 0 greedy always shown, "served" for each weight version as users got it, …). A seed moves the
held-out tasks' cursor positions (``build_source_tasks(seed=…)``), so the seeds evaluate different tasks cut
from the **same held-out files**: they are not independent of each other, and an interval that treated the
three seeds' tasks as 3 × 158 independent units would be too narrow. Here the unit is the source file: every
request of every seed is summed into its file's cluster, and the clustered and paired intervals of
``trainer.proof.intervals`` are taken over files (a file counts once, whatever the seeds cut from it). Within
one seed, the bench's own intervals (by task) stay what each run says.

What is compared (``compare_seeds``): per seed and pooled, the plain server (version 0 greedy, always shown),
version 0 as served and the last served policy (the last weight version evaluated, with the last show-gate
version served with it, or none), each figure with its interval, and each served policy minus the plain
server paired by file; ``same_side``: whether every seed's point estimate of a difference has the pooled one's
sign. Pure: rows in, figures out (checked by hand in tests/test_seeds.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

from trainer.proof.intervals import INTERVALS_NOTE, LEVEL, clustered_interval, paired_interval, task_sums
from trainer.proof.served import RATIOS, figures_by_task, paired_figures, relative_change

CLUSTER = "source_file"
POLICIES = ("plain_server", "v0_served", "last_served")
"""What each seed is read for: version 0 greedy always shown, version 0 as served, the last policy served."""


def source_file(task_id: str) -> str:
    """The held-out file a task was cut from: its id without the cursor's ``:line:column``."""
    parts = task_id.rsplit(":", 2)
    return parts[0] if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() else task_id


def policy_rows(rows: Sequence[dict]) -> dict[str, list[dict]]:
    """A run's held-out rows by ``POLICIES``: "reference" rows; "served" rows of version 0 without a gate; and
    "served" rows of the highest version, of the last gate version evaluated with it (None first)."""
    served = [r for r in rows if r.get("policy") == "served"]
    if not served or not any(r.get("policy") == "reference" for r in rows):
        raise ValueError("the run has no reference or no served rows (is it a bench loop heldout.jsonl?)")
    last = max(r["version"] for r in served)
    gates = [r["gate_version"] for r in served if r["version"] == last]
    last_gate = max((g for g in gates if g is not None), default=None)
    return {"plain_server": [r for r in rows if r.get("policy") == "reference"],
            "v0_served": [r for r in served if r["version"] == 0 and r["gate_version"] is None],
            "last_served": [r for r in served if r["version"] == last and r["gate_version"] == last_gate]}


def pooled_figures(rows: Sequence[dict]) -> dict[str, dict]:
    """Every figure of ``RATIOS`` over ``rows`` (of several seeds), its interval clustered by source file."""
    return {name: clustered_interval(list(task_sums(rows, y, x, key=CLUSTER).values()), rate=rate)
            for name, (y, x, rate) in RATIOS.items()}


def pooled_differences(after: Sequence[dict], before: Sequence[dict]) -> dict[str, dict]:
    """``after`` − ``before`` of every figure, paired by source file over the files both hold."""
    return {name: paired_interval(task_sums(after, y, x, key=CLUSTER), task_sums(before, y, x, key=CLUSTER))
            for name, (y, x, _) in RATIOS.items()}


def compare_seeds(runs: Mapping[str, Sequence[dict]]) -> dict:
    """``runs``: seed name → that run's held-out rows. Per seed: each policy's figures (point values), and each
    served policy minus the plain server paired by task (the run's own unit); pooled over the seeds: figures
    clustered by source file, differences paired by file, the relative change of each figure, and
    ``same_side`` (every seed's difference has the pooled difference's sign, zero counting as neither)."""
    if not runs:
        raise ValueError("no runs to compare")
    per_seed, pooled_rows = {}, {p: [] for p in POLICIES}
    for seed, rows in runs.items():
        by_policy = policy_rows(rows)
        figures = {p: {name: d["value"] for name, d in figures_by_task(rs).items()} | {"n": len(rs)}
                   for p, rs in by_policy.items()}
        per_seed[seed] = {"figures": figures,
                          "vs_plain_server": {p: paired_figures(by_policy[p], by_policy["plain_server"])
                                              for p in POLICIES[1:]},
                          "last_version": max(r["version"] for r in by_policy["last_served"])}
        for p, rs in by_policy.items():
            pooled_rows[p] += [{**r, CLUSTER: source_file(r["task_id"]), "seed": seed} for r in rs]
    pooled = {p: pooled_figures(rs) for p, rs in pooled_rows.items()}
    differences = {p: pooled_differences(pooled_rows[p], pooled_rows["plain_server"]) for p in POLICIES[1:]}
    same_side = {p: {name: _same_side(d["value"], [s["vs_plain_server"][p][name]["value"] for s in per_seed.values()])
                     for name, d in differences[p].items()} for p in POLICIES[1:]}
    relative = {p: {name: relative_change(pooled[p][name]["value"], pooled["plain_server"][name]["value"])
                    for name in RATIOS} for p in POLICIES[1:]}
    return {"seeds": list(runs), "files": len({r[CLUSTER] for r in pooled_rows["plain_server"]}),
            "requests": {p: len(rs) for p, rs in pooled_rows.items()}, "per_seed": per_seed, "pooled": pooled,
            "pooled_vs_plain_server": differences, "relative_to_plain_server": relative, "same_side": same_side,
            "interval_level": LEVEL,
            "intervals_note": INTERVALS_NOTE.replace("by task", "by source file, over the seeds")}


def _same_side(pooled: float | None, each: Sequence[float | None]) -> bool | None:
    if pooled is None or any(v is None for v in each):
        return None
    sign = (pooled > 0) - (pooled < 0)
    return sign != 0 and all(((v > 0) - (v < 0)) == sign for v in each)


def read_runs(dirs: Sequence[Path]) -> dict[str, list[dict]]:
    """Each run directory's ``heldout.jsonl``, named by the seed its ``loop.json`` says (else the directory)."""
    runs = {}
    for d in dirs:
        path = Path(d) / "heldout.jsonl"
        if not path.is_file():
            raise ValueError(f"{path} does not exist: pass the --out directories of bench loop runs")
        name = Path(d).name
        meta = Path(d) / "loop.json"
        if meta.is_file():
            name = f"seed {json.loads(meta.read_text()).get('seed', name)}"
        if name in runs:
            raise ValueError(f"two runs named {name!r}: pass each seed's run once")
        runs[name] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return runs


def seeds_table(result: dict) -> str:
    """Per seed and pooled: the plain server's and the last served policy's accepted and kept characters per
    request and accept rate among shown, and the last served minus the plain server."""
    head = ("| run | plain server: accept rate among shown | accepted chars/req | last served (version): accept "
            "rate among shown | accepted chars/req | kept chars/req | Δ accepted chars/req vs plain server | "
            "Δ kept chars/req | v0 as served: Δ accepted chars/req |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def interval(d: dict) -> str:
        if d["value"] is None:
            return "–"
        return f"{d['value']:+.3f}" + ("" if d["low"] is None else f" [{d['low']:+.3f}, {d['high']:+.3f}]")

    def value(v) -> str:
        return "–" if v is None else f"{v:.3f}"

    for seed, s in result["per_seed"].items():
        f, d = s["figures"], s["vs_plain_server"]
        lines.append(f"| {seed} | {value(f['plain_server']['accept_rate_shown'])} | "
                     f"{value(f['plain_server']['accepted_chars_per_request'])} | "
                     f"{value(f['last_served']['accept_rate_shown'])} (v{s['last_version']}) | "
                     f"{value(f['last_served']['accepted_chars_per_request'])} | "
                     f"{value(f['last_served']['kept_chars_per_request'])} | "
                     f"{interval(d['last_served']['accepted_chars_per_request'])} | "
                     f"{interval(d['last_served']['kept_chars_per_request'])} | "
                     f"{interval(d['v0_served']['accepted_chars_per_request'])} |")
    p, d = result["pooled"], result["pooled_vs_plain_server"]
    seeds = len(result["seeds"])
    lines.append(f"| pooled ({seeds} seed{'s' if seeds != 1 else ''}, {result['files']} files) | "
                 f"{value(p['plain_server']['accept_rate_shown']['value'])} | "
                 f"{value(p['plain_server']['accepted_chars_per_request']['value'])} | "
                 f"{value(p['last_served']['accept_rate_shown']['value'])} | "
                 f"{value(p['last_served']['accepted_chars_per_request']['value'])} | "
                 f"{value(p['last_served']['kept_chars_per_request']['value'])} | "
                 f"{interval(d['last_served']['accepted_chars_per_request'])} | "
                 f"{interval(d['last_served']['kept_chars_per_request'])} | "
                 f"{interval(d['v0_served']['accepted_chars_per_request'])} |")
    return "\n".join(lines) + f"\n\nPer seed: differences paired by task. Pooled: {result['intervals_note']}."
