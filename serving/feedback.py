"""Feedback ingest: three payload shapes, one FeedbackReceived event. Pure parsing, no I/O.

- ``/api/training/submit`` — the Continue fork's flat payload (the reference recipe);
- ``/api/continue/events`` — stock Continue's ``data:`` destination;
- ``/v1/feedback`` — our own API, with our completion id.
"""

from __future__ import annotations

import hashlib
import json
import math

from schemas.events import Event, new_event
from serving.http import MAX_ID_CHARS, MAX_NAME_CHARS, MAX_PATH_CHARS, HTTPProblem, field

# The fork's string fields and their length caps (None: text, bounded by the body and event size limits).
FORK_TEXT_FIELDS = {"completionId": MAX_ID_CHARS, "filepath": MAX_PATH_CHARS, "prefix": None, "suffix": None,
                    "prompt": None, "completion": None, "modelProvider": MAX_NAME_CHARS,
                    "modelName": MAX_NAME_CHARS, "uniqueId": MAX_ID_CHARS}
OUTCOMES = ("ACCEPTED", "REJECTED", "PARTIAL")


MAX_MILLIS = 2**63 - 1  # an Avro long


def _millis(value, label: str) -> int | None:
    """A duration in ms as the event stores it (a long): finite, not negative, fits 64 bits; else 400."""
    if value is None:
        return None
    if not math.isfinite(value) or not 0 <= value <= MAX_MILLIS:
        raise HTTPProblem(400, f"'{label}' must be a number of milliseconds from 0 to {MAX_MILLIS}", param=label)
    return int(value)


def _sha(text: str | None) -> str | None:
    return hashlib.sha256(text.encode()).hexdigest() if text is not None else None


def _check_object(body) -> dict:
    if not isinstance(body, dict):
        raise HTTPProblem(400, "request body must be a JSON object")
    return body


def _continue_feedback(data: dict, *, where: str, source: str, project_id: str, user_id: str,
                       raw: dict) -> Event:
    """The fields the fork payload and the data: event share."""
    for name, max_chars in FORK_TEXT_FIELDS.items():
        field(data, name, str, where=where, max_chars=max_chars)
    accepted = field(data, "accepted", bool, required=True, where=where)
    # Continue's `time` is how long it took to generate the suggestion (CompletionProvider sets it then;
    # AutocompleteLoggingService never updates it on accept or reject): not a time to decision.
    client_time_ms = _millis(field(data, "time", (int, float), where=where), f"{where}time")
    field(data, "numLines", int, where=where)
    cache_hit = field(data, "cacheHit", bool, default=False, where=where)
    prompt, completion = data.get("prompt"), data.get("completion")
    return new_event(
        "FeedbackReceived", project_id=project_id, user_id=user_id, source=source, completion_id=None,
        client_completion_id=data.get("completionId"), prompt=prompt, prompt_sha256=_sha(prompt),
        completion=completion, outcome="ACCEPTED" if accepted else "REJECTED",
        accepted_chars=len(completion) if accepted and completion is not None else None,
        client_time_ms=client_time_ms, cache_hit=cache_hit,
        filepath=data.get("filepath"), model_name=data.get("modelName"), raw_payload=json.dumps(raw),
    )


def from_fork(body, *, project_id: str, user_id: str) -> Event:
    """``POST /api/training/submit``: the Continue fork's ``completionTrackingUrl`` payload."""
    body = _check_object(body)
    return _continue_feedback(body, where="", source="continue-fork", project_id=project_id, user_id=user_id,
                              raw=body)


def from_continue_data(body, *, project_id: str, user_id: str) -> Event | None:
    """``POST /api/continue/events``: stock Continue's data destination; None for non-autocomplete events.

    ``level: noCode`` payloads carry no code: they become outcome-only feedback
    (prompt and completion null), counted in analytics, never trained on.
    """
    body = _check_object(body)
    name = field(body, "name", str, required=True, max_chars=MAX_NAME_CHARS)
    data = field(body, "data", dict, required=True)
    field(body, "schema", str, max_chars=MAX_NAME_CHARS)
    field(body, "level", str, max_chars=MAX_NAME_CHARS)
    if name != "autocomplete":
        return None
    return _continue_feedback(data, where="data.", source="continue-data", project_id=project_id,
                              user_id=user_id, raw=body)


def from_api(body, *, project_id: str, user_id: str) -> Event:
    """``POST /v1/feedback``: ``{completion_id, accepted | outcome, accepted_text?}``."""
    body = _check_object(body)
    completion_id = field(body, "completion_id", str, required=True, max_chars=MAX_ID_CHARS)
    accepted = field(body, "accepted", bool)
    outcome = field(body, "outcome", str, max_chars=MAX_NAME_CHARS)
    accepted_text = field(body, "accepted_text", str)
    if outcome is not None:
        outcome = outcome.upper()
        if outcome not in OUTCOMES:
            raise HTTPProblem(400, f"'outcome' must be one of {', '.join(OUTCOMES)}", param="outcome")
        if accepted is not None and (accepted != (outcome != "REJECTED")):
            raise HTTPProblem(400, "'accepted' contradicts 'outcome'", param="accepted")
    elif accepted is not None:
        outcome = "ACCEPTED" if accepted else "REJECTED"
    else:
        raise HTTPProblem(400, "one of 'accepted' or 'outcome' is required", param="accepted")
    if outcome == "PARTIAL" and accepted_text is None:
        raise HTTPProblem(400, "'accepted_text' is required for a PARTIAL outcome", param="accepted_text")
    return new_event(
        "FeedbackReceived", project_id=project_id, user_id=user_id, source="api", completion_id=completion_id,
        completion=accepted_text, outcome=outcome,
        accepted_chars=len(accepted_text) if accepted_text is not None else None,
        time_to_decision_ms=_millis(field(body, "time_to_decision_ms", int), "time_to_decision_ms"),
        raw_payload=json.dumps(body),
    )
