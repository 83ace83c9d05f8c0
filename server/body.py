"""Request bodies: read with a size limit on the event loop, parsed and validated off it.

Reading is cheap and awaits the socket. Parsing is not: a few megabytes of JSON with 100k
messages take most of a second to validate, and pydantic holds the GIL while it works, so the
messages are validated in chunks on a worker thread. Between chunks the event loop gets the GIL
back, and /health and every stream keep answering (issue 13).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError

from server.errors import APIError, bad_request, validation_error
from server.protocol import ChatMessage

M = TypeVar("M", bound=BaseModel)
CHUNK = 512  # messages validated per GIL-holding call (about 3 ms each)
_MESSAGES = TypeAdapter(list[ChatMessage])


def body_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body exceeds this server's limit of {limit} bytes (--max-body-bytes)",
        code="body_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # chunked uploads declare no length
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes, model: type[M]) -> M:
    """JSON -> the request model, or a 400 in the shape FastAPI's own validation gives.
    Runs on a worker thread."""
    if not raw.strip():
        raise bad_request("a JSON request body is required", code="missing")
    try:
        data = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise bad_request(f"malformed JSON body: {e}", code="json_invalid") from e
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="model_attributes_type")
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > CHUNK:
        data = {**data, "messages": _validate_chunked(messages)}
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(RequestValidationError(e.errors())) from e


def _validate_chunked(messages: list[Any]) -> list[ChatMessage]:
    """Validated messages; errors keep their index in the whole list."""
    out: list[ChatMessage] = []
    for start in range(0, len(messages), CHUNK):
        try:
            out += _MESSAGES.validate_python(messages[start : start + CHUNK])
        except ValidationError as e:
            errors = [
                {**err, "loc": ("messages", start + err["loc"][0], *err["loc"][1:])}
                for err in e.errors()
            ]
            raise validation_error(RequestValidationError(errors)) from e
    return out
