"""What of a completion the user is shown, and so what an episode may train on.

The front door sends text as it is generated; the IDE shows a part of it (Continue's single-line mode: the
first line); the join cuts each episode to what was shown plus the token that ended it. These rules are the
policy's: the front door, the show-gate and the join apply the same ones.
"""

from __future__ import annotations

import bisect


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
