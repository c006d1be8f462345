"""Joining served completions with feedback into episodes: the pure logic, no Kafka, no Faust.

Two stages, each keyed the way its input is partitioned (DESIGN → Joining without a shared id):

- ``PromptMatcher`` (by prompt hash): Continue never sends our completion id back, so
  feedback without it is matched to the latest completion served to the same
  (project, user, prompt) within the match window whose text starts with the
  text the IDE reported (Continue trims what it shows). Feedback that arrives
  before its completion waits for it until the stream time passes its time
  plus the allowed lateness.
- Generator reuse (by file and suffix): when the user types into a pending suggestion, Continue sends no
  new request (GeneratorReuseManager) and logs a prompt rebuilt for the longer prefix with only the rest
  of the suggestion as its completion. Feedback that finds no completion by its prompt hash is tried
  once more, keyed by (project, user, file, suffix), against completions whose prefix, extended by the
  start of their text, is the feedback's prefix, and whose text goes on with what it reports.
- ``EpisodeJoiner`` (by completion id): one episode per completion, from the first
  decision on it; later feedback on the same completion is a duplicate. A
  completion with no feedback within its TTL closes as IGNORED. A completion that
  showed nothing (``shows_nothing``) is an IGNORED episode at once: no IDE reports
  a decision on an empty suggestion, and "show nothing" is an action to learn.

Time is event time ("stream time" = the newest event time seen), so the same
input, in any order within the lateness, gives the same episodes — replays too.
Episode ids are derived from what they join, so a re-run produces the same ids.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone

from schemas.events import Event, new_event
from schemas.token_ids import PACKED, packed_field
from policy.fim import parse_prompt
from policy.shown import first_line, kept_token_count, shown_line, single_line_mode
from rewards.spec import RewardSpecs, acceptance_reward, composite_reward

GATE_FIELDS = ("gate_version", "gate_score", "gate_threshold", "gate_shown", "show_probability")
"""What the show-gate decided about a completion, carried from CompletionServed to its Episode."""
EXPLORATION_FIELDS = ("explored", "exploration_share", "candidates", "chosen_candidate")
"""What the exploration coin decided (``policy.exploration``) and which candidate the chooser served
(``serving.completions``), carried from CompletionServed to its Episode: the trainer, off-policy evaluation and
the show-gate's learner tell explored samples from greedy point masses and from chosen candidates."""
EPISODE_NAMESPACE = uuid.UUID("6f1c2a9e-5b7d-4d8e-9c3a-2b1f0e4d7a6c")


@dataclass(frozen=True)
class JoinConfig:
    match_window_ms: int = 10 * 60_000
    """How far back feedback without our id may look for its completion."""
    max_lateness_ms: int = 60_000
    """How long (in stream time) feedback waits for a completion that hasn't arrived yet."""
    completion_ttl_ms: int = 30 * 60_000
    """A completion with no feedback this long after it was served is IGNORED."""
    emit_ignored: bool = False
    """Episodes for IGNORED completions (reward ``ignored``), or none (the default, as Cursor)."""
    emit_empty: bool = True
    """A completion that showed nothing is an IGNORED episode at once (reward ``ignored``), whatever
    ``emit_ignored`` says: no IDE reports a decision on an empty suggestion, so without this "show nothing"
    would never be trained, and the policy could only learn to show more (see ``shows_nothing``)."""
    keep_unmatched: bool = True
    """Unmatched and cache-hit feedback become off-policy episodes (matched=false), or are dropped."""
    idle_close_ms: int = 5 * 60_000
    """A partition with no new events closes windows by the wall clock minus this much."""
    finish_slack_ms: int = 1_000
    """How long before its completion's ``served_at`` feedback may be received: ``served_at`` is when the
    response *finished*, and a fast client decides on the last chunk before the front door stamps it."""

    @classmethod
    def from_settings(cls, settings) -> "JoinConfig":
        return cls(match_window_ms=int(settings.join_window_s * 1000),
                   max_lateness_ms=int(settings.join_lateness_s * 1000),
                   completion_ttl_ms=int(settings.completion_ttl_s * 1000), emit_ignored=settings.emit_ignored,
                   keep_unmatched=settings.keep_unmatched, idle_close_ms=int(settings.idle_close_s * 1000))


