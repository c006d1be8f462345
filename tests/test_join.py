"""The join's rules on small hand-made streams."""

import hashlib
import random
from datetime import datetime, timezone

import pytest

from policy.fim import build_fim_prompt
from streams.join import JoinConfig, JoinPipeline
from rewards.spec import RewardSpec, RewardSpecs

T0 = 1_800_000_000_000


def at(ms: int) -> datetime:
    return datetime.fromtimestamp((T0 + ms) / 1000, timezone.utc)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def completion(cid: str, ms: int, text: str = "return x\n", prompt: str = "p", user: str = "u",
               aborted: bool = False) -> dict:
    return {"aborted": aborted, "completion_id": cid, "served_at": at(ms), "project_id": "acme", "user_id": user,
            "prompt": prompt, "prompt_sha256": sha(prompt), "completion_text": text, "completion_token_ids": [1, 2, 3],
            "completion_logprobs": [-0.1, -0.2, -0.3], "policy_version": 4, "temperature": 0.7, "top_p": 0.95,
            "prompt_token_ids": [7, 8, 9]}


def feedback(ms: int, outcome: str = "ACCEPTED", *, cid=None, shown="return x", prompt: str | None = "p",
             client_id=None, cache_hit=False, accepted_chars=None, user="u", eid=None) -> dict:
    return {"event_id": eid or f"fb-{ms}-{outcome}-{client_id}", "received_at": at(ms), "project_id": "acme",
            "user_id": user, "completion_id": cid, "client_completion_id": client_id, "prompt": prompt,
            "prompt_sha256": sha(prompt) if prompt is not None else None, "completion": shown,
            "outcome": outcome, "accepted_chars": accepted_chars, "cache_hit": cache_hit}


def run(events, config=JoinConfig(), specs=RewardSpecs()):
    pipe = JoinPipeline(specs, config)
    out = []
    for kind, rec in events:
        out += pipe.completion(rec) if kind == "c" else pipe.feedback(rec)
        out += pipe.tick()
    return out, pipe.counts


def test_by_our_id_and_reward():
    eps, counts = run([("c", completion("c1", 0)), ("f", feedback(500, cid="c1", shown=None, prompt=None))])
    [ep] = eps
    r = ep.record
    assert (r["completion_id"], r["outcome"], r["reward"], r["matched"], r["policy_version"]) == \
        ("c1", "ACCEPTED", 0.75, True, 4)
    assert r["completion_token_ids"] == [1, 2, 3] and r["behaviour_logprobs"] == [-0.1, -0.2, -0.3]
    assert r["reward_components"] == {"acceptance": 0.75}
    # What the trainer needs to recompute the behaviour distribution: the ids fed, the sampler's T and p.
    assert (r["prompt_token_ids"], r["temperature"], r["top_p"]) == ([7, 8, 9], 0.7, 0.95)


def test_the_episode_carries_the_clients_cursor_and_an_unmatched_one_none():
    """Prefix and suffix as the completion recorded them (a model without FIM tokens is served the prefix
    alone, so the scorers need them from here); feedback with no completion knows no cursor."""
    served = {**completion("c1", 0, prompt="def f(x):\n    return"), "prefix": "def f(x):\n    return",
              "suffix": "\n\nprint(f(2))\n"}
    eps, _ = run([("c", served), ("f", feedback(500, cid="c1", shown=None, prompt=None))])
    assert (eps[0].record["prefix"], eps[0].record["suffix"]) == ("def f(x):\n    return", "\n\nprint(f(2))\n")
    # A FIM prompt holds the cursor itself: not stored twice.
    fim = {**served, "completion_id": "c2", "prompt": build_fim_prompt("def f(x):\n    return", "\n\nprint(f(2))\n")}
    eps, _ = run([("c", fim), ("f", feedback(500, cid="c2", shown=None, prompt=None))])
    assert (eps[0].record["prefix"], eps[0].record["suffix"]) == (None, None)
    eps, _ = run([("f", feedback(500, client_id="k", prompt="zzz")), ("c", completion("tick", 900_000))])
    assert [(e.record["matched"], e.record["prefix"], e.record["suffix"]) for e in eps] == [(False, None, None)]


