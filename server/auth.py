"""API keys: with any configured, /v1/* need `Authorization: Bearer KEY` (401 otherwise).

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
    if not keys:
        return
    token = bearer_token(request.headers.get("authorization"))
    if token is None:
        raise unauthorized(
            "no API key given: send the header `Authorization: Bearer YOUR_KEY`", None
        )
    if not key_matches(token, keys):
        raise unauthorized("incorrect API key", "invalid_api_key")
