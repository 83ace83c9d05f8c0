"""API keys: with any configured, /v1/* need `Authorization: Bearer KEY` (401 otherwise).

The API's own description (/openapi.json, and the /docs and /redoc pages that read it) is
behind the keys too when any are set: it lists this server's limits and extensions, which an
anonymous caller has no need to read. /health and (unless --metrics-need-key) /metrics stay
open, for probes and scrapers.

Keys come from `--api-key` (repeatable) or the environment variable D3D_API_KEY (several keys
separated by commas). Every configured key is compared, in constant time, whatever matched
first, so the response time tells nothing about how much of a key was right.
"""

from __future__ import annotations

import hmac
import os

from fastapi import Request
from sglang_d3d.server.errors import INVALID_REQUEST, APIError

ENV_VAR = "D3D_API_KEY"
DOC_PATHS = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def keys_from_env(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return tuple(k.strip() for k in raw.split(",") if k.strip())


def key_matches(given: str, keys: tuple[str, ...]) -> bool:
    found = False
    for key in keys:  # no early exit: the time taken is the same for every wrong key
        found |= hmac.compare_digest(given.encode(), key.encode())
    return found


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def unauthorized(message: str, code: str | None) -> APIError:
    return APIError(401, message, INVALID_REQUEST, None, code, {"WWW-Authenticate": "Bearer"})


def check_api_key(request: Request) -> None:
    """FastAPI dependency of the protected routes."""
    keys: tuple[str, ...] = request.app.state.d3d.cfg.api_keys
    if (err := key_error(keys, request.headers.get("authorization"))) is not None:
        raise err


def key_error(keys: tuple[str, ...], authorization: str | None) -> APIError | None:
    """The 401 for a request with this Authorization header, or None where it may pass."""
    if not keys:
        return None
    token = bearer_token(authorization)
    if token is None:
        return unauthorized(
            "no API key given: send the header `Authorization: Bearer YOUR_KEY`", None
        )
    if not key_matches(token, keys):
        return unauthorized("incorrect API key", "invalid_api_key")
    return None


class DocsNeedKey:
    """ASGI middleware: FastAPI's own /openapi.json, /docs and /redoc need a key where /v1/* do."""

    def __init__(self, app, keys: tuple[str, ...], on_error=None) -> None:
        self.app, self.keys, self.on_error = app, keys, on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in DOC_PATHS:
            auth = next((v.decode("latin-1") for k, v in scope["headers"]
                         if k == b"authorization"), None)
            if (err := key_error(self.keys, auth)) is not None:
                if self.on_error is not None:
                    self.on_error(err.status, err.type, err.code)
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
