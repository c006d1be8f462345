"""The trainer learns the show-gate (policy/show_gate.py) from episodes and publishes its versions.

Three parts, the first two pure:

- ``decided_from_episode``: an Episode as a decided line (features, accepted or not, accepted characters, the
  probability it had of being shown), or None when it says nothing about a line the user saw.
- ``estimate_show_rule`` / ``evaluate_candidate``: off-policy estimates, by inverse propensity, of what a show
  rule would get on the logged traffic. Each decided line stands for 1 / show_probability lines of the
  traffic (a line shown with probability ε is one of 1/ε like it, the others hidden and unlabelled), so the
  decided lines, weighted, are a sample of all traffic: a gate's share shown, accept rate among shown and
  accepted characters per request are self-normalised ratios over them (``trainer/ope.py``'s
  ``ratio_estimate``: Wilson intervals for the rates, delta-method for the characters). The lines the gate
  hid carry no label; they enter only as the share of them a candidate would now show.
- ``GateLearner``: the newest ``gate_window`` decided lines per project ("" the shared gate; an opted-in
  project's own gate when project policies are on), a refit every ``gate_refit_every`` new ones and after each
  promoted weight version (the features are that version's logprobs), and the GateVersion it publishes, read
  from ``tabloop.episodes`` at the head by a thread of its own (``GateLearnerThread``), not by the PPO loop
  whose read position lags by minutes of updates.

Promotion. A candidate is PROMOTED when the estimate keeps at least ``gate_keep_chars`` of the accepted
characters always-show gets, and its accept rate among shown is not below the serving gate's (always-show's
when none serves); otherwise it is published ROLLED_BACK, the reason in words. Both estimates use each
line's cross-fitted score (from a model fit without that line), the scores the threshold was chosen on: an
in-sample score flatters the candidate against a serving gate fit on other lines.

Why gates skip the canary that weight versions get: a weight version changes every token, and the log
weighs it only through sequence-level importance ratios that can be 10⁶ (clipped, biased), so it must be
measured on live traffic. A gate changes one per-request decision, show or not, over a line the log holds
with its exact propensity: the door showed it with probability 1 or ε and says which. The inverse-propensity
estimate over those lines is unbiased for any gate whose "show" set is covered by the logging one's support
(every line had at least ε of being shown: Horvitz & Thompson 1952; for contextual bandits, Dudík, Langford &
Li, "Doubly Robust Policy Evaluation and Learning", ICML 2011, §2), which is what a canary would measure,
without serving anyone an undecided gate. The exploration each gate keeps is what keeps that support: with
ε = 0 nothing below a threshold is ever labelled again, and no later gate could be judged there.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
from confluent_kafka import Consumer, KafkaException, TopicPartition

from infra.bus import decode_message, make_codec, watermark_offsets
from policy.show_gate import (Decided, Fit, FitConfig, Gate, first_line_features, fit_gate, kept_gains,
                               latest_statuses, serving_gate_record)
from policy.weight_store import promoted_version
from rewards.spec import RewardSpec, RewardSpecs
from schemas.events import Event, new_event
from schemas.topics import EPISODES, GATES, WEIGHTS
from trainer.ope import effective_sample_size, ratio_estimate

log = logging.getLogger("tabloop.trainer.show_gate")

DECIDED_OUTCOMES = ("ACCEPTED", "PARTIAL", "REJECTED")


def _millis(t) -> int:
    return int(t.timestamp() * 1000) if hasattr(t, "timestamp") else int(t or 0)


def partial_share(record: dict, spec: RewardSpec) -> float:
    """The share of a PARTIAL episode's line the user kept, read back from its acceptance reward (the join
    puts it f of the way from the rejected to the accepted reward, ``rewards.spec.acceptance_reward``)."""
    reward = (record.get("reward_components") or {}).get("acceptance")
    if reward is None or spec.accepted <= spec.rejected:
        return 0.0
    return min(max((reward - spec.rejected) / (spec.accepted - spec.rejected), 0.0), 1.0)


def decided_from_episode(record: dict, specs: RewardSpecs | None = None) -> Decided | None:
    """The decided line an Episode is, or None.

    It counts when it was matched (we served it, so its tokens' logprobs are ours), the gate showed it, the
    user decided (ACCEPTED or PARTIAL: accepted; REJECTED) and it showed some text. Accepted characters:
    the stripped line's length, a PARTIAL's kept share of it, 0 when rejected. IGNORED, hidden by the gate,
    unmatched feedback, an empty line: None.

    Greedy and explored episodes alike: the gate's propensity is ``show_probability``, its own coin's, drawn
    after the text whichever branch wrote it, and independent of the exploration coin (a hash of the
    completion id), so 1 / show_probability is the exact inverse propensity of either kind. The gate is
    learnt over the traffic as served, greedy and explored lines in the proportion users get them, which is
    what its estimates are about; its figures are on one scale for both (``gate_logprobs``).
    """
    text = record.get("completion_text") or ""
    if (not record.get("matched") or record.get("gate_shown") is False
            or record.get("outcome") not in DECIDED_OUTCOMES or not text.strip()):
        return None
    outcome = record["outcome"]
    chars = float(len(text.strip()))
    if outcome == "REJECTED":
        accepted_chars = 0.0
    elif outcome == "PARTIAL":
        specs = specs or RewardSpecs()
        accepted_chars = chars * partial_share(record, specs.for_project(record.get("project_id") or ""))
    else:
        accepted_chars = chars
    features = _first_line_features(record)
    if features is None:
        return None
    p = record.get("show_probability")
    return Decided(features=features,
                   accepted=outcome != "REJECTED", accepted_chars=accepted_chars,
                   show_probability=1.0 if p is None else float(p), line_chars=chars)


def hidden_features(record: dict) -> tuple[float, ...] | None:
    """The features of the line the gate hid (an Episode with gate_shown false), or None for any other."""
    if record.get("gate_shown") is not False or not record.get("matched"):
        return None
    return _first_line_features(record)


def _first_line_features(record: dict) -> tuple[float, ...] | None:
    """The figures the door scored: those of the episode's first line (a multi-line one is cut by its tokens'
    text ends; None when an older episode has no ends to cut by), on the tokens' logprobs at the exploration
    temperature (``gate_logprobs``; the behaviour logprobs where they are the same, as the episode then
    leaves ``gate_logprobs`` empty, and in episodes written before)."""
    features = first_line_features(record.get("completion_text") or "", gate_logprobs(record),
                                   record.get("completion_token_ends") or [])
    return None if features is None else tuple(features)


def gate_logprobs(record: dict) -> list[float]:
    """The logprobs an episode's gate figures are made of. A greedy episode's behaviour logprobs are all 0 (a
    point mass): its ``gate_logprobs`` say how sure the model was, on the scale of the explored lines."""
    gate = record.get("gate_logprobs") or []
    behaviour = record.get("behaviour_logprobs") or []
    return list(gate) if gate and len(gate) == len(behaviour) else list(behaviour)


# -- off-policy estimates ---------------------------------------------------------------------------------


def estimate_show_rule(decided: Sequence[Decided], shows: Sequence[bool], *, level: float = 0.9,
                       prefix: str = "") -> dict[str, float]:
    """A show rule's figures on the logged decided lines, each weighed by 1 / its show probability.

    ``shows[i]``: whether the rule shows line i. accepted_chars (per request) = Σ w·c·show / Σ w;
    shown_share = Σ w·show / Σ w; accept_rate_shown = Σ w·accepted·show / Σ w·show; each with its interval
    (``_low``/``_high``) at ``level``. A figure with nothing to divide by is left out.
    """
    if len(shows) != len(decided):
        raise ValueError(f"{len(shows)} show decisions for {len(decided)} decided lines")
    w = [1.0 / max(d.show_probability, 1e-6) for d in decided]
    s = [1.0 if x else 0.0 for x in shows]
    ones = [1.0] * len(decided)
    figures = {
        "accepted_chars": ratio_estimate(w, [d.accepted_chars * x for d, x in zip(decided, s)], ones, level=level),
        "shown_share": ratio_estimate(w, s, ones, level=level, rate=True),
        "accept_rate_shown": ratio_estimate(w, [float(d.accepted) * x for d, x in zip(decided, s)], s, level=level,
                                            rate=True),
    }
    out: dict[str, float] = {}
    for name, interval in figures.items():
        if interval is not None:
            out[f"{prefix}{name}"] = interval.value
            out[f"{prefix}{name}_low"] = interval.low
            out[f"{prefix}{name}_high"] = interval.high
    return out


def evaluate_candidate(decided: Sequence[Decided], candidate_scores: Sequence[float], threshold: float, *,
                       serving: Gate | None = None, hidden_scores: Sequence[float] = (),
                       level: float = 0.9) -> dict[str, float]:
    """The OPE figures of a candidate (shows line i iff ``candidate_scores[i] >= threshold``) beside always-show
    and the serving gate, as GateVersion metrics: ``always_*``, ``gate_*``, ``serving_*`` (with a serving
    gate), ``keep_chars`` (the candidate's accepted characters over always-show's), ``lines``, ``ess`` (the
    weights' effective sample size), ``hidden`` and ``hidden_would_show`` (the share of the logged hidden
    lines, scored ``hidden_scores`` by the candidate, it would show: lines whose outcome the log cannot tell)."""
    out = {"lines": float(len(decided)), "hidden": float(len(hidden_scores)),
           "ess": effective_sample_size([1.0 / max(d.show_probability, 1e-6) for d in decided])}
    out.update(estimate_show_rule(decided, [True] * len(decided), level=level, prefix="always_"))
    out.update(estimate_show_rule(decided, [s >= threshold for s in candidate_scores], level=level, prefix="gate_"))
    if serving is not None:
        out.update(estimate_show_rule(decided, [serving.score(d.features) >= serving.threshold for d in decided],
                                      level=level, prefix="serving_"))
    if out.get("always_accepted_chars", 0.0) > 0:
        out["keep_chars"] = out.get("gate_accepted_chars", 0.0) / out["always_accepted_chars"]
        if serving is not None:
            out["serving_keep_chars"] = out.get("serving_accepted_chars", 0.0) / out["always_accepted_chars"]
    if len(hidden_scores):
        out["hidden_would_show"] = sum(s >= threshold for s in hidden_scores) / len(hidden_scores)
    return out


def expected_keep(decided: Sequence[Decided], scores: Sequence[float], shows: Sequence[bool]) -> float | None:
    """The share of the expected accepted characters (``scores`` × line characters, each line weighed by 1 / its
    show probability) held by the lines a rule ``shows``; None when there are none to keep."""
    w = [1.0 / max(d.show_probability, 1e-6) for d in decided]
    gains = [x * g for x, g in zip(w, kept_gains(decided, scores, "expected"))]
    total = sum(gains)
    if total <= 0:
        return None
    return sum(g for g, shown in zip(gains, shows) if shown) / total


def judge_candidate(decided: Sequence[Decided], fit: Fit, config: FitConfig, *, serving: Gate | None,
                    serving_version: int | None, hidden: Sequence[Sequence[float]] = ()
                    ) -> tuple[dict[str, float], str, str]:
    """(metrics, status, reason) of a fit candidate: its off-policy figures beside always-show and the serving
    gate (``evaluate_candidate`` on the cross-fitted scores), its AUCs, and the promotion decision with the kept
    characters counted as the fit counted them (``config.kept_by``)."""
    gate, crossed = fit.gate, list(fit.cross_fitted)
    y = [d.accepted for d in decided]
    w = [1.0 / max(d.show_probability, 1e-6) for d in decided]
    metrics = evaluate_candidate(decided, crossed, gate.threshold, serving=serving,
                                 hidden_scores=[gate.score(f) for f in hidden])
    for name, scores in (("auc_in_sample", [gate.score(d.features) for d in decided]), ("auc_cross_fitted", crossed)):
        auc = weighted_auc(scores, y, w)
        if auc is not None:
            metrics[name] = auc
    if config.kept_by == "expected":  # the candidate's cross-fitted scores are the probabilities for both gates
        shows = {"keep_chars_expected": [s >= gate.threshold for s in crossed]}
        if serving is not None:
            shows["serving_keep_chars_expected"] = [serving.score(d.features) >= serving.threshold for d in decided]
        for name, shown in shows.items():
            if (kept := expected_keep(decided, crossed, shown)) is not None:
                metrics[name] = kept
    metrics["episodes_used"] = float(len(decided))
    status, reason = promotion(metrics, keep=config.keep, serving_version=serving_version,
                               kept_by=config.kept_by)
    return metrics, status, reason


def promotion(metrics: dict[str, float], *, keep: float, serving_version: int | None,
              kept_by: str = "realised") -> tuple[str, str]:
    """(status, reason): PROMOTED when the candidate keeps ≥ ``keep`` of always-show's accepted characters
    (``keep_chars``, or ``keep_chars_expected`` when ``kept_by`` is expected: ``policy.show_gate.KEPT_BY``) and
    its accept rate among shown is not below the serving gate's (always-show's with none); else ROLLED_BACK.

    A serving gate that itself no longer keeps ``keep`` on the log as it now is (``serving_keep_chars``…; a
    gate fit on the first 50 lines may hide far more than its fit believed) is no bar: any candidate that keeps
    enough replaces it, though it shows more and so accepts a smaller share of what it shows. Without this an
    over-hiding first gate would stay for good, every candidate that corrects it rolled back for its lower
    accept rate."""
    key = "keep_chars_expected" if kept_by == "expected" else "keep_chars"
    kept = metrics.get(key)
    if kept is None:
        return "ROLLED_BACK", "no accepted characters in the log to keep"
    if kept < keep - 1e-12:
        return "ROLLED_BACK", f"keeps {kept:.3f} of always-show's accepted characters, {keep:.3f} needed"
    reference = "serving" if "serving_accept_rate_shown" in metrics else "always"
    label = ("always-show" if reference == "always"
             else f"gate v{serving_version}" if serving_version is not None else "the shared gate")
    serving_kept = metrics.get(f"serving_{key}")
    if serving_kept is not None and serving_kept < keep - 1e-12:
        return "PROMOTED", (f"keeps {kept:.3f} of the accepted characters; {label} keeps only "
                            f"{serving_kept:.3f} on the log as it now is")
    mine, theirs = metrics.get("gate_accept_rate_shown"), metrics.get(f"{reference}_accept_rate_shown")
    if mine is None:
        return "ROLLED_BACK", "shows none of the logged lines"
    if theirs is not None and mine < theirs - 1e-12:
        return "ROLLED_BACK", f"accept rate among shown {mine:.3f} < {label}'s {theirs:.3f}"
    return "PROMOTED", (f"keeps {kept:.3f} of the accepted characters; accept rate among shown {mine:.3f} "
                        f"(>= {label}'s {theirs if theirs is not None else 0.0:.3f})")


def weighted_auc(scores: Sequence[float], labels: Sequence[bool], weights: Sequence[float]) -> float | None:
    """P(score of an accepted line > score of a rejected one), pairs weighed by the product of their
    weights, ties counting a half; None without both classes."""
    s, y, w = np.asarray(scores, float), np.asarray(labels, bool), np.asarray(weights, float)
    pos, neg = s[y], s[~y]
    if len(pos) == 0 or len(neg) == 0:
        return None
    wp, wn = w[y], w[~y]
    greater = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
    return float(wp @ greater @ wn / (wp.sum() * wn.sum()))


def fit_due(lines: int, new: int, *, serving: bool, min_decided: int, refit_every: int,
            policy_moved: bool = False) -> bool:
    """Whether the learner fits a candidate now, with ``lines`` decided lines in its window, ``new`` of them
    added since the last fit (a fit that made no gate, for one outcome, counts).

    Nothing before ``min_decided`` lines. A promoted weight version (``policy_moved``) is a refit at once: it
    moves the logprobs the features are made of. While no gate serves, a fit is tried on every new line, not
    every ``refit_every``: each candidate is judged against always-show, a rolled-back first one costs a few
    milliseconds, and the gate is the policy's fastest lever on what users see (waiting ``refit_every`` lines
    after a rolled-back first candidate is ~20 s of traffic; the loop's first gate came 72 s after the first
    feedback that way). Once one serves, a refit every ``refit_every`` new lines."""
    if lines < min_decided:
        return False
    return policy_moved or new >= (refit_every if serving else 1)


# -- gate versions on the topic ------------------------------------------------------------------------------


def next_gate_version(records: Iterable[dict], project: str) -> int:
    return max(latest_statuses(records, project), default=0) + 1


def gate_event(gate: Gate, *, status: str, reason: str, parent_version: int | None, episodes_used: int,
               metrics: dict[str, float]) -> Event:
    return new_event("GateVersion", **gate.as_record(), parent_version=parent_version, episodes_used=episodes_used,
                     metrics={k: float(v) for k, v in metrics.items() if v is not None and np.isfinite(v)},
                     status=status, reason=reason)


def restated(record: dict, status: str, reason: str) -> Event:
    """A GateVersion record again with a new status (a rollback)."""
    fields = {k: v for k, v in record.items() if k not in ("event_id", "created_at", "status", "reason")}
    return new_event("GateVersion", **fields, status=status, reason=reason)


# -- the learner ---------------------------------------------------------------------------------------------


@dataclass
class Window:
    """One gate's lines: the newest decided ones and the newest hidden ones."""

    size: int
    decided: deque = field(default_factory=deque)
    """(event id, joined_at ms, Decided), oldest first."""
    hidden: deque = field(default_factory=deque)
    ids: set = field(default_factory=set)
    new: int = 0
    """Decided lines added since the last fit (or, before it, since the newest gate version's creation)."""
    added: int = 0
    """Decided lines ever added (the window drops the oldest; this only grows)."""
    fitted_policy: int | None = None

    def add(self, event_id: str, joined_ms: int, decided: Decided) -> bool:
        if event_id in self.ids:
            return False
        self.ids.add(event_id)
        self.decided.append((event_id, joined_ms, decided))
        if len(self.decided) > self.size:
            self.ids.discard(self.decided.popleft()[0])
        self.new += 1
        self.added += 1
        return True

    def add_hidden(self, features: tuple[float, ...]) -> None:
        self.hidden.append(features)
        if len(self.hidden) > self.size:
            self.hidden.popleft()


