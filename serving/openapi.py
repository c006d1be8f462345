"""The OpenAPI 3 description of the front door's two apps, served at ``/openapi.json`` by each.

Written by hand from the parsers (``serving.completions.parse_completion_request``,
``serving.feedback``), so it says what the server really accepts; the
schemathesis test fuzzes a live front door against it, and fails on a 5xx or on
a response that does not match what is written here.
"""

from __future__ import annotations

from infra.settings import Settings
from serving.completions import MAX_STOP_WORDS
from serving.feedback import OUTCOMES
from serving.http import MAX_ID_CHARS, MAX_JSON_DEPTH, MAX_NAME_CHARS, MAX_PATH_CHARS

ID = {"type": "string", "maxLength": MAX_ID_CHARS}
NAME = {"type": "string", "maxLength": MAX_NAME_CHARS}
PATH = {"type": "string", "maxLength": MAX_PATH_CHARS}

ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": "string", "nullable": True},
        "code": {"type": "integer"}}}},
}


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


REFUSALS = {
    "400": _error("the body is not JSON, nests deeper than "
                  f"{MAX_JSON_DEPTH} levels, has a string that is not Unicode text (a lone surrogate), or a "
                  "field is missing, wrong or too long; `error.param` names it"),
    "408": _error("the body did not all arrive within TABLOOP_BODY_TIMEOUT_S"),
    "401": _error("no API key, or an unknown or revoked one"),
    "403": _error("X-Project-ID names a project the key does not belong to"),
    "413": _error("the body is over TABLOOP_MAX_BODY_BYTES, or the event it makes would be over what one "
                  "Kafka message holds"),
    "429": _error("the key's rate limit; Retry-After says when to retry"),
}

PROJECT_HEADER = {"name": "X-Project-ID", "in": "header", "required": False,
                  "description": "the project the caller means; refused (403) unless it is the key's",
                  "schema": {"type": "string"}}

CHOICE = {"type": "object", "required": ["text", "index", "finish_reason"], "properties": {
    "text": {"type": "string"}, "index": {"type": "integer"},
    "finish_reason": {"type": "string", "nullable": True, "enum": ["stop", "length", "abort", None]},
    "logprobs": {"type": "object", "nullable": True, "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": {"type": "number"}}}},
    "token_ids": {"type": "array", "items": {"type": "integer"}}}}

COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": {"type": "string", "pattern": "^cmpl-", "description": "our completion id: send it back as feedback"},
    "object": {"type": "string", "enum": ["text_completion"]}, "created": {"type": "integer"},
    "model": {"type": "string"}, "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": CHOICE},
    "usage": {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
              "properties": {k: {"type": "integer", "minimum": 0}
                             for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}}}

# Mistral's FIM answer: a chat completion (``message`` whole, ``delta`` streamed), with ``text`` as well.
FIM_CHOICE = {**CHOICE, "properties": {**CHOICE["properties"], **{part: {
    "type": "object", "properties": {"role": {"type": "string", "enum": ["assistant"]}, "content": {"type": "string"}}}
    for part in ("message", "delta")}}}
FIM_COMPLETION = {**COMPLETION, "properties": {
    **COMPLETION["properties"], "object": {"type": "string", "enum": ["chat.completion", "chat.completion.chunk"]},
    "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": FIM_CHOICE}}}

COMPLETION_REQUEST = {
    "type": "object", "required": ["prompt"], "additionalProperties": True,
    "description": "OpenAI's legacy completions request, as Continue sends it (other fields are ignored)",
    "properties": {
        "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                              "maxItems": 1}],
                   "description": "the exact text (Continue builds the FIM prompt itself); prompts over "
                                  "TABLOOP_MAX_PROMPT_TOKENS lose the top of their prefix"},
        "suffix": {"type": "string", "description": "text after the cursor: the FIM prompt is built here"},
        "model": NAME,
        "max_tokens": {"type": "integer", "minimum": 1, "default": 16,
                       "description": "capped at TABLOOP_MAX_NEW_TOKENS"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1},
        "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1, "default": 1},
        "stop": {"oneOf": [NAME, {"type": "array", "items": NAME, "maxItems": MAX_STOP_WORDS}]},
        "n": {"type": "integer", "enum": [1]},
        "echo": {"type": "boolean", "enum": [False]},
        "logprobs": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "boolean"}]},
        "seed": {"type": "integer", "minimum": -2**63, "maximum": 2**63 - 1},
        "stream": {"type": "boolean", "default": False},
        "return_token_ids": {"type": "boolean", "default": False},
        "user": NAME,
        "stream_options": {"type": "object", "properties": {"include_usage": {
            "type": "boolean", "default": False,
            "description": "streamed: a last chunk with no choices carries `usage`"}}},
    },
}