def millis(t) -> int:
    return int(t.timestamp() * 1000) if isinstance(t, datetime) else int(t)


def shows_nothing(completion: dict) -> bool:
    """The completion showed the user nothing: the model ended it (end of sequence first, or a stop cut it
    to nothing) with no text, or only whitespace, which IDEs don't show (Continue trims it). In single-line
    mode (the completion's ``prefix``: the cursor follows text on its line) the IDE shows the first line
    only, so an empty first line shows nothing, whatever follows it (``policy.shown.shown_line``); a cursor
    not known (``prefix`` None): the whole text. A client that went away before anything was shown
    (``aborted``) is not the model's choice, so it is not one."""
    return not completion.get("aborted") and not shown_line(completion["completion_text"], completion.get("prefix"))


def shown_part(completion: dict, shown: str | None = None) -> tuple[str, list[int], list[float]]:
    """(text, token ids, behaviour logprobs) of the completion as the IDE showed it.

    The front door already keeps only what it sent plus the token that ended it; an IDE may show less —
    Continue's single-line mode shows the first line of what it read and drops the rest — and its
    feedback says what it showed. Tokens past that (and the one that ended it) were never seen, so the
    episode is cut there, by the tokens' text ends (``completion_token_ends``). Unknown ends (older
    events) or a text that does not start with the shown one: the completion as served.

    No shown text reported (``/v1/feedback`` decisions without it, IGNORED episodes): in single-line mode
    (the completion's ``prefix``) the first line, trailing whitespace trimmed (``shown_line``), and the
    tokens up to the one that ended the line (the newline: the whitespace before it is not shown but does
    not end the line); otherwise, or with the cursor not known, the completion as served.
    """
    text = completion["completion_text"]
    ids, logprobs = list(completion["completion_token_ids"]), list(completion["completion_logprobs"])
    ends = completion.get("completion_token_ends") or []
    if len(ends) != len(ids):
        return text, ids, logprobs
    if shown is None:
        prefix = completion.get("prefix")
        if prefix is None or not single_line_mode(prefix) or "\n" not in text:
            return text, ids, logprobs
        kept = kept_token_count(ends, len(first_line(text)))
        return shown_line(text, prefix), ids[:kept], logprobs[:kept]
    if len(shown) >= len(text) or not text.startswith(shown):
        return text, ids, logprobs
    kept = kept_token_count(ends, len(shown))
    return shown, ids[:kept], logprobs[:kept]


REUSE_PREFIX_TAIL_CHARS = 4096
"""How much of a reuse candidate's prefix is kept (its end): enough for Continue's pruned prefixes (a share
of maxPromptTokens, 1,024 by default), bounded for any other client's."""
REUSE_MARK = "reuse:"
"""How a reuse key's third part starts: a prompt hash (hex) never does."""


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _cursor(record: dict) -> tuple[str, str, str | None] | None:
    """(prefix, suffix, filepath) of a FIM prompt: from a completion's parsed fields, or a feedback's prompt;
    None for a plain prompt (or none): its reuse can't be recognised."""
    if "served_at" in record:
        prefix, suffix, path = record.get("prefix"), record.get("suffix"), record.get("filepath")
    elif record.get("prompt") is not None:
        parsed = parse_prompt(record["prompt"])
        prefix, suffix, path = parsed.prefix, parsed.suffix, parsed.filepath
    else:
        return None
    return None if prefix is None or suffix is None else (prefix, suffix, path)


def reuse_key(record: dict) -> tuple | None:
    """The key under which a reused generator's feedback meets its completion: what typing into a pending
    suggestion does not change — who, the file, the text after the cursor. None: not a FIM prompt."""
    cursor = _cursor(record)
    if cursor is None:
        return None
    _, suffix, path = cursor
    return (record["project_id"], record["user_id"], REUSE_MARK + _sha(f"{path or ''}\x00{suffix}"))


def with_typed(fb: dict, typed: str) -> dict:
    """Feedback on a reused suggestion, with the part of it the user typed (shown, then typed over)."""
    return {**fb, "reuse_typed": typed}


