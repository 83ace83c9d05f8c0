"""Every error leaves the server in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

`APIError` is raised by request handling; the handlers installed here turn it, FastAPI's
validation errors, unknown routes and unexpected exceptions into that shape, and count each in
the metrics (`rejection_reason`). Error bodies are ASCII-escaped JSON: a message may quote
client text, and client text may hold a lone surrogate that UTF-8 cannot encode.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
UNAVAILABLE = "service_unavailable_error"
INTERNAL = "internal_server_error"

ErrorListener = Callable[[int, str, "str | None"], None]  # (status, error type, code)


class ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped, so that any message can be encoded."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def rejection_reason(status: int, code: str | None) -> str | None:
    """Why a request was refused before generation, for d3d:request_rejected_total{reason};
    None for failures that are not refusals (500s)."""
    if status == 413:
        return "body_too_large"
    if status == 401:
        return "unauthorized"
    if code == "queue_full":
        return "queue_full"
    if code == "context_length_exceeded":
        return "too_long"
    if status == 503:
        return "unavailable"  # loading, failed to load, or draining for shutdown
    if 400 <= status < 500:
        return "bad_request"
    return None


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def unavailable(message: str, code: str, retry_after: int) -> APIError:
    return APIError(503, message, UNAVAILABLE, None, code, {"Retry-After": str(retry_after)})


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error, said plainly: `messages.0.content: Input should be ...`."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return bad_request(f"malformed JSON body: {detail}".rstrip(": "), code="json_invalid")
    loc, msgs = _union_location(errors)
    param = ".".join(loc) or None
    if first.get("type") == "missing" and not loc:
        return bad_request("a JSON request body is required", code="missing")
    msg = f"{param or 'request body'}: {'; '.join(msgs)}"
    return bad_request(msg, param=param, code=first.get("type"))


def _union_location(errors: list[dict]) -> tuple[list[str], list[str]]:
    """Where the first error is, and what is wrong there.

    A field typed `str | list[str]` fails once per union member, each loc ending in the
    member's name (`stop.str`, `stop.list[str]`); the field is their common prefix.
    """
    locs = [[str(x) for x in e.get("loc", ()) if x != "body"] for e in errors]
    first = locs[0]
    group = [i for i, loc in enumerate(locs) if loc[:1] == first[:1]]
    prefix = first
    for i in group[1:]:
        n = 0
        while n < min(len(prefix), len(locs[i])) and prefix[n] == locs[i][n]:
            n += 1
        prefix = prefix[:n]
    msgs = list(dict.fromkeys(errors[i].get("msg", "invalid value") for i in group))
    return prefix, msgs


def install_error_handlers(app: FastAPI, on_error: ErrorListener | None = None) -> None:
    """on_error(status, type, code) is told of every error response (for the metrics)."""

    def respond(exc: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(exc.status, exc.type, exc.code)
        return exc.response()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        err = APIError(exc.status_code, str(exc.detail), kind, None, str(exc.status_code))
        err.headers = exc.headers
        return respond(err)

    @app.exception_handler(RecursionError)
    async def _too_deep(_: Request, exc: RecursionError) -> JSONResponse:
        # Input nested past what some parser handles (the limits should stop it earlier):
        # the client's fault, said in one line, not a traceback thousands of frames long.
        log.warning("a request nested too deeply: %s", exc)
        return respond(bad_request("the request nests too deeply to be read", code="too_deep"))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error while serving a request")
        return respond(APIError(500, f"internal error: {type(exc).__name__}: {exc}", INTERNAL))