FIM_REQUEST = {
    "type": "object", "required": ["prompt"], "additionalProperties": True,
    "description": "Mistral's FIM request, as openai-adapters' fimStream and Continue's FIM providers send it "
                   "(other fields are ignored)",
    "properties": {
        **{k: COMPLETION_REQUEST["properties"][k] for k in ("model", "max_tokens", "temperature", "top_p", "stop",
                                                             "stream", "stream_options", "seed", "user")},
        "prompt": {"type": "string", "minLength": 1, "description": "the text before the cursor"},
        "suffix": {"type": "string", "default": "", "description": "the text after the cursor"},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "description": "stands for max_tokens"},
        "random_seed": {"type": "integer", "minimum": -2**63, "maximum": 2**63 - 1, "description": "stands for seed"},
    },
}

FORK_FIELDS = {
    "completionId": {**ID, "description": "Continue's own uuid for the suggestion"},
    "filepath": PATH, "prefix": {"type": "string"}, "suffix": {"type": "string"},
    "prompt": {"type": "string"}, "completion": {"type": "string", "description": "the text as the IDE showed it"},
    "modelProvider": NAME, "modelName": NAME, "uniqueId": ID,
    "accepted": {"type": "boolean"}, "time": {"type": "number", "minimum": 0, "maximum": 2**63 - 1,
             "description": "ms Continue took to generate the suggestion (not to the decision)"},
    "numLines": {"type": "integer"}, "cacheHit": {"type": "boolean"}, "timestamp": {"type": "string"},
}
FORK_PAYLOAD = {"type": "object", "required": ["accepted"], "properties": FORK_FIELDS, "additionalProperties": True}

CONTINUE_EVENT = {
    "type": "object", "required": ["name", "data"], "additionalProperties": True,
    "description": "stock Continue's `data:` destination; events other than autocomplete are acknowledged and "
                   "ignored",
    "properties": {"name": NAME, "data": {"type": "object", "additionalProperties": True,
                                          "properties": FORK_FIELDS},
                   "schema": NAME, "level": NAME, "profileId": {"type": "string"}},
}

def _outcomes(*names: str) -> dict:
    return {"type": "string", "enum": [v for n in names for v in (n, n.lower())]}


API_FEEDBACK = {
    "type": "object", "required": ["completion_id"], "additionalProperties": True,
    "description": "our own feedback on one of our completion ids: `accepted`, or `outcome` (PARTIAL with "
                   "`accepted_text`, the part kept), or both when they agree",
    "properties": {"completion_id": ID, "accepted": {"type": "boolean"},
                   "outcome": _outcomes(*OUTCOMES), "accepted_text": {"type": "string"},
                   "time_to_decision_ms": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}},
    "oneOf": [
        {"required": ["accepted"], "not": {"required": ["outcome"]}},
        {"required": ["outcome"], "not": {"required": ["accepted"]},
         "properties": {"outcome": _outcomes("ACCEPTED", "REJECTED")}},
        {"required": ["outcome", "accepted_text"], "not": {"required": ["accepted"]},
         "properties": {"outcome": _outcomes("PARTIAL")}},
        {"required": ["accepted", "outcome"],
         "properties": {"accepted": {"type": "boolean", "enum": [True]}, "outcome": _outcomes("ACCEPTED")}},
        {"required": ["accepted", "outcome"],
         "properties": {"accepted": {"type": "boolean", "enum": [False]}, "outcome": _outcomes("REJECTED")}},
        {"required": ["accepted", "outcome", "accepted_text"],
         "properties": {"accepted": {"type": "boolean", "enum": [True]}, "outcome": _outcomes("PARTIAL")}},
    ],
}

ACCEPTED = {"description": "stored durably (on Kafka, or in the local spool until Kafka is back)", "content": {
    "application/json": {"schema": {"type": "object", "required": ["event_id"], "properties": {
        "event_id": {"type": "string", "nullable": True, "description": "null when the event was ignored"},
        "stored": {"type": "string"}, "ignored": {"type": "string", "nullable": True}}}}}}


def _json_body(schema_ref: str) -> dict:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": schema_ref}}}}


def _completion_route(operation: str, summary: str, request: str, answer: str, stream_note: str = "") -> dict:
    """A completion route: ``request`` in, ``answer`` back whole, or its chunks as server-sent events."""
    stream = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
              "description": f"each event's data is a {answer} chunk as JSON; the last is [DONE]."
                             + (f" {stream_note}" if stream_note else "")}
    return {"post": {
        "operationId": operation, "summary": summary, "parameters": [PROJECT_HEADER],
        "requestBody": _json_body(f"#/components/schemas/{request}"),
        "responses": {"200": {"description": "the completion; headers X-Tabloop-Completion-Id and "
                                             "X-Tabloop-Policy-Version",
                              "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{answer}"}},
                                          "text/event-stream": {"schema": stream}}},
                      **REFUSALS}}}


