"""The HTTP layer under the app: uvicorn set up so that even requests it cannot parse, or whose
headers are too large, are refused in OpenAI's error shape, and a shutdown that stops the
grammar compiles at once.

uvicorn answers a request h11 cannot parse with a plain-text `400 Invalid HTTP request
received.`; h11 refuses headers it has buffered past its limit that way too (a 1 MB
Authorization header). Here its limit is set a little above --max-header-bytes: headers up to
that size reach the app, whose middleware refuses those over --max-header-bytes with a 431;
beyond, the protocol answers 431 itself, in JSON.

Connections are bounded too (`ConnectionLimits`). uvicorn waits for a request's headers for as
long as a client cares to send them, a byte at a time, and holds a new connection that sends
nothing forever; here the request line and headers must arrive within `header_timeout`
seconds of the connection opening, or of the first byte of the next request on a kept-alive
connection (else 408 if part arrived, and the connection is closed). An idle kept-alive
connection is closed after `keep_alive_timeout` seconds (uvicorn's own timer). Connections
past `max_connections` are answered 503 and closed as they open, before they can hold a file
descriptor and a slot for long.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import h11
import uvicorn
from sglang_d3d.server.errors import (
    INVALID_REQUEST,
    UNAVAILABLE,
    APIError,
    ErrorListener,
    ErrorResponse,
    error_body,
)
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_LINE_BYTES = 16 * 1024  # h11's buffer holds the request line too


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 30.0  # seconds for a request's line and headers to arrive
    keep_alive_timeout: float = 60.0  # seconds an idle kept-alive connection stays open
    max_connections: int = 1024  # open connections; more are answered 503 and closed
    retry_after: int = 1  # seconds, sent with that 503

    def __post_init__(self) -> None:
        if min(self.header_timeout, self.keep_alive_timeout) <= 0 or self.max_connections < 1:
            raise ValueError("--header-timeout and --keep-alive-timeout must be > 0, "
                             "--max-connections >= 1")


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
    headers past its buffer limit, 400 for anything else; and holding connections only within
    `ConnectionLimits` (the config's `d3d_connections`)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.limits: ConnectionLimits = getattr(self.config, "d3d_connections", ConnectionLimits())
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, b"Service Unavailable", error_body(
                f"the server holds as many connections as it allows "
                f"({self.limits.max_connections}, --max-connections); retry shortly",
                UNAVAILABLE, None, "too_many_connections"),
                [(b"retry-after", str(self.limits.retry_after).encode())])
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._between_requests():
            self._arm_header_timer()  # the first bytes of the next request on this connection
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if not self._between_requests():
            self._disarm_header_timer()  # its headers have all arrived

    def on_response_complete(self) -> None:
        self._disarm_header_timer()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        """No request's headers are complete: the client is to send the next one."""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._between_requests():
            return
        if not self.conn.trailing_data[0]:  # nothing of a request arrived: just close
            self.transport.close()
            return
        self._refuse(408, b"Request Timeout", error_body(
            f"the request headers did not arrive within this server's limit of "
            f"{self.limits.header_timeout:g} s (--header-timeout)", INVALID_REQUEST, None,
            "header_timeout"))

    def _refuse(self, status: int, reason: bytes, body: dict,
                extra: list[tuple[bytes, bytes]] = ()) -> None:
        """Answer `status` with `body` outside any request cycle, and close the connection."""
        data = ErrorResponse(body).body
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n" % (status, reason, len(data)))
        head += b"".join(b"%s: %s\r\n" % (k, v) for k, v in extra)
        self.transport.write(head + b"\r\n" + data)
        self.transport.close()

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


def uvicorn_config(app, max_header_bytes: int,
                   connections: ConnectionLimits = ConnectionLimits(), **kw) -> uvicorn.Config:
    """uvicorn's Config for the app: the JSON-erroring protocol, its header limit and its
    connection limits."""
    config = uvicorn.Config(app, http=JSONErrorsH11Protocol,
                            h11_max_incomplete_event_size=max_header_bytes + REQUEST_LINE_BYTES,
                            timeout_keep_alive=connections.keep_alive_timeout, **kw)
    config.d3d_connections = connections  # read by each JSONErrorsH11Protocol
    return config


class Server(uvicorn.Server):
    """uvicorn's server, calling `on_shutdown` as soon as shutdown begins, before the graceful
    wait for in-flight responses (the app stops its grammar compiles there)."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets=None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)