def test_early_feedback_waits_for_its_completion():
    eps, counts = run([("f", feedback(500, "REJECTED", cid="c1", shown=None, prompt=None)),
                       ("c", completion("c1", 0))])
    assert [e.record["reward"] for e in eps] == [-0.25] and counts["early_feedback"] == 1


def test_by_prompt_picks_latest_whose_text_starts_with_what_was_shown():
    events = [("c", completion("old", 1000, "abc\ndef")), ("c", completion("new", 2000, "xyz")),
              ("f", feedback(3000, shown="abc", client_id="k1")), ("f", feedback(3100, shown="x", client_id="k2"))]
    eps, _ = run(events)
    assert [e.record["completion_id"] for e in eps] == ["old", "new"]


def test_other_user_or_outside_the_window_does_not_match():
    config = JoinConfig(match_window_ms=1000, max_lateness_ms=100)
    events = [("c", completion("c1", 0)), ("f", feedback(5000, client_id="late")),
              ("f", feedback(5001, client_id="other", user="someone-else")), ("c", completion("tick", 9000))]
    eps, counts = run(events, config)
    assert {e.record["matched"] for e in eps} == {False} and counts["unmatched"] == 2
    assert all(e.record["policy_version"] is None and e.record["completion_token_ids"] == [] for e in eps)
    assert all(e.record["prompt_token_ids"] == [] and e.record["temperature"] == 1.0 for e in eps)


def test_feedback_a_moment_before_its_completion_was_stamped_still_matches():
    """served_at is when the response finished; a client that decides on the last chunk can report a few
    milliseconds earlier (seen during a Kafka outage, when the front door stamps after spooling)."""
    events = [("f", feedback(1000, client_id="fast")), ("c", completion("c1", 1001)),
              ("f", feedback(20_000, client_id="too-early", prompt="q")),  # more than the slack before c2
              ("c", completion("c2", 20_000 + 1_001, prompt="q")), ("c", completion("tick", 200_000))]
    eps, counts = run(events, JoinConfig(max_lateness_ms=10_000))
    assert {(e.record["completion_id"], e.record["matched"]) for e in eps} >= {("c1", True)}
    assert [e.record["matched"] for e in eps if e.record["feedback_event_id"] == "fb-20000-ACCEPTED-too-early"] \
        == [False]


def test_duplicates_yield_one_episode():
    events = [("c", completion("c1", 0)), ("f", feedback(100, client_id="k1", eid="e1")),
              ("f", feedback(100, client_id="k1", eid="e2")),  # Continue reported the same decision twice
              ("f", feedback(200, "REJECTED", cid="c1", prompt=None, shown=None))]  # a later decision
    eps, counts = run(events)
    assert len(eps) == 1 and eps[0].record["outcome"] == "ACCEPTED" and counts["duplicate_feedback"] == 2


def test_cache_hits_and_no_code():
    events = [("f", feedback(100, cache_hit=True, client_id="k1")), ("f", feedback(200, prompt=None, shown=None))]
    eps, counts = run(events)
    assert len(eps) == 1 and eps[0].record["matched"] is False and counts["cache_hits"] == 1
    assert counts["no_code"] == 1
    eps, counts = run(events, JoinConfig(keep_unmatched=False))
    assert eps == [] and counts["cache_hits"] == 1


def test_ignored_after_ttl():
    config = JoinConfig(completion_ttl_ms=1000)
    events = [("c", completion("c1", 0)), ("c", completion("c2", 5000, prompt="q"))]
    eps, counts = run(events, config)
    assert eps == [] and counts["ignored"] == 1
    eps, _ = run(events, JoinConfig(completion_ttl_ms=1000, emit_ignored=True))
    assert [(e.record["completion_id"], e.record["outcome"], e.record["reward"]) for e in eps] == \
        [("c1", "IGNORED", 0.0)]


def test_partial_credit_by_accepted_fraction():
    eps, _ = run([("c", completion("c1", 0, text="0123456789")),
                  ("f", feedback(100, "PARTIAL", cid="c1", accepted_chars=4, prompt=None, shown=None))])
    assert eps[0].record["reward"] == pytest.approx(0.15)  # -0.25 + 1.0 * 0.4


