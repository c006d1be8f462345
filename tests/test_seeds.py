"""Several seeds of `bench loop` read together (``trainer.proof.seeds``): by hand on two small runs."""

from __future__ import annotations

import json
import math

import pytest

from trainer.proof.intervals import Z
from trainer.proof.seeds import compare_seeds, policy_rows, read_runs, seeds_table, source_file


def row(policy: str, version: int, task_index: int, task_id: str, chars: int, gate=None) -> dict:
    shown = "x" * chars if chars else "y"  # every request shows something; accepted when chars > 0
    return {"policy": policy, "version": version, "gate_version": gate, "task_index": task_index,
            "task_id": task_id, "shown": shown, "accepted": chars > 0, "accepted_chars": chars,
            "kept_chars": chars // 2, "reward": 0.75 if chars else -0.25}


def run(tasks: list[str], reference: list[int], v0: list[int], last: list[int], last_version: int) -> list[dict]:
    rows = []
    for policy, version, chars in (("reference", 0, reference), ("served", 0, v0), ("served", last_version, last)):
        rows += [row(policy, version, i, t, c) for i, (t, c) in enumerate(zip(tasks, chars))]
    return rows


SEED_1 = run(["a.py:1:1", "b.py:2:2"], reference=[0, 4], v0=[0, 4], last=[3, 4], last_version=2)
SEED_2 = run(["a.py:5:1", "c.py:1:1"], reference=[2, 0], v0=[2, 0], last=[2, 6], last_version=1)


def test_a_task_belongs_to_the_file_it_was_cut_from():
    assert source_file("http/server.py:936:17") == "http/server.py"
    assert source_file("HumanEval/12") == "HumanEval/12"  # not a file:line:column id: its own cluster


def test_the_last_served_policy_is_the_highest_version_with_its_last_gate():
    rows = SEED_1 + [row("served", 2, 0, "a.py:1:1", 9, gate=4), row("served", 2, 0, "a.py:1:1", 1, gate=7)]
    picked = policy_rows(rows)
    assert [r["accepted_chars"] for r in picked["last_served"]] == [1]  # v2 with gate 7, not 4 nor no gate
    assert [r["accepted_chars"] for r in picked["v0_served"]] == [0, 4]
    with pytest.raises(ValueError, match="no reference"):
        policy_rows([r for r in SEED_1 if r["policy"] != "reference"])


def test_seeds_pooled_by_file_by_hand():
    result = compare_seeds({"seed 1": SEED_1, "seed 2": SEED_2})
    # Per seed, paired by task: seed 1 (3+4)/2 − (0+4)/2 = 1.5; seed 2 (2+6)/2 − (2+0)/2 = 3.
    per = result["per_seed"]
    assert per["seed 1"]["vs_plain_server"]["last_served"]["accepted_chars_per_request"]["value"] == 1.5
    assert per["seed 2"]["vs_plain_server"]["last_served"]["accepted_chars_per_request"]["value"] == 3.0
    assert per["seed 1"]["last_version"] == 2 and per["seed 2"]["last_version"] == 1
    # Pooled, a file counts once: a.py holds a task of each seed. Plain server: a (0+2, 2 requests), b (4, 1),
    # c (0, 1): 6/4 = 1.5; last served: a (3+2), b 4, c 6: 15/4 = 3.75.
    pooled = result["pooled"]
    assert pooled["plain_server"]["accepted_chars_per_request"]["value"] == 1.5
    assert pooled["last_served"]["accepted_chars_per_request"]["value"] == 3.75
    assert pooled["last_served"]["accepted_chars_per_request"]["tasks"] == 3  # clusters: three files
    # Paired by file: u_f = (Y_after − 3.75·X)/X̄ − (Y_before − 1.5·X)/X̄ with X̄ = 4/3 on both sides.
    u = [((5 - 3.75 * 2) - (2 - 1.5 * 2)) * 0.75, ((4 - 3.75) - (4 - 1.5)) * 0.75, ((6 - 3.75) - (0 - 1.5)) * 0.75]
    se = math.sqrt(sum(v * v for v in u) / (3 * 2))
    diff = result["pooled_vs_plain_server"]["last_served"]["accepted_chars_per_request"]
    assert diff["value"] == 2.25 and diff["tasks"] == 3
    assert diff["low"] == pytest.approx(2.25 - Z * se, abs=1e-4) and diff["high"] == pytest.approx(2.25 + Z * se, abs=1e-4)
    assert result["same_side"]["last_served"]["accepted_chars_per_request"] is True
    # Version 0 as served is the plain server here: no difference, and "same side" does not hold for zero.
    assert result["pooled_vs_plain_server"]["v0_served"]["accepted_chars_per_request"]["value"] == 0.0
    assert result["same_side"]["v0_served"]["accepted_chars_per_request"] is False
    assert result["relative_to_plain_server"]["last_served"]["accepted_chars_per_request"] == 1.5  # 3.75/1.5 − 1
    # The accept rate among shown: plain 2/4 accepted of 4 shown; last 4/4.
    assert pooled["last_served"]["accept_rate_shown"]["value"] == 1.0
    assert result["relative_to_plain_server"]["last_served"]["accept_rate_shown"] == 1.0


def test_one_seed_on_the_other_side_breaks_same_side(tmp_path):
    worse = run(["a.py:5:1", "c.py:1:1"], reference=[2, 5], v0=[2, 5], last=[2, 0], last_version=1)
    result = compare_seeds({"seed 1": SEED_1, "seed 2": worse})
    assert result["per_seed"]["seed 2"]["vs_plain_server"]["last_served"]["accepted_chars_per_request"]["value"] < 0
    assert result["same_side"]["last_served"]["accepted_chars_per_request"] is False
    # Read from run directories as `bench loop --out` leaves them, named by their loop.json's seed.
    for seed, rows in ((1, SEED_1), (2, worse)):
        d = tmp_path / f"run{seed}"
        d.mkdir()
        (d / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "loop.json").write_text(json.dumps({"seed": seed}))
    runs = read_runs([tmp_path / "run1", tmp_path / "run2"])
    assert list(runs) == ["seed 1", "seed 2"] and compare_seeds(runs) == result
    table = seeds_table(result)
    assert "| pooled (2 seeds, 3 files) |" in table and "| seed 2 |" in table
    with pytest.raises(ValueError, match="does not exist"):
        read_runs([tmp_path / "missing"])
