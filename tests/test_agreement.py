"""Choosing a candidate by its agreement with the others (policy.agreement), against figures worked by hand."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

import policy.agreement as agreement
from policy.agreement import (consensus_choice, consensus_values, edit_similarity, kept_utility,
                              similar_chars_utility)
from policy.value_model import Read

# The true rest of the line is "foo(a, b)"; greedy stops early, two samples go on (one right, one a letter
# off), one sample is elsewhere.
TEXTS = ["foo(a)", "foo(a, b)", "foo(a, c)", "bar"]


def test_the_module_examples_hold():
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    tests = finder.find(agreement)
    assert sum(len(t.examples) for t in tests) >= 7
    for test in tests:
        assert runner.run(test).failed == 0, test.name


def test_expected_kept_characters_by_hand():
    # Common prefixes. greedy: "foo(a" with each foo sample (5, 5), nothing with "bar": 10/3.
    # "foo(a, b)": 5 with greedy, "foo(a, " (7) with "foo(a, c)", 0: 12/3 = 4; "foo(a, c)" alike; "bar": 0.
    assert consensus_values(TEXTS, kept_utility) == pytest.approx([10 / 3, 4.0, 4.0, 0.0])
    assert consensus_choice(TEXTS, kept_utility) == 1  # a tie between the two samples: the first


def test_expected_similar_characters_by_hand():
    # Levenshtein "foo(a)" → "foo(a, b)": 3 inserts, similarity 1 − 3/9; "foo(a, b)" → "foo(a, c)": 1, 8/9;
    # "foo(a)" → "bar": 5 (of 6); "foo(a, b)" → "bar": 8 (of 9).
    assert edit_similarity("foo(a)", "foo(a, b)") == pytest.approx(6 / 9)
    greedy = (6 / 9 * 6 + 6 / 9 * 6 + 1 / 6 * 6) / 3  # 4 + 4 + 1
    sample = (6 / 9 * 9 + 8 / 9 * 9 + 1 / 9 * 9) / 3  # 6 + 8 + 1
    bar = (1 / 6 * 3 + 1 / 9 * 3 + 1 / 9 * 3) / 3
    assert consensus_values(TEXTS, similar_chars_utility) == pytest.approx([greedy, sample, sample, bar])
    assert consensus_choice(TEXTS, similar_chars_utility) == 1


def test_greedy_keeps_ties_and_nothing_shown_is_never_chosen():
    assert consensus_choice(["x", "y", "z"]) == 0  # nobody agrees with anybody: all 0, greedy
    assert consensus_choice(["ab", "ab", "ab"]) == 0  # all agree: a tie, greedy
    # Greedy shows nothing: it cannot be chosen, and stands for "" as a reference (agrees with nobody).
    assert consensus_values([None, "ab", "ac"]) == [0.0, 0.5, 0.5]
    assert consensus_choice([None, "ab", "ac"]) == 1
    assert consensus_choice([None, None]) is None
    assert consensus_values(["only"]) == [0.0] and consensus_choice(["only"]) == 0


def test_the_bench_measures_the_consensus_choosers_under_the_similarity_user():
    # One task whose true rest of the line is "foo(a, b)", the similarity user at 0.5: greedy's "foo(a)"
    # (similarity 6/9) is taken for 6 characters; the consensus choosers show "foo(a, b)", taken for 9.
    from rewards.spec import RewardSpec
    from tabloop.candidates_bench import build_requests, measure_choosers, parameter_free_choosers, rule_utility
    from trainer.proof.simulate import UserModel
    from trainer.proof.tasks import FimTask

    tasks = [FimTask("t0", "x = ", "\nreturn x\n", "foo(a, b)")]
    reads = [[Read((-0.1,), (-0.5,), np.zeros(2), np.zeros(2)) for _ in TEXTS]]
    user, spec = UserModel("similarity", 0.5), RewardSpec()
    requests = build_requests(tasks, [TEXTS], reads, user, spec)
    assert requests[0]["accepted_chars"] == [6, 9, 9, 0]
    # Knowing the rule: greedy is taken against either foo sample (6 each), not against "bar": 12/3 = 4;
    # "foo(a, b)" against greedy (6/9) and "foo(a, c)" (8/9): 9 + 9 + 0, 6.
    assert consensus_values(TEXTS, rule_utility(user)) == pytest.approx([4.0, 6.0, 6.0, 0.0])
    measured = measure_choosers(parameter_free_choosers(3, 0.7, user), requests, tasks, user, spec)
    assert measured["greedy, always shown"]["accepted_chars_per_request"] == pytest.approx(6.0)
    for name in ("consensus: expected kept chars", "consensus: expected similar chars",
                 "consensus: expected accepted chars, knowing the user's rule"):
        assert measured[name]["accepted_chars_per_request"] == pytest.approx(9.0), name
        assert measured[name]["vs_greedy"]["accepted_chars_per_request"]["value"] == pytest.approx(3.0), name
        assert measured[name]["chose_other_than_greedy"] == 1, name


def test_the_tests_rule_has_no_line_to_compare():
    from trainer.proof.simulate import UserModel

    with pytest.raises(ValueError, match="tests rule"):
        UserModel("tests").takes_line("x", "x")
