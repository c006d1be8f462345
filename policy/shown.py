"""What of a completion the user is shown, and so what an episode may train on.

The front door sends text as it is generated; the IDE shows a part of it (Continue's single-line mode: the
first line); the join cuts each episode to what was shown plus the token that ended it. These rules are the
policy's: the front door, the show-gate and the join apply the same ones.
"""

from __future__ import annotations

import bisect


def first_line(text: str) -> str:
    """``text`` up to its first newline (all of it when it has none)."""
    return text.split("\n", 1)[0]


def single_line_mode(prefix: str) -> bool:
    """Continue's multiline "auto": a cursor after text on its line gets a one-line completion."""
    return bool(prefix.rsplit("\n", 1)[-1].strip())


def shown_text(suggestion: str, *, single_line: bool) -> str | None:
    """What the editor shows for ``suggestion``: one line in single-line mode, trailing whitespace
    trimmed; None when nothing is left (an empty suggestion is never shown)."""
    text = first_line(suggestion) if single_line else suggestion
    text = text.rstrip()
    return text if text.strip() else None


def shown_line(completion_text: str, prefix: str | None) -> str:
    """What an IDE shows of a completion served at a cursor after ``prefix``: its first line in single-line
    mode (``single_line_mode``), all of it otherwise, trailing whitespace trimmed; "" when nothing is shown.
    ``prefix`` None (the cursor is not known): the whole text, trimmed."""
    return shown_text(completion_text, single_line=prefix is not None and single_line_mode(prefix)) or ""


def kept_token_count(token_text_ends: list[int], shown_chars: int) -> int:
    """How many of a completion's generated tokens its episode trains on: those whose text lies within the
    ``shown_chars`` characters the user was shown, plus the one token that ended them (the end of
    sequence, or the token a stop string, a hold-back or the client's leaving cut into).

    ``token_text_ends[i]``: where token i's text ends in the generated text (non-decreasing: a token whose
    text is still incomplete — half a UTF-8 character — ends where the one before it did). Tokens after
    the ending one were never seen, so their reward says nothing about them.
    """
    within = bisect.bisect_right(token_text_ends, shown_chars)
    return min(within + 1, len(token_text_ends))