def test_same_episodes_whatever_the_order_within_lateness():
    events = []
    for i in range(50):
        events.append(("c", completion(f"c{i}", i * 100, text=f"t{i}", prompt=f"p{i % 7}")))
        events.append(("f", feedback(i * 100 + 50, random.Random(i).choice(["ACCEPTED", "REJECTED"]),
                                     shown=f"t{i}", prompt=f"p{i % 7}", client_id=f"k{i}")))
    baseline, _ = run(events)
    shuffled = events[:]
    random.Random(3).shuffle(shuffled)
    config = JoinConfig(max_lateness_ms=10_000)
    again, _ = run(shuffled, config)
    assert len(baseline) == 50
    assert sorted((e.event_id, e.record["reward"]) for e in again) == \
        sorted((e.event_id, e.record["reward"]) for e in baseline)


def test_a_completion_that_shows_nothing_is_an_ignored_episode_at_once():
    """No IDE reports a decision on an empty suggestion: without an episode of its own, "show nothing"
    (end of sequence first) would never be trained. Its reward is the spec's ``ignored``."""
    specs = RewardSpecs(projects={"acme": RewardSpec(ignored=0.1)})
    events = [("c", completion("empty", 0, text="")), ("c", completion("blank", 10, text=" \n ", prompt="q")),
              ("c", completion("gone", 20, text="", prompt="r", aborted=True)),  # the client left: no choice
              ("c", completion("shown", 30, prompt="s"))]
    eps, counts = run(events, specs=specs)
    assert [(e.record["completion_id"], e.record["outcome"], e.record["reward"], e.record["matched"])
            for e in eps] == [("empty", "IGNORED", 0.1, True), ("blank", "IGNORED", 0.1, True)]
    r = eps[0].record
    assert r["completion_token_ids"] == [1, 2, 3] and r["feedback_event_id"] is None
    assert (r["temperature"], r["top_p"], r["prompt_token_ids"]) == (0.7, 0.95, [7, 8, 9])
    assert counts["empty"] == 2 and counts["episodes"] == 2
    # Feedback naming it anyway, before or after, is a duplicate of that episode, not a second one.
    eps, counts = run([("f", feedback(5, "REJECTED", cid="empty", shown=None, prompt=None)),
                       ("c", completion("empty", 0, text="")),
                       ("f", feedback(50, "ACCEPTED", cid="empty", shown=None, prompt=None))])
    assert [e.record["outcome"] for e in eps] == ["IGNORED"] and counts["duplicate_feedback"] == 2
    # Off: it waits for its TTL like any completion, and IGNORED emits nothing by default.
    eps, counts = run(events[:1] + [("c", completion("late", 10 ** 8, prompt="z"))], JoinConfig(emit_empty=False))
    assert eps == [] and counts["ignored"] == 1


def test_a_completion_the_gate_hid_is_one_ignored_episode_at_once_with_the_gate_fields():
    """The client got nothing, so no feedback can come: its episode is made at once, carrying what the gate
    decided (the learner weighs by show_probability, the trainer never trains it as the model's abstention),
    and feedback naming it anyway is a duplicate of that episode."""
    gate = {"gate_version": 3, "gate_score": 0.12, "gate_threshold": 0.3, "gate_shown": False,
            "show_probability": 0.9}
    hidden = {**completion("hid", 0, text="return x"), **gate}
    shown = {**completion("shown", 10, prompt="q"), "gate_version": 3, "gate_score": 0.12, "gate_threshold": 0.3,
             "gate_shown": True, "show_probability": 0.1}
    eps, counts = run([("c", hidden), ("c", shown),
                       ("f", feedback(50, "ACCEPTED", cid="hid", shown=None, prompt=None)),
                       ("f", feedback(60, "REJECTED", cid="shown", shown=None, prompt=None))])
    assert [(e.record["completion_id"], e.record["outcome"]) for e in eps] == [("hid", "IGNORED"),
                                                                               ("shown", "REJECTED")]
    r = eps[0].record
    assert {k: r[k] for k in gate} == gate
    assert (r["completion_text"], r["completion_token_ids"], r["behaviour_logprobs"]) == \
        ("return x", [1, 2, 3], [-0.1, -0.2, -0.3])  # the line it would have shown, to score it again
    assert r["reward"] == 0.0 and r["feedback_event_id"] is None
    assert (eps[1].record["gate_shown"], eps[1].record["show_probability"]) == (True, 0.1)
    assert counts["gate_hidden"] == 1 and counts["duplicate_feedback"] == 1 and counts["episodes"] == 2
    # Feedback that came first is a duplicate too; a completion with no gate fields is shown, probability 1.
    eps, counts = run([("f", feedback(5, "REJECTED", cid="hid", shown=None, prompt=None)), ("c", hidden)])
    assert [e.record["outcome"] for e in eps] == ["IGNORED"] and counts["duplicate_feedback"] == 1
    eps, _ = run([("c", completion("plain", 0)), ("f", feedback(50, cid="plain", shown=None, prompt=None))])
    assert (eps[0].record["gate_shown"], eps[0].record["show_probability"], eps[0].record["gate_version"]) == \
        (True, 1.0, None)


