"""Request bodies: read with a size limit on the event loop, parsed and validated off it.

Reading is cheap and awaits the socket. Parsing is not: a few megabytes of JSON with 100k
messages take most of a second to validate, and pydantic holds the GIL while it works, so the
messages are validated in chunks on a worker thread. Between chunks the event loop gets the GIL
back, and /health and every stream keep answering. For the same reason a big body's
JSON is decoded by the json module's Python scanner, which lets other threads in every few
milliseconds, where the C one holds the GIL for the whole document (100 ms for 100k messages).

Big bodies would also freeze the event loop through the heap, so the cyclic garbage collector
is paused while one is parsed (`GcPause`), and its objects are freed a slice at a time
(`release`).

A 100k-message body becomes some 400k Python objects. Creating them triggers full collections,
and each one walks every tracked object in the process with the GIL held: 0.3-1 s measured on
this project's CPU, during which the event loop (and /health) is frozen. Reference counting
frees the request's objects anyway; only the cycle detector waits until the parse is done.
The engine's objects (model, imports) are frozen out of collections once loaded
(engine_holder.EngineHolder), so the collections that do run stay short.

Freeing is the mirror image: dropping the last reference to a list of 100k dicts frees them all
in one C loop, another pause of tens of milliseconds; `release` empties such a list in slices,
between which other threads get the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import json.scanner
import threading
from typing import Annotated, Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from sglang_d3d.server.errors import APIError, bad_request, validation_error
from sglang_d3d.server.limits import json_depth_over
from sglang_d3d.server.protocol import ChatMessage
from starlette.requests import ClientDisconnect

M = TypeVar("M", bound=BaseModel)
CHUNK = 512  # messages validated per GIL-holding call (about 3 ms each)
PYTHON_SCANNER_ABOVE = 256 * 1024  # bytes; the C decoder is 10x faster on small bodies
ID_CHUNK = 65536  # token ids validated per call
_MESSAGES = TypeAdapter(list[ChatMessage])
_IDS = TypeAdapter(list[Annotated[int, Field(strict=True, ge=0)]])
PAUSE_ABOVE_BYTES = 256 * 1024  # smaller bodies make too few objects to matter
LONG_FIELDS = ("messages", "prompt")  # validated against fixed models, maybe 100k items


class GcPause:
    """Collector off while any paused section runs (sections may overlap, across threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._was_enabled = True

    @contextlib.contextmanager
    def paused(self, when: bool = True):
        if not when:
            yield
            return
        with self._lock:
            if self._active == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0 and self._was_enabled:
                    gc.enable()


RELEASE_SLICE = 2048  # objects freed per step


def release(items: list) -> None:
    """Empty `items` (freeing what only it referenced) a slice at a time."""
    while items:
        del items[-RELEASE_SLICE:]


class ClientLeft(Exception):
    """The client closed its connection before its body had all arrived: nobody to answer,
    and nothing went wrong on this side (no error logged or counted)."""


def body_too_large(limit: int) -> APIError:
    """413, and the connection is closed: the rest of the body is not read."""
    return APIError(
        413,
        f"the request body exceeds this server's limit of {limit} bytes (--max-body-bytes)",
        code="body_too_large",
        headers={"Connection": "close"},
    )


def body_timed_out(timeout: float) -> APIError:
    """408, and the connection is closed: the rest of the body may never come."""
    return APIError(
        408,
        f"the request body did not arrive within this server's limit of {timeout:g} s "
        "(--body-timeout)",
        code="body_timeout",
        headers={"Connection": "close"},
    )


async def read_body(request: Request, limit: int, timeout: float = float("inf")) -> bytes:
    """The raw body, refused with 413 as soon as it is known to exceed `limit` bytes, and with
    408 if it has not all arrived within `timeout` seconds (an upload that never ends, or a
    Content-Length larger than what is sent, would hold its connection forever)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(None if timeout == float("inf") else timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:  # chunked uploads declare no length
                    raise body_too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise body_timed_out(timeout) from None
    except ClientDisconnect:
        raise ClientLeft from None
    return b"".join(chunks)


def too_deep(limit: int) -> APIError:
    return bad_request(
        f"the JSON body nests deeper than this server's limit of {limit} (--max-json-depth)",
        code="json_too_deep",
    )


def parse_body(raw: bytes, model: type[M], max_depth: int = 64) -> M:
    """JSON -> the request model, or a 400 in the shape FastAPI's own validation gives.
    Runs on a worker thread."""
    if not raw.strip():
        raise bad_request("a JSON request body is required", code="missing")
    try:
        data = decode_json(raw)
    except RecursionError:  # both of json's scanners recurse once per level
        raise too_deep(max_depth) from None
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise bad_request(f"malformed JSON body: {e}", code="json_invalid") from e
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="model_attributes_type")
    # Free-form fields (a schema, tool parameters) reach recursive code: pydantic, json.dumps,
    # the grammar compiler. The long lists are validated against fixed models, which stop at
    # the first wrong type, so only the rest is walked.
    if json_depth_over({k: v for k, v in data.items() if k not in LONG_FIELDS}, max_depth):
        raise too_deep(max_depth)
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > CHUNK:
        data = {**data, "messages": _validate_chunked(messages, _MESSAGES, CHUNK, "messages")}
        release(messages)  # the decoded dicts, freed in slices
    ids = data.get("prompt")
    if isinstance(ids, list) and len(ids) > ID_CHUNK and isinstance(ids[0], int):
        ids = _validate_chunked(ids, _IDS, ID_CHUNK, "prompt")
        data = {**data, "prompt": ids[:1]}  # checked already: the model sees one id
    else:
        ids = None
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(RequestValidationError(e.errors())) from e
    if ids is not None:
        body.prompt = ids
    return body


def decode_json(raw: bytes):
    if len(raw) <= PYTHON_SCANNER_ABOVE:
        return json.loads(raw)
    decoder = json.JSONDecoder()
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # strings still scan in C
    return decoder.decode(raw.decode("utf-8"))


def _validate_chunked(items: list[Any], adapter: TypeAdapter, chunk: int, field: str) -> list:
    """The items of a long list, validated a chunk per call; errors keep their index in the
    whole list."""
    out: list = []
    for start in range(0, len(items), chunk):
        try:
            out += adapter.validate_python(items[start : start + chunk])
        except ValidationError as e:
            errors = [
                {**err, "loc": (field, start + err["loc"][0], *err["loc"][1:])}
                for err in e.errors()
            ]
            raise validation_error(RequestValidationError(errors)) from e
    return out