class GateLearner:
    """Per-project windows of decided lines, and the GateVersion events their refits make (no I/O here: the
    thread below reads the topics into it and publishes what it returns)."""

    def __init__(self, settings, base_model: str, *, specs: RewardSpecs | None = None):
        self.settings = settings
        self.base_model = base_model
        self.specs = specs or RewardSpecs.from_settings(settings)
        self.config = FitConfig.from_settings(settings)
        self.windows: dict[str, Window] = {}
        self.gate_records: list[dict] = []
        self._gate_ids: set[str] = set()
        self.weight_records: list[dict] = []
        self._weight_ids: set[str] = set()
        self.caught_up = False
        """False while reading the history at start: lines are kept, nothing is fit (a restart would
        otherwise publish a version every ``gate_refit_every`` lines of the past)."""

    def _projects_of(self, project: str) -> list[str]:
        return ["", project] if self.settings.has_project_policy(project) else [""]

    def _window(self, project: str) -> Window:
        if project not in self.windows:
            self.windows[project] = Window(self.settings.gate_window)
        return self.windows[project]

    # -- what the topics bring --

    def add_episode(self, record: dict) -> bool:
        """Keep an Episode's line if it is a decided one (or a hidden one); whether it was a new decided line."""
        project = record.get("project_id") or ""
        hidden = hidden_features(record)
        if hidden is not None:
            for p in self._projects_of(project):
                self._window(p).add_hidden(hidden)
            return False
        decided = decided_from_episode(record, self.specs)
        if decided is None:
            return False
        joined = _millis(record.get("joined_at"))
        added = False
        for p in self._projects_of(project):
            added |= self._window(p).add(record["event_id"], joined, decided)
        return added

    def add_gate_record(self, record: dict) -> None:
        if record["event_id"] not in self._gate_ids:
            self._gate_ids.add(record["event_id"])
            self.gate_records.append(record)

    def add_weight_record(self, record: dict) -> None:
        if record["event_id"] not in self._weight_ids and record.get("base_model") == self.base_model:
            self._weight_ids.add(record["event_id"])
            self.weight_records.append(record)

    def mark_caught_up(self) -> None:
        """The history is read: a line counts as new for the next refit when it was joined after the newest
        gate version of its window was created (what a refit before the restart had not seen)."""
        self.caught_up = True
        for project, window in self.windows.items():
            versions = latest_statuses(self.gate_records, project)
            newest = max(versions.values(), key=lambda r: r["version"]) if versions else None
            if newest is None:
                window.new = len(window.decided)
                continue
            since = _millis(newest["created_at"])
            window.new = sum(1 for _, joined, _ in window.decided if joined > since)
            window.fitted_policy = int(newest.get("policy_version") or 0)

    # -- what a refit needs --

    def policy_version(self, project: str) -> int:
        """The weight version serving the project: its own promoted version, else the shared one."""
        own = promoted_version(self.weight_records, self.base_model, project) if project else 0
        return own or promoted_version(self.weight_records, self.base_model)

    def serving_gate(self, project: str) -> tuple[Gate | None, int | None]:
        """(the gate serving the project, its version if it is the project's own): its own, else the shared."""
        own = serving_gate_record(self.gate_records, project)
        record = own or (serving_gate_record(self.gate_records, "") if project else None)
        if record is None:
            return None, None
        return Gate.from_record(record), record["version"] if own else None

    def due(self, project: str) -> bool:
        window = self.windows.get(project)
        if not self.caught_up or window is None:
            return False
        moved = window.fitted_policy is not None and window.fitted_policy != self.policy_version(project)
        return fit_due(len(window.decided), window.new, serving=self.serving_gate(project)[0] is not None,
                       min_decided=self.config.min_decided, refit_every=self.settings.gate_refit_every,
                       policy_moved=moved)

    def refit_due(self) -> list[Event]:
        """A GateVersion event for each window whose refit is due and that could be fit."""
        return [e for p in list(self.windows) if self.due(p) and (e := self.refit(p)) is not None]

    def refit(self, project: str) -> Event | None:
        """Fit the project's window, estimate the candidate off-policy and decide it; None when the window
        cannot make a gate yet (too few lines, or of one outcome). The event is kept as if read back."""
        window = self.windows[project]
        decided = [d for _, _, d in window.decided]
        policy = self.policy_version(project)
        version = next_gate_version(self.gate_records, project)
        fit = fit_gate(decided, self.config, version=version, project_id=project, policy_version=policy)
        window.new = 0
        window.fitted_policy = policy
        if fit is None:
            return None
        gate = fit.gate
        serving, serving_version = self.serving_gate(project)
        metrics, status, reason = judge_candidate(
            decided, fit, self.config, serving=serving,
            serving_version=serving_version if serving is not None else None, hidden=window.hidden)
        if serving is not None and serving_version is None:
            reason += " (compared with the shared gate)"
        event = gate_event(gate, status=status, reason=reason, parent_version=serving_version,
                           episodes_used=len(decided), metrics=metrics)
        self.add_gate_record(event.record)
        log.info("gate%s v%d %s: threshold %.3f on %d lines, cross-fitted AUC %s: %s",
                 f" of project {project}" if project else "", version, status, gate.threshold, len(decided),
                 f"{metrics['auc_cross_fitted']:.3f}" if "auc_cross_fitted" in metrics else "-", reason)
        return event