def test_the_episode_is_what_the_ide_showed_plus_the_token_that_ended_it():
    """Continue's single-line mode reads past the first newline (the front door held the newline back until
    the next token came) and shows only the first line: the feedback says so, and the episode trains on
    the tokens of that line plus the newline that ended it, not on the second line nobody saw."""
    served = {**completion("c1", 0, text="x = 1\n    y = 2"), "completion_token_ids": [11, 12, 13, 14],
              "completion_logprobs": [-0.1, -0.2, -0.3, -0.4], "completion_token_ends": [1, 5, 6, 15]}
    eps, _ = run([("c", served), ("f", feedback(100, cid="c1", shown="x = 1", prompt=None))])
    r = eps[0].record
    assert (r["completion_text"], r["completion_token_ids"], r["behaviour_logprobs"]) == \
        ("x = 1", [11, 12, 13], [-0.1, -0.2, -0.3])
    # Shown whole, not reported, or not a prefix of what was served: the completion as served.
    for shown in ("x = 1\n    y = 2", None, "z"):
        eps, _ = run([("c", served), ("f", feedback(100, cid="c1", shown=shown, prompt=None))])
        assert eps[0].record["completion_token_ids"] == [11, 12, 13, 14]
    # Events from before the front door recorded the tokens' text ends can't be cut: kept whole.
    old = {k: v for k, v in served.items() if k != "completion_token_ends"}
    eps, _ = run([("c", old), ("f", feedback(100, cid="c1", shown="x = 1", prompt=None))])
    assert eps[0].record["completion_token_ids"] == [11, 12, 13, 14]


# -- single-line mode: the IDE shows the first line (the cursor follows text on its line) -----------------

def served_at_cursor(cid: str, ms: int, prefix: str | None, text: str, ends: list[int], prompt: str = "p") -> dict:
    """A completion with the cursor's prefix as the front door records it, one token per text end."""
    n = len(ends)
    return {**completion(cid, ms, text, prompt=prompt), "prefix": prefix, "suffix": "\n",
            "completion_token_ids": list(range(11, 11 + n)), "completion_logprobs": [-0.1 * (i + 1) for i in range(n)],
            "completion_token_ends": ends}


def test_shown_line_is_the_first_line_in_single_line_mode_trimmed():
    from policy.shown import shown_line

    assert shown_line("foo()  \nbar()", "x = ") == "foo()"  # the cursor follows text: one line
    assert shown_line("foo()  \nbar()\n", "def f():\n    ") == "foo()  \nbar()"  # at a line's start: all of it
    assert shown_line("\n    return x", "y = f(") == "" and shown_line(" \t\nz", "y = ") == ""
    assert shown_line("\n    return x", None) == "\n    return x"  # the mode unknown: the whole text


def test_single_line_a_completion_whose_first_line_is_empty_shows_nothing():
    """The IDE shows the first line; an empty one (or only whitespace) is nothing shown, whatever follows."""
    from streams.join import shows_nothing

    assert shows_nothing(served_at_cursor("c", 0, "x = foo(", "\n    return x", [1, 13]))
    assert shows_nothing(served_at_cursor("c", 0, "x = foo(", "  \t\n    return x", [3, 4, 16]))
    # Multi-line mode, or a cursor not known: decided on the whole text, as before.
    assert not shows_nothing(served_at_cursor("c", 0, "def f():\n", "\n    return x", [1, 13]))
    assert not shows_nothing(served_at_cursor("c", 0, None, "\n    return x", [1, 13]))
    assert not shows_nothing(served_at_cursor("c", 0, "x = foo(", "a)\n", [2, 3]))


