"""HTTP plumbing shared by both apps: bounded JSON bodies, errors that name the problem."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from infra.http_server import BodyRefused, read_body

# Input caps. Text (prompts, completions) is bounded by the body cap and by what one event may hold
# (serving/publisher.py); everything else has a cap of its own, so no id or name can grow an event or a
# Kafka key past what the broker takes.
MAX_JSON_DEPTH = 32
"""Nesting a body may have: our payloads are 3 deep; Python's parser recurses per level."""
MAX_ID_CHARS = 128
"""Completion ids (ours are 37 characters), Continue's uuids, key ids."""
MAX_NAME_CHARS = 256
"""Model names, providers, event names, schema versions, user tags, stop strings."""
MAX_PATH_CHARS = 4096
"""File paths (Linux's PATH_MAX)."""


class HTTPProblem(Exception):
    """A request we refuse; becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, headers: dict | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.kind = status, message, param, headers, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


async def read_json(request: Request, max_bytes: int, timeout_s: float | None = None) -> Any:
    """The request's JSON body: 413 past ``max_bytes`` (without reading it all), 408 when it has not all
    arrived within ``timeout_s``, 400 if it is not JSON, nests deeper than MAX_JSON_DEPTH, or has a string
    that is not Unicode text (a lone surrogate: no UTF-8 encoder, Kafka's Avro codec included, takes it)."""
    try:
        body = await read_body(request, max_bytes, timeout_s)
    except BodyRefused as refused:
        raise HTTPProblem(refused.status, refused.message, headers=refused.headers) from None
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise HTTPProblem(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPProblem(400, f"request body is not valid JSON: {exc}") from None
    check_json(value)
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")  # Python's parser takes NaN and Infinity; JSON has neither


def check_json(value: Any) -> None:
    """400 for JSON nested deeper than MAX_JSON_DEPTH or holding a lone surrogate in a string or a key.

    Iterative, so it never recurses however deep the value; the path in the message names the place."""
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, path)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise HTTPProblem(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels (at '{path}')",
                              param=path or None)
        if isinstance(item, dict):
            for key, child in item.items():
                where = f"{path}.{key}" if path else key
                _check_text(key, where)
                stack.append((child, where, depth + 1))
        else:
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        where = f"'{_printable(path)}'" if path else "the body"
        raise HTTPProblem(400, f"{where} has a lone surrogate (\\u{ord(bad):04x}) at character {exc.start}: "
                               "not Unicode text", param=_printable(path) or None) from None


def _printable(path: str) -> str:
    # The path may itself hold the surrogate (a key); the error must still be encodable.
    return path.encode("utf-8", "backslashreplace").decode("utf-8")


def field(body: dict, name: str, kinds: type | tuple[type, ...], *, required: bool = False, default: Any = None,
          where: str = "", max_chars: int | None = None) -> Any:
    """``body[name]`` checked against ``kinds`` (and, for a string, ``max_chars``); 400 naming the field when
    missing, mistyped or too long."""
    label = f"{where}{name}"
    if name not in body or body[name] is None:
        if required:
            raise HTTPProblem(400, f"'{label}' is required", param=label)
        return default
    value = body[name]
    # bool is an int in Python; a JSON true is not a number.
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise HTTPProblem(400, f"'{label}' must be {_kind_names(kinds)}, not a boolean", param=label)
    if not isinstance(value, kinds):
        raise HTTPProblem(400, f"'{label}' must be {_kind_names(kinds)}, not {type(value).__name__}", param=label)
    if max_chars is not None and isinstance(value, str):
        check_length(value, label, max_chars)
    return value


def check_length(value: str, label: str, max_chars: int) -> str:
    """``value``, or 400 naming ``label`` when it is over ``max_chars`` characters."""
    if len(value) > max_chars:
        raise HTTPProblem(400, f"'{label}' is {len(value)} characters long; at most {max_chars} are allowed",
                          param=label)
    return value


def _kind_names(kinds) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "a list",
             dict: "an object"}
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


class SSEResponse:
    """Server-sent events from an async iterator of ``data:`` payloads, ending with ``data: [DONE]``.

    Unlike a plain streaming response it notices the client going away while
    the iterator is waiting, and closes the iterator at once, so generation
    stops and the iterator's cleanup (recording an aborted completion) runs
    deterministically. The headers are computed after the first payload
    exists, so they can say what produced it (the policy version). It never
    sends ``:`` comments: Continue ends the stream at a ``: ping`` line.
    """

    media_type = "text/event-stream"

    def __init__(self, payloads, headers=None):
        self.payloads = payloads
        self.headers = headers if callable(headers) else (lambda: headers or {})

    async def __call__(self, scope, receive, send) -> None:
        import anyio

        async def send_start() -> None:
            raw = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
            raw += [(k.lower().encode(), v.encode()) for k, v in self.headers().items()]
            await send({"type": "http.response.start", "status": 200, "headers": raw})

        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            started = False
            try:
                async for payload in self.payloads:
                    if not started:
                        await send_start()
                        started = True
                    await send({"type": "http.response.body", "body": b"data: " + payload + b"\n\n",
                                "more_body": True})
                if not started:
                    await send_start()
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            except OSError:  # the socket went away mid-send
                pass
            finally:
                # Close the generator here, inside our task (cancelled or not), so its cleanup runs now.
                with anyio.CancelScope(shield=True):
                    await self.payloads.aclose()
                tg.cancel_scope.cancel()
