"""How far two completions agree, and choosing among a request's candidates by how well each agrees with the
others (minimum Bayes risk).

Issue 41, item 2. The front door can draw greedy plus a few samples per request. The samples are draws from
the policy's own distribution over what follows the cursor, so they stand in for the truth the user will hold
each candidate against: a candidate's *expected* worth to the user is its mean worth with each other candidate
taken as the truth (minimum Bayes risk decoding, with the samples as pseudo-references). Unlike the posterior
(``policy.value_model.posterior_choice``) this needs no second pass of the model, and unlike a majority vote it
credits partial agreement: two samples that share a long start of the line back that start.

What a candidate is worth against a stand-in truth is a ``utility(candidate, reference)``:

* ``kept_utility``: the characters the user would keep, the common prefix (the bench's kept characters);
* ``similar_chars_utility``: the characters weighed by how similar the two are (edit similarity × length),
  which a user who takes near-right lines rewards.

Everything here is pure; ``choose`` (greedy on ties, never a candidate that shows nothing) makes the pick.

Measured by ``tabloop bench candidates`` on train tasks under the loop's user (docs/bench-loop/consensus/): the
consensus does not beat greedy there (the samples seldom agree on the right line when greedy is wrong), so the
front door does not offer it; it serves the posterior. The bench keeps it as a measured baseline.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

from policy.value_model import choose

Utility = Callable[[str, str], float]


def common_prefix_length(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` share from their start: what a user keeps of an accepted ``a`` when
    the true code is ``b`` (``trainer.proof.simulate.kept_characters``).

    >>> common_prefix_length("foo(a, b)", "foo(a)"), common_prefix_length("x", "")
    (5, 0)
    """
    return len(os.path.commonprefix([a, b]))


def kept_utility(candidate: str, reference: str) -> float:
    """The characters of ``candidate`` a user whose true code is ``reference`` keeps: their common prefix."""
    return float(common_prefix_length(candidate, reference))


def levenshtein(a: str, b: str) -> int:
    """Edits (insert, delete, substitute one character) that turn ``a`` into ``b``.

    >>> levenshtein("kitten", "sitting"), levenshtein("", "ab")
    (3, 2)
    """
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def edit_similarity(a: str, b: str) -> float:
    """1 − levenshtein(a, b) / max(len(a), len(b)); two empty texts are identical (1.0)."""
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else 1.0 - levenshtein(a, b) / longest


def similar_chars_utility(candidate: str, reference: str) -> float:
    """``candidate``'s characters weighed by its edit similarity to ``reference``.

    >>> similar_chars_utility("abcd", "abce")  # one edit in four: 0.75 × 4
    3.0
    """
    return edit_similarity(candidate, reference) * len(candidate)


def consensus_values(texts: Sequence[str | None], utility: Utility = kept_utility) -> list[float]:
    """Each candidate's mean ``utility`` with every *other* candidate of the request as the truth (one that
    shows nothing stands for the truth "": the policy's own mass on showing nothing); 0 for a candidate that
    shows nothing, and for every candidate when there is no other to compare with.

    A candidate is not its own reference: counted against itself, any text, however unlikely, would score
    its whole length.

    >>> consensus_values(["ab", "ab", "xy"])  # "ab": (2 + 0) / 2; "xy": (0 + 0) / 2
    [1.0, 1.0, 0.0]
    >>> consensus_values(["abc", None, "abd"])  # "abc": (0 + 2) / 2
    [1.0, 0.0, 1.0]
    """
    if len(texts) < 2:
        return [0.0] * len(texts)
    values = []
    for i, text in enumerate(texts):
        if text is None:
            values.append(0.0)
            continue
        others = [other or "" for j, other in enumerate(texts) if j != i]
        values.append(sum(utility(text, other) for other in others) / len(others))
    return values


def consensus_choice(texts: Sequence[str | None], utility: Utility = kept_utility, *, default: int = 0
                     ) -> int | None:
    """The candidate with the highest ``consensus_values``, ``default`` (greedy) on ties; None when none shows
    anything.

    >>> consensus_choice(["foo(a)", "foo(a, b)", "foo(a, c)", "bar"])  # "foo(a, " is backed by two others
    1
    >>> consensus_choice(["x", "y"])  # no agreement at all: greedy
    0
    """
    return choose(consensus_values(texts, utility), texts, default=default)