def _feedback_identity(fb: dict) -> str:
    # The IDE's own id when it has one: Continue may report one decision more than once.
    return f"{fb['project_id']}/{fb['client_completion_id']}" if fb.get("client_completion_id") else fb["event_id"]


@dataclass
class PromptMatcher:
    config: JoinConfig = field(default_factory=JoinConfig)
    candidates: dict[tuple, list[dict]] = field(default_factory=dict)
    waiting: dict[tuple, list[dict]] = field(default_factory=dict)
    stream_time: int = 0
    reuse: bool = False
    """Match generator reuse (keys from ``reuse_key``) instead of the same prompt."""

    def key(self, record: dict) -> tuple:
        return reuse_key(record) if self.reuse else (record["project_id"], record["user_id"], record["prompt_sha256"])

    def on_completion(self, completion: dict) -> list[tuple[str, dict]]:
        """Remember a completion; return (completion_id, feedback) pairs for feedback that waited for it."""
        self.stream_time = max(self.stream_time, millis(completion["served_at"]))
        k = self.key(completion)
        candidate = {"completion_id": completion["completion_id"], "served_at": millis(completion["served_at"]),
                     "text": completion["completion_text"]}
        if self.reuse:  # the prefix's length and hash: enough to recognise it, small to keep
            prefix = _cursor(completion)[0]
            candidate.update(prefix_chars=len(prefix), prefix_sha256=_sha(prefix),
                             prefix_tail=prefix[-REUSE_PREFIX_TAIL_CHARS:])
        self.candidates.setdefault(k, []).append(candidate)
        resolved, still = [], []
        for fb in self.waiting.pop(k, []):
            match = self._match(k, fb)
            (resolved.append(match) if match else still.append(fb))
        if still:
            self.waiting[k] = still
        return resolved

    def on_feedback(self, fb: dict) -> tuple[str, dict] | None:
        """(completion id, the feedback as the joiner takes it) for this feedback, or None (it waits;
        ``expire`` gives it up later)."""
        self.stream_time = max(self.stream_time, millis(fb["received_at"]))
        k = self.key(fb)
        match = self._match(k, fb)
        if match is None:
            self.waiting.setdefault(k, []).append(fb)
        return match

    def _match(self, k: tuple, fb: dict) -> tuple[str, dict] | None:
        at = millis(fb["received_at"])
        shown = fb.get("completion")
        typed_of = self._typed if self.reuse else (lambda c, fb: "")
        best, best_typed = None, ""
        for c in self.candidates.get(k, ()):
            if not at - self.config.match_window_ms <= c["served_at"] <= at + self.config.finish_slack_ms:
                continue
            typed = typed_of(c, fb)
            if typed is None or (shown is not None and not c["text"].startswith(typed + shown)):
                continue
            if best is None or c["served_at"] >= best["served_at"]:
                best, best_typed = c, typed
        if best is None:
            return None
        return best["completion_id"], with_typed(fb, best_typed) if self.reuse else fb

    @staticmethod
    def _typed(c: dict, fb: dict) -> str | None:
        """What the user typed of candidate ``c`` before Continue logged ``fb`` on it, or None if ``fb`` is
        not about ``c``: the feedback's prefix is the completion's prefix plus a non-empty start of the
        completion's text. Continue prunes the prefix to its token budget by whole lines from the top, so
        the longer prefix may also have lost top lines: then what precedes the typed text is a part of
        the served prefix that starts a line and runs to its end."""
        prefix = _cursor(fb)[0]
        n = c.get("prefix_chars")
        if n is None:
            return None
        text = c["text"]
        if len(prefix) > n and _sha(prefix[:n]) == c["prefix_sha256"]:
            typed = prefix[n:]
            return typed if text.startswith(typed) else None
        tail = c.get("prefix_tail", "")
        for k in range(min(len(text), len(prefix)), 0, -1):  # the longest typed start first
            kept = prefix[:-k]
            if (prefix.endswith(text[:k]) and kept and len(kept) < n and tail.endswith(kept)
                    and tail[len(tail) - len(kept) - 1] == "\n"):
                return text[:k]
        return None

    def expire(self) -> list[dict]:
        """Feedback whose wait is over (unmatched); forgets candidates older than the window."""
        gone = []
        for k in list(self.waiting):
            keep = []
            for fb in self.waiting[k]:
                (gone if millis(fb["received_at"]) + self.config.max_lateness_ms <= self.stream_time
                 else keep).append(fb)
            if keep:
                self.waiting[k] = keep
            else:
                del self.waiting[k]
        horizon = self.stream_time - self.config.match_window_ms - self.config.max_lateness_ms
        for k in list(self.candidates):
            fresh = [c for c in self.candidates[k] if c["served_at"] >= horizon]
            if fresh:
                self.candidates[k] = fresh
            else:
                del self.candidates[k]
        return gone


