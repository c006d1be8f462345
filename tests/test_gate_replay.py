"""The show-gate learner replayed offline (trainer/proof/gate_replay.py): the same refit schedule and the same
decisions as the online learner, on lines whose truth is known."""

from __future__ import annotations

import numpy as np

from policy.show_gate import FitConfig
from tests.test_show_gate import simulated_traffic
from trainer.proof.gate_replay import Line, replay_learner


def known_lines(n: int, seed: int = 3) -> list[Line | None]:
    rng = np.random.default_rng(seed)
    X, p_true, chars = simulated_traffic(rng, n)
    accepted = rng.random(n) < p_true
    lines: list[Line | None] = [Line(tuple(float(v) for v in x), bool(a), float(c) if a else 0.0, float(c))
                                for x, a, c in zip(X, accepted, chars)]
    lines[10] = None  # an empty line: nothing shown, nothing decided
    return lines


def test_the_replay_fits_first_at_min_decided_then_every_refit_and_serves_what_it_promotes():
    lines = known_lines(1200)
    config = FitConfig(min_decided=50)
    fits = replay_learner(lines, config, refit_every=20, seed=1)
    # The first fit comes with the 50th decided line: line 51, as line 11 was empty.
    assert fits[0]["at"] == 51 and fits[0]["decided"] == 50 and fits[0]["version"] == 1
    # Then one every 20 newly decided lines (the window of 2000 never fills here).
    assert all(b["decided"] - a["decided"] == 20 for a, b in zip(fits, fits[1:]))
    promoted = [f for f in fits if f["status"] == "PROMOTED"]
    assert promoted and promoted[0]["threshold"] > 0
    # A promoted gate hides lines: the lines after it arrive faster than they are decided.
    first = promoted[0]
    after = [f for f in fits if f["version"] > first["version"]]
    assert after and after[-1]["at"] - first["at"] > after[-1]["decided"] - first["decided"]
    # What it explored below the threshold is weighted by 1 / ε: the weights are no longer all 1.
    assert after[-1]["metrics"]["ess"] < after[-1]["decided"]
    # Every decision is the one `trainer.show_gate_learner.promotion` gave, its reason with it.
    assert all(f["status"] in ("PROMOTED", "ROLLED_BACK") and f["reason"] for f in fits)


def test_the_replay_is_the_same_for_the_same_seed_and_explores_differently_for_another():
    lines = known_lines(800)
    a = replay_learner(lines, FitConfig(), seed=1)
    b = replay_learner(lines, FitConfig(), seed=1)
    c = replay_learner(lines, FitConfig(), seed=2)
    assert [(f["at"], f["threshold"]) for f in a] == [(f["at"], f["threshold"]) for f in b]
    assert [f["at"] for f in a] != [f["at"] for f in c]


def test_other_arrival_orders_are_seeded_permutations_of_the_same_traffic():
    from trainer.proof.gate_replay import traffic_order

    lines = known_lines(300)
    assert traffic_order(lines, 0) == lines
    shuffled = traffic_order(lines, 1)
    assert shuffled != lines and sorted(map(id, shuffled)) == sorted(map(id, lines))
    assert traffic_order(lines, 1) == shuffled and traffic_order(lines, 2) != shuffled
    assert traffic_order(lines, 1, seed=5) != shuffled


def test_an_order_summary_counts_the_rolled_back_fits_before_the_first_promotion_and_judges_first_and_last():
    from trainer.proof.gate_replay import order_summary

    fits = replay_learner(known_lines(900), FitConfig(min_decided=50), refit_every=20, seed=1)
    promoted = [f for f in fits if f["status"] == "PROMOTED"]
    # Fake the first fit's decision so that one candidate is rolled back before the first promotion.
    fits[0] = {**fits[0], "status": "ROLLED_BACK"}
    judged = []

    def judge(gate):  # figures that tell the gates apart: the threshold as the accept rate
        judged.append(gate)
        return {"served": {"accept_rate_shown": 0.2 + gate.threshold, "shown_share": 0.5,
                           "accepted_chars_per_request": 2.0}}

    always = {"accept_rate_shown": 0.2, "shown_share": 1.0, "accepted_chars_per_request": 2.0}
    s = order_summary(3, fits, judge, always)
    first = next(f for f in fits if f["status"] == "PROMOTED")
    assert s["order"] == 3 and s["fits"] == len(fits) and s["tried_before_first"] == fits.index(first) >= 1
    assert s["first"]["version"] == first["version"] and s["last"]["version"] == promoted[-1]["version"]
    assert judged == [first["gate"], promoted[-1]["gate"]]
    assert s["first"]["relative"]["shown_share"] == -0.5
    assert s["first"]["relative"]["accept_rate_shown"] == round(first["threshold"] / 0.2, 4)
    nothing = order_summary(0, [{**f, "status": "ROLLED_BACK"} for f in fits], judge, always)
    assert nothing["first"] is None and nothing["tried_before_first"] is None