class GateLearnerThread:
    """The learner at the head of the topics, in a thread of the trainer process.

    One consumer of its own, no group and nothing committed: episodes (every partition), tabloop.weights and
    tabloop.gates, all from their start, so a restart refits from the history; nothing is fit until the
    positions reach the ends the topics had at start (``GateLearner.caught_up``). Events go out through the
    trainer's producer and are flushed at once: feedback → a served gate is the join's delay, one poll here
    (``POLL_S``), a fit (milliseconds) and the serving replicas' own poll.
    """

    POLL_S = 0.2

    def __init__(self, settings, base_model: str, producer, *, topic: str | None = None):
        self.settings = settings
        self.learner = GateLearner(settings, base_model)
        self.producer = producer
        self.codec = make_codec(settings)
        self.topics = (topic or EPISODES.name, WEIGHTS.name, GATES.name)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run_logged, name="tabloop-gate-learner", daemon=True)
        self.published = 0
        self.error: BaseException | None = None

    def start(self) -> "GateLearnerThread":
        self.thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    def _run_logged(self) -> None:
        try:
            self.run()
        except Exception as exc:  # the PPO loop goes on without a gate learner; the log says why
            self.error = exc
            log.exception("gate learner stopped")

    def _assignment(self, consumer):
        """Every partition of the three topics from its start, and the end each had (the history to read)."""
        starts, ends = [], {}
        while not self.stop_event.is_set():
            try:
                for topic in self.topics:
                    meta = consumer.list_topics(topic, timeout=5).topics.get(topic)
                    if meta is None or meta.error is not None:
                        raise LookupError(f"topic {topic} is not there yet")
                    for p in sorted(meta.partitions):
                        low, high = watermark_offsets(consumer, TopicPartition(topic, p))
                        starts.append(TopicPartition(topic, p, low))
                        if high > low:
                            ends[(topic, p)] = high
                return starts, ends
            except Exception as exc:  # the broker restarting, a topic not created yet: the trainer waits too
                log.warning("gate learner: cannot read %s yet (%s); trying again", self.topics, exc)
                starts, ends = [], {}
                self.stop_event.wait(2.0)
        return [], {}

    def run(self) -> None:
        consumer = Consumer({"bootstrap.servers": self.settings.kafka_bootstrap, "group.id": "tabloop-gate-learner",
                             "enable.auto.commit": False, "log_level": 3})
        episodes, weights, gates = self.topics
        try:
            starts, behind = self._assignment(consumer)
            if not starts:
                return
            consumer.assign(starts)
            if not behind:
                self.learner.mark_caught_up()
            while not self.stop_event.is_set():
                for m in consumer.consume(500, self.POLL_S):
                    try:
                        received = decode_message(self.codec, m)
                    except KafkaException as exc:  # a broker error: librdkafka retries, the reading goes on
                        log.warning("gate learner: %s", exc)
                        continue
                    if received is None:
                        continue
                    if received.event is not None:
                        record = received.event.record
                        if received.topic == episodes:
                            self.learner.add_episode(record)
                        elif received.topic == weights:
                            self.learner.add_weight_record(record)
                        elif received.topic == gates:
                            self.learner.add_gate_record(record)
                    key = (received.topic, received.partition)
                    if key in behind and received.offset + 1 >= behind[key]:  # after its record is kept
                        del behind[key]
                        if not behind:
                            self.learner.mark_caught_up()
                            log.info("gate learner: history read (%s)", {p: len(w.decided)
                                                                         for p, w in self.learner.windows.items()})
                events = self.learner.refit_due()
                for event in events:
                    self.producer.publish(event)
                if events:
                    self.producer.flush()
                    self.published += len(events)
        finally:
            consumer.close()


__all__ = ["GateLearner", "GateLearnerThread", "decided_from_episode", "estimate_show_rule", "evaluate_candidate",
           "promotion", "weighted_auc"]
