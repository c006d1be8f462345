"""Completion metrics, against numbers worked by hand."""

from __future__ import annotations

import pytest

from policy.agreement import levenshtein
from trainer.metrics import Scored, edit_similarity, exact_match, is_empty, line_match, markdown_table, summarize


@pytest.mark.parametrize("a,b,d", [("", "", 0), ("abc", "", 3), ("kitten", "sitting", 3), ("flaw", "lawn", 2),
                                   ("same", "same", 0), ("ab", "ba", 2)])
def test_levenshtein(a, b, d):
    assert levenshtein(a, b) == levenshtein(b, a) == d


def test_edit_similarity():
    assert edit_similarity("", "") == 1.0
    assert edit_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert edit_similarity("abc", "") == 0.0
    assert edit_similarity("x = 1", "x = 2") == pytest.approx(0.8)


def test_matches_and_empty():
    assert exact_match("foo(x)  \n", "foo(x)") and not exact_match(" foo(x)", "foo(x)")
    assert line_match("a + b\nprint(1)", "a + b") and not line_match("a + c", "a + b")
    assert not line_match("", "\nfoo"), "an empty true line is no reason to accept"
    assert is_empty(" \n\t") and not is_empty(" x")


def test_summarize_by_hand():
    scored = [
        Scored("t1", "a + b", "a + b", passed=True, judge=8.0),
        Scored("t2", "a + c\nmore", "a + b", passed=False, judge=None, judge_error="timeout"),
        Scored("t3", "", "return x", passed=False, judge=2.0),
        Scored("t4", "y", "x", solutions=("x", "y")),
    ]
    one_line = Scored("t5", "a + b", "a + b\nreturn a", single_line=True)
    assert one_line.exact and one_line.similarity == 1.0
    assert not Scored("t6", "a + b", "a + b\nreturn a").exact
    s = summarize(scored)
    assert s["n"] == 4
    assert s["exact_match"] == 0.5  # t1, and t4 by its second solution
    assert s["line_match"] == 0.25  # t1 only (t4's reference line is "x")
    # t1: 1; t2: "a + c\nmore" vs "a + b" = 1 - 6/10 (one change, five more characters); t3: 0; t4: 0
    assert s["edit_similarity"] == pytest.approx((1 + 0.4 + 0 + 0) / 4, abs=1e-4)
    assert s["empty_share"] == 0.25
    assert s["pass_at_1"] == pytest.approx(1 / 3, abs=1e-4) and s["n_tested"] == 3
    assert s["judge_score"] == 5.0 and s["n_judged"] == 2 and s["judge_errors"] == 1
    empty = summarize([])
    assert empty["n"] == 0 and empty["exact_match"] is None


def test_markdown_table():
    table = markdown_table([("before", {"n": 2, "exact_match": 0.5, "pass_at_1": None})])
    head, rule, row = table.splitlines()
    assert head.startswith("| run | n | exact") and rule.startswith("|---|")
    assert row == "| before | 2 | 0.500 | – | – | – | – | – |"
    # The simulated user's figures get their columns only where a summary has them.
    user = markdown_table([("a", {"n": 4}), ("b", {"n": 4, "shown_share": 0.75, "accept_rate_shown": 0.5})])
    head, _, a, b = user.splitlines()
    assert head.endswith("| shown | accepted/shown | acc. chars/req | reward |")
    assert a.endswith("| – | – | – | – |") and b.endswith("| 0.750 | 0.500 | – | – |")