def test_single_line_without_shown_text_the_episode_is_the_first_line_plus_the_token_that_ended_it():
    """A reject through /v1/feedback (no shown text) or a TTL-IGNORED completion: a single-line user saw the
    first line only, so the tokens after the newline that ended it are not trained on."""
    from streams.join import shown_part

    served = served_at_cursor("c1", 0, "y = ", "foo()\nbar()", [3, 5, 6, 11])  # foo | () | \n | bar()
    assert shown_part(served, None) == ("foo()", [11, 12, 13], [-0.1, -0.2, pytest.approx(-0.3)])
    # Trailing whitespace is not shown, and the newline after it is still the token that ended the line.
    spaced = served_at_cursor("c1", 0, "y = ", "foo()  \nbar()", [5, 6, 7, 8, 13])  # foo() | ␠ | ␠ | \n | bar()
    assert shown_part(spaced, None)[:2] == ("foo()", [11, 12, 13, 14])
    # Multi-line mode, an unknown cursor, or one line only: as served.
    for prefix in ("def f():\n    ", None):
        multi = served_at_cursor("c1", 0, prefix, "foo()\nbar()", [3, 5, 6, 11])
        assert shown_part(multi, None)[:2] == ("foo()\nbar()", [11, 12, 13, 14])
    assert shown_part(served_at_cursor("c1", 0, "y = ", "foo()", [3, 5]), None)[:2] == ("foo()", [11, 12])
    # What the IDE reported wins over the rule.
    assert shown_part(served, "fo")[:2] == ("fo", [11])


def test_single_line_through_the_join_empty_first_line_ignored_and_reject_trains_the_first_line():
    # "\n    return x" after "x = foo(": the IDE showed nothing; an IGNORED episode at once, on the newline.
    empty = served_at_cursor("e1", 0, "x = foo(", "\n    return x", [1, 13])
    eps, counts = run([("c", empty)])
    assert [(e.record["completion_id"], e.record["outcome"], e.record["completion_text"],
             e.record["completion_token_ids"]) for e in eps] == [("e1", "IGNORED", "", [11])]
    assert counts["empty"] == 1
    # A REJECTED decision with no shown text on "foo()\nbar()": the tokens of "foo()" and the newline.
    served = served_at_cursor("c1", 0, "y = ", "foo()\nbar()", [3, 5, 6, 11], prompt="q")
    eps, _ = run([("c", served), ("f", feedback(100, "REJECTED", cid="c1", shown=None, prompt=None))])
    [r] = [e.record for e in eps]
    assert (r["outcome"], r["completion_text"], r["completion_token_ids"]) == ("REJECTED", "foo()", [11, 12, 13])
    assert r["behaviour_logprobs"] == pytest.approx([-0.1, -0.2, -0.3])
    # Closed by its TTL with no decision: the same cut.
    eps, _ = run([("c", served), ("c", completion("tick", 10_000, prompt="z"))],
                 JoinConfig(completion_ttl_ms=1000, emit_ignored=True))
    assert [(e.record["outcome"], e.record["completion_text"], e.record["completion_token_ids"]) for e in eps] \
        == [("IGNORED", "foo()", [11, 12, 13])]


# -- generator reuse: Continue's GeneratorReuseManager ----------------------------------------------------

def fim(prefix: str, suffix: str = "\n\nprint(add(1, 2))\n", path: str = "src/m.py") -> str:
    """A prompt as Continue writes it for a Qwen coder model (its FIM template, the current file's header)."""
    return f"<|repo_name|>r\n<|file_sep|>{path}\n<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"


def fim_completion(cid: str, ms: int, prefix: str, text: str, **kw) -> dict:
    c = completion(cid, ms, text, prompt=fim(prefix, **kw))
    c.update(prefix=prefix, suffix=kw.get("suffix", "\n\nprint(add(1, 2))\n"), filepath=kw.get("path", "src/m.py"),
             completion_token_ends=[4, 8, 13], completion_token_ids=[1, 2, 3])
    return c