def _common_paths() -> dict:
    plain = {"security": []}
    return {
        "/healthz": {"get": {**plain, "operationId": "healthz", "summary": "the process answers",
                             "responses": {"200": {"description": "alive", "content": {"application/json": {
                                 "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}}}}}},
        "/readyz": {"get": {**plain, "operationId": "readyz", "summary": "model loaded and events writable",
                            "responses": {code: {"description": what, "content": {"application/json": {"schema": {
                                "type": "object", "required": ["ready", "policy_version"], "properties": {
                                    "ready": {"type": "boolean"}, "model": {"type": "boolean"},
                                    "events": {"type": "boolean"}, "policy_version": {"type": "integer"}}}}}}
                                for code, what in (("200", "ready"), ("503", "not ready yet"))}}},
        "/metrics": {"get": {**plain, "operationId": "metrics", "summary": "Prometheus metrics",
                             "responses": {"200": {"description": "text exposition format",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {**plain, "operationId": "openapi", "summary": "this description",
                                  "responses": {"200": {"description": "OpenAPI 3", "content": {
                                      "application/json": {"schema": {"type": "object"}}}}}}},
    }


def _document(title: str, settings: Settings, port: int, paths: dict, schemas: dict) -> dict:
    return {
        "openapi": "3.0.3",
        "info": {"title": title, "version": "1",
                 "description": "tabloop's front door. Every route but the health, metrics and this description "
                                "needs an API key (`Authorization: Bearer <key>` or `api-key: <key>`) from "
                                f"`tabloop keys add`. Request bodies over {settings.max_body_bytes} bytes get 413."},
        "servers": [{"url": f"http://{settings.serve_host}:{port}"}],
        "security": [{"bearer": []}, {"apiKey": []}],
        "paths": {**paths, **_common_paths()},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "api-key"}},
            "schemas": {"Error": ERROR, **schemas},
        },
    }


def completions_document(settings: Settings, port: int | None = None) -> dict:
    paths = {
        "/v1/completions": _completion_route(
            "createCompletion", "a code completion (streamed as server-sent events when `stream` is true)",
            "CompletionRequest", "Completion", "Never a comment line (Continue ends at `: ping`)"),
        "/v1/fim/completions": _completion_route(
            "createFimCompletion", "a code completion between a prefix and a suffix, Mistral's FIM API (streamed "
                                   "when `stream` is true)", "FimRequest", "FimCompletion"),
        "/v1/models": {"get": {
            "operationId": "listModels", "summary": "the model being served and its policy version",
            "parameters": [PROJECT_HEADER],
            "responses": {"200": {"description": "one model", "content": {"application/json": {"schema": {
                "type": "object", "required": ["data"], "properties": {"object": {"type": "string"}, "data": {
                    "type": "array", "items": {"type": "object", "required": ["id", "policy_version"], "properties": {
                        "id": {"type": "string"}, "policy_version": {"type": "integer"}}}}}}}}},
                **{k: v for k, v in REFUSALS.items() if k in ("401", "403", "429")}}}},
    }
    return _document("tabloop completions", settings, port or settings.completions_port, paths,
                     {"CompletionRequest": COMPLETION_REQUEST, "Completion": COMPLETION, "FimRequest": FIM_REQUEST,
                      "FimCompletion": FIM_COMPLETION})


def feedback_document(settings: Settings, port: int | None = None) -> dict:
    def ingest(op: str, summary: str, schema: str) -> dict:
        return {"post": {"operationId": op, "summary": summary, "parameters": [PROJECT_HEADER],
                         "requestBody": _json_body(f"#/components/schemas/{schema}"),
                         "responses": {"202": ACCEPTED, **REFUSALS}}}

    paths = {
        "/api/training/submit": ingest("forkFeedback", "the Continue fork's completionTrackingUrl", "ForkPayload"),
        "/api/continue/events": ingest("continueEvent", "stock Continue's data: destination", "ContinueEvent"),
        "/v1/feedback": ingest("apiFeedback", "feedback on one of our completion ids", "ApiFeedback"),
    }
    return _document("tabloop feedback", settings, port or settings.feedback_port, paths,
                     {"ForkPayload": FORK_PAYLOAD, "ContinueEvent": CONTINUE_EVENT, "ApiFeedback": API_FEEDBACK})