@dataclass
class EpisodeJoiner:
    specs: RewardSpecs = field(default_factory=RewardSpecs)
    config: JoinConfig = field(default_factory=JoinConfig)
    open: dict[str, dict] = field(default_factory=dict)
    closed: dict[str, int] = field(default_factory=dict)
    """completion id -> served_at of completions that already have their episode."""
    early: dict[str, list[dict]] = field(default_factory=dict)
    """Feedback carrying our id that arrived before its completion."""
    seen_feedback: dict[str, int] = field(default_factory=dict)
    stream_time: int = 0
    counts: Counter = field(default_factory=Counter)

    def on_completion(self, completion: dict) -> list[Event]:
        cid = completion["completion_id"]
        self.stream_time = max(self.stream_time, millis(completion["served_at"]))
        if cid in self.open or cid in self.closed:
            self.counts["duplicate_completions"] += 1
            return []
        # Episodes that need no decision, closed at once (feedback naming them anyway, early or late, is a
        # duplicate of that decision): a completion the show-gate hid (the client got nothing, so no feedback
        # can come; an episode of its own kind, gate_shown false, never trained as the model's choice to
        # abstain, so the history counts it and a learner can estimate a candidate gate on all the traffic),
        # and one that showed nothing.
        at_once = ("gate_hidden" if completion.get("gate_shown") is False
                   else "empty" if self.config.emit_empty and shows_nothing(completion) else None)
        if at_once is not None:
            self.closed[cid] = millis(completion["served_at"])
            self.counts[at_once] += 1
            self.counts["episodes"] += 1
            self.counts["duplicate_feedback"] += len(self.early.pop(cid, []))
            return [self.episode(completion, None)]
        self.open[cid] = completion
        waiting = self.early.pop(cid, [])
        if not waiting:
            return []
        self.counts["early_feedback"] += 1
        out = [ep for fb in waiting if (ep := self.on_feedback(cid, fb)) is not None]
        return out

    def on_feedback(self, completion_id: str, fb: dict) -> Event | None:
        """The episode for this decision, or None (duplicate, or waiting for its completion)."""
        self.stream_time = max(self.stream_time, millis(fb["received_at"]))
        identity = _feedback_identity(fb)
        if completion_id in self.closed or identity in self.seen_feedback:
            self.counts["duplicate_feedback"] += 1
            return None
        completion = self.open.get(completion_id)
        if completion is None:
            self.early.setdefault(completion_id, []).append(fb)
            return None
        if completion["project_id"] != fb["project_id"]:
            # Another project naming this completion (a guessed or replayed id): it must not label it.
            return self.unmatched(fb, "foreign_feedback")
        self.seen_feedback[identity] = millis(fb["received_at"])
        del self.open[completion_id]
        self.closed[completion_id] = millis(completion["served_at"])
        self.counts["episodes"] += 1
        return self.episode(completion, fb)

    def unmatched(self, fb: dict, why: str) -> Event | None:
        """Feedback that matches no completion we served (or never reached us: a cache hit)."""
        identity = _feedback_identity(fb)
        if identity in self.seen_feedback:
            self.counts["duplicate_feedback"] += 1
            return None
        self.seen_feedback[identity] = millis(fb["received_at"])
        self.counts[why] += 1
        if not self.config.keep_unmatched:
            return None
        self.counts["episodes"] += 1
        return self.episode(None, fb)

    def expire(self) -> list[Event]:
        """IGNORED completions past their TTL; early feedback whose completion never came; old memory."""
        out = []
        ttl = self.config.completion_ttl_ms
        for cid in [c for c, comp in self.open.items() if millis(comp["served_at"]) + ttl <= self.stream_time]:
            completion = self.open.pop(cid)
            self.closed[cid] = millis(completion["served_at"])
            self.counts["ignored"] += 1
            if self.config.emit_ignored:
                self.counts["episodes"] += 1
                out.append(self.episode(completion, None))
        for cid in list(self.early):
            late = [fb for fb in self.early[cid]
                    if millis(fb["received_at"]) + self.config.max_lateness_ms <= self.stream_time]
            if len(late) == len(self.early[cid]):
                del self.early[cid]
            else:
                self.early[cid] = [fb for fb in self.early[cid] if fb not in late]
            out.extend(ep for fb in late if (ep := self.unmatched(fb, "unmatched")) is not None)
        horizon = self.stream_time - 2 * ttl
        self.closed = {c: t for c, t in self.closed.items() if t >= horizon}
        self.seen_feedback = {f: t for f, t in self.seen_feedback.items() if t >= horizon}
        return out

    def episode(self, completion: dict | None, fb: dict | None) -> Event:
        """One Episode event; ``fb`` None = IGNORED, ``completion`` None = off-policy (unmatched)."""
        source = completion or fb
        spec = self.specs.for_project(source["project_id"])
        outcome = fb["outcome"] if fb else "IGNORED"
        if completion:
            shown = fb.get("completion") if fb else None
            if shown is not None and fb.get("reuse_typed"):
                shown = fb["reuse_typed"] + shown  # a reused suggestion: the user saw all of it, typed the start
            text, tokens, logprobs = shown_part(completion, shown)
        else:
            text, tokens, logprobs = fb.get("completion") or "", [], []
        fraction = None
        if outcome == "PARTIAL" and fb.get("accepted_chars") is not None and text:
            fraction = fb["accepted_chars"] / len(text)
        components = {"acceptance": acceptance_reward(spec, outcome, fraction)}
        n_tokens = self.specs.completion_tokens(spec, tokens, text)  # unmatched: the text's, not none
        completion_id = completion["completion_id"] if completion else f"unmatched-{fb['event_id']}"
        times = [millis(x) for x in ((completion or {}).get("served_at"), (fb or {}).get("received_at")) if x]
        # Time to decision from our own clocks (served_at: the response's end; the slack may put the
        # feedback a little before it); without a completion, what the client said, if it did.
        decision_ms = (max(times[1] - times[0], 0) if completion and fb
                       else (fb or {}).get("time_to_decision_ms") if not completion else None)
        prompt = (completion or {}).get("prompt") or (fb or {}).get("prompt") or ""
        return new_event(
            "Episode",
            event_id=str(uuid.uuid5(EPISODE_NAMESPACE, f"{completion_id}/{fb['event_id'] if fb else 'ignored'}")),
            joined_at=datetime.fromtimestamp(max(times) / 1000, timezone.utc),
            completion_id=completion_id, project_id=source["project_id"], user_id=source["user_id"],
            policy_version=completion["policy_version"] if completion else None,
            prompt=prompt,
            # The ids as the completion carries them: packed (v5 on) passed on as bytes, never unpacked here;
            # a completion written before v5 (or restored from state kept before) has the array.
            prompt_token_ids=list((completion or {}).get("prompt_token_ids") or []),
            prompt_token_ids_packed=packed_field((completion or {}).get(PACKED)),
            prompt_sha256=source.get("prompt_sha256"),
            **served_cursor(completion, prompt),
            completion_text=text, completion_token_ids=tokens,
            completion_token_ends=_ends_of(completion, len(tokens)),
            behaviour_logprobs=logprobs,
            # The distribution the behaviour logprobs are of; an unmatched episode has none (its defaults).
            **({"temperature": completion["temperature"], "top_p": completion["top_p"]} if completion else {}),
            outcome=outcome, reward=composite_reward(spec, components, n_tokens),
            reward_components=components, scorer="acceptance", matched=completion is not None,
            feedback_event_id=fb["event_id"] if fb else None, time_to_decision_ms=decision_ms,
            **{name: completion[name] for name in GATE_FIELDS if completion and name in completion},
            **{name: completion[name] for name in EXPLORATION_FIELDS if completion and name in completion},
            gate_logprobs=_gate_logprobs_of(completion, len(tokens)),
        )


