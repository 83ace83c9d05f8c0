"""The HTTP layer under the app: uvicorn set up so that even requests it cannot parse, or whose
headers are too large, are refused in OpenAI's error shape, and a shutdown that stops the
grammar compiles at once.

uvicorn answers a request h11 cannot parse with a plain-text `400 Invalid HTTP request
received.`; h11 refuses headers it has buffered past its limit that way too (a 1 MB
Authorization header). Here its limit is set a little above --max-header-bytes: headers up to
that size reach the app, whose middleware refuses those over --max-header-bytes with a 431;
beyond, the protocol answers 431 itself, in JSON.
"""

from __future__ import annotations

from collections.abc import Callable

import h11
import uvicorn
from sglang_d3d.server.errors import (
    INVALID_REQUEST,
    APIError,
    ErrorListener,
    ErrorResponse,
    error_body,
)
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_LINE_BYTES = 16 * 1024  # h11's buffer holds the request line too


def headers_too_large(limit: int) -> APIError:
    return APIError(431, f"the request headers exceed this server's limit of {limit} bytes "
                    "(--max-header-bytes)", INVALID_REQUEST, None, "headers_too_large")


class HeaderLimit:
    """ASGI middleware: requests whose headers (names and values) exceed `limit` bytes get 431."""

    def __init__(self, app, limit: int, on_error: ErrorListener | None = None) -> None:
        self.app, self.limit, self.on_error = app, limit, on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and _header_bytes(scope["headers"]) > self.limit:
            err = headers_too_large(self.limit)
            if self.on_error is not None:
                self.on_error(err.status, err.type, err.code)
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _header_bytes(headers: list[tuple[bytes, bytes]]) -> int:
    return sum(len(name) + len(value) for name, value in headers)


class JSONErrorsH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, refusing what it cannot parse in OpenAI's error shape: 431 for
    headers past its buffer limit, 400 for anything else."""

    def send_400_response(self, msg: str) -> None:
        limit = self.config.h11_max_incomplete_event_size or h11.DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        if len(self.conn.trailing_data[0]) > limit:
            status, reason = 431, b"Request Header Fields Too Large"
            body = error_body(f"the request headers exceed this server's limit of {limit} bytes",
                              INVALID_REQUEST, None, "headers_too_large")
        else:
            status, reason = 400, b"Bad Request"
            body = error_body(f"invalid HTTP request: {msg}", INVALID_REQUEST, None, "invalid_http")
        data = ErrorResponse(body).body
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(data)).encode())]
        for event in (h11.Response(status_code=status, headers=headers, reason=reason),
                      h11.Data(data=data), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def uvicorn_config(app, max_header_bytes: int, **kw) -> uvicorn.Config:
    """uvicorn's Config for the app: the JSON-erroring protocol and its header limit."""
    return uvicorn.Config(app, http=JSONErrorsH11Protocol,
                          h11_max_incomplete_event_size=max_header_bytes + REQUEST_LINE_BYTES,
                          **kw)


class Server(uvicorn.Server):
    """uvicorn's server, calling `on_shutdown` as soon as shutdown begins, before the graceful
    wait for in-flight responses (the app stops its grammar compiles there)."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets=None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)
