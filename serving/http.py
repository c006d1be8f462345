"""HTTP plumbing shared by both apps: bounded JSON bodies, errors that name the problem."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse


class HTTPProblem(Exception):
    """A request we refuse; becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, headers: dict | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.kind = status, message, param, headers, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request's JSON body; 413 past ``max_bytes`` (without reading it all), 400 if not JSON."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPProblem(413, f"request body of {declared} bytes is over the {max_bytes}-byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise HTTPProblem(413, f"request body is over the {max_bytes}-byte limit")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPProblem(400, f"request body is not valid JSON: {exc}") from None


def field(body: dict, name: str, kinds: type | tuple[type, ...], *, required: bool = False, default: Any = None,
          where: str = "") -> Any:
    """``body[name]`` checked against ``kinds``; 400 naming the field when missing or mistyped."""
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