def _gate_logprobs_of(completion: dict | None, kept: int) -> list[float]:
    """The first ``kept`` tokens' logprobs at the exploration temperature, when the completion recorded them
    apart from its behaviour logprobs (``shown_part`` keeps a prefix of the tokens: cut the same way)."""
    gate = list((completion or {}).get("completion_gate_logprobs") or [])
    return gate[:kept] if len(gate) >= kept else []


def _ends_of(completion: dict | None, kept: int) -> list[int]:
    """The text ends of an episode's first ``kept`` tokens, when the completion recorded them."""
    ends = list((completion or {}).get("completion_token_ends") or [])
    return ends[:kept] if len(ends) >= kept else []


def served_cursor(completion: dict | None, prompt: str) -> dict:
    """Episode.prefix/suffix: the cursor as the client sent it, where the served prompt does not hold it (a
    model without FIM tokens is served the prefix alone). A FIM prompt holds both, and the scorers parse them
    from it (``rewards.scoring.episode_cursor``): not stored twice. Unmatched feedback knows no cursor."""
    if completion is None or parse_prompt(prompt).is_fim:
        return {}
    return {"prefix": completion.get("prefix"), "suffix": completion.get("suffix")}


@dataclass
class JoinPipeline:
    """Both stages for events of one partition, in arrival order: what a worker does, without Kafka."""

    specs: RewardSpecs = field(default_factory=RewardSpecs)
    config: JoinConfig = field(default_factory=JoinConfig)

    def __post_init__(self) -> None:
        self.matcher = PromptMatcher(self.config)
        self.reuse_matcher = PromptMatcher(self.config, reuse=True)
        self.joiner = EpisodeJoiner(self.specs, self.config)

    @property
    def counts(self) -> Counter:
        return self.joiner.counts

    def completion(self, completion: dict) -> list[Event]:
        out = self.joiner.on_completion(completion)
        resolved = self.matcher.on_completion(completion)
        if reuse_key(completion) is not None:
            resolved += self.reuse_matcher.on_completion(completion)
        for cid, fb in resolved:
            if (ep := self.joiner.on_feedback(cid, fb)) is not None:
                out.append(ep)
        return out

    def feedback(self, fb: dict) -> list[Event]:
        if fb.get("completion_id") is None and fb.get("prompt_sha256") is None:
            self.counts["no_code"] += 1  # level: noCode — counted in analytics, never trained on
            return []
        if fb.get("cache_hit"):
            ep = self.joiner.unmatched(fb, "cache_hits")  # Continue's cache answered; we served nothing
            return [ep] if ep else []
        if fb.get("completion_id"):
            ep = self.joiner.on_feedback(fb["completion_id"], fb)
            return [ep] if ep else []
        match = self.matcher.on_feedback(fb)
        if match is None:
            return []
        ep = self.joiner.on_feedback(*match)
        return [ep] if ep else []

    def tick(self) -> list[Event]:
        """Close what time has closed: feedback no completion's prompt matched gets one more try as
        generator reuse, then is unmatched; IGNORED completions."""
        now = max(self.matcher.stream_time, self.reuse_matcher.stream_time, self.joiner.stream_time)
        self.matcher.stream_time = self.reuse_matcher.stream_time = self.joiner.stream_time = now
        out = []
        for fb in self.matcher.expire():
            if reuse_key(fb) is None:
                out += [ep] if (ep := self.joiner.unmatched(fb, "unmatched")) is not None else []
            elif (match := self.reuse_matcher.on_feedback(fb)) is not None:
                out += [ep] if (ep := self.joiner.on_feedback(*match)) is not None else []
        out += [ep for fb in self.reuse_matcher.expire() if (ep := self.joiner.unmatched(fb, "unmatched")) is not None]
        return out + self.joiner.expire()