def test_reused_suggestion_joins_the_completion_that_served_it():
    # Served "    return a + b" after "def add(a, b):\n"; the user typed "    ret" into it and Tab-accepted
    # the rest: Continue logs a prompt rebuilt for the longer prefix and only "urn a + b".
    served = fim_completion("c1", 0, "def add(a, b):\n", "    return a + b")
    fb = feedback(2000, shown="urn a + b", prompt=fim("def add(a, b):\n    ret"), client_id="k1")
    eps, counts = run([("c", served), ("f", fb), ("c", completion("later", 120_000))])
    [ep] = eps
    r = ep.record
    assert (r["completion_id"], r["matched"], r["policy_version"], r["reward"]) == ("c1", True, 4, 0.75)
    # The user saw all of it: the typed start and the rest; the tokens are those of the shown text.
    assert r["completion_text"] == "    return a + b" and r["completion_token_ids"] == [1, 2, 3]
    assert counts["unmatched"] == 0


def test_reuse_trains_only_the_tokens_the_user_saw():
    served = fim_completion("c1", 0, "x = ", "1234567890123")
    fb = feedback(2000, shown="567", prompt=fim("x = 1234"), client_id="k1")  # Continue cut the rest
    eps, _ = run([("c", served), ("f", fb), ("c", completion("later", 120_000))])
    [ep] = eps
    assert ep.record["completion_text"] == "1234567" and ep.record["completion_token_ids"] == [1, 2]


def test_reuse_needs_same_user_file_suffix_and_a_typed_start_of_the_text():
    served = fim_completion("c1", 0, "def add(a, b):\n", "    return a + b")
    wrong = [feedback(2000, shown="urn a + b", prompt=fim("def add(a, b):\n    ret"), client_id="u2", user="u2"),
             feedback(2001, shown="urn a + b", prompt=fim("def add(a, b):\n    ret", path="other.py"),
                      client_id="path"),
             feedback(2002, shown="urn a + b", prompt=fim("def add(a, b):\n    ret", suffix="\n"), client_id="sfx"),
             feedback(2003, shown="urn a + b", prompt=fim("def add(a, b):\n    rat"), client_id="typo"),
             feedback(2004, shown="urn a - b", prompt=fim("def add(a, b):\n    ret"), client_id="text")]
    eps, counts = run([("c", served), *[("f", f) for f in wrong], ("c", completion("later", 120_000))])
    assert [e.record["matched"] for e in eps] == [False] * 5 and counts["unmatched"] == 5


def test_time_to_decision_is_ours_served_at_to_received_at():
    # Continue's `time` is its generation time (stored as client_time_ms); the decision time is our clocks'.
    fb = {**feedback(2500, client_id="k1"), "client_time_ms": 180, "time_to_decision_ms": None}
    eps, _ = run([("c", completion("c1", 1000)), ("f", fb)])
    assert eps[0].record["time_to_decision_ms"] == 1500
    api = {**feedback(9000, cid="nope", shown=None, prompt=None), "time_to_decision_ms": 420}
    eps, _ = run([("f", api), ("c", completion("tick", 200_000))])
    assert [(e.record["matched"], e.record["time_to_decision_ms"]) for e in eps] == [(False, 420)]


def test_reuse_after_continue_pruned_top_lines_of_the_longer_prefix():
    # Continue prunes the prefix to its token budget by whole lines from the top: the rebuilt prompt for
    # the longer prefix may have lost the served one's first line.
    served = fim_completion("c1", 0, "import os\nimport sys\ndef add(a, b):\n", "    return a + b")
    fb = feedback(2000, shown="urn a + b", prompt=fim("import sys\ndef add(a, b):\n    ret"), client_id="k1")
    cut_mid_line = feedback(2001, shown="urn a + b", prompt=fim("port sys\ndef add(a, b):\n    ret"), client_id="k2")
    eps, counts = run([("c", served), ("f", fb), ("f", cut_mid_line), ("c", completion("later", 120_000))])
    assert sorted((e.record["completion_id"], e.record["matched"]) for e in eps)[0] == ("c1", True)
    assert [e.record["matched"] for e in eps].count(True) == 1 and counts["unmatched"] == 1
