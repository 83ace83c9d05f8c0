"""What both backends (the embedded engine, SGLang) promise their callers (the HTTP server, the
CLI, benchmarks).

The engine runs its decode loop on a thread of its own. Callers submit a request and receive
`TokenEvent`s through a callback that the engine calls from its loop thread; the callback must
be cheap and thread-safe (the server hands the event to its asyncio loop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sglang_d3d.config import SamplingParams
from sglang_d3d.speculative.logprobs import TokenLogprob
from sglang_d3d.speculative.stats import RequestStats


class QueueFullError(RuntimeError):
    """The waiting queue is at EngineConfig.max_queue; the server answers 503 + Retry-After."""


class RequestTooLongError(ValueError):
    """prompt + max_new_tokens exceeds EngineConfig.max_context; the server answers 400."""


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0  # time.monotonic() when the server received it
    # None: no log-probabilities; k >= 0: each token's log-probability and its k likeliest
    # alternatives (speculative/logprobs.py), in TokenEvent.logprobs.
    logprobs: int | None = None


@dataclass
class TokenEvent:
    """New tokens for one request. `finished` is True exactly once, on the last event."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # set when finish_reason == "error"
    stats: RequestStats | None = None  # set on the final event
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, if the request asked


EventCallback = Callable[[TokenEvent], None]
