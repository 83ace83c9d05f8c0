"""The request flow both generation endpoints share: read, prepare (off the event loop),
compile the grammar if any (in a worker process, structured.py), submit the choices, then
stream or collect.

Everything that costs time in proportion to the request (JSON parsing, validation, the chat
template, tokenization) runs in `prepare` on a worker thread, so a 10 MB body delays nobody
else's tokens and /health stays quick.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import Request
from sglang_d3d.server.args import ServerConfig
from sglang_d3d.server.body import (
    PAUSE_ABOVE_BYTES,
    ClientLeft,
    GcPause,
    parse_body,
    read_body,
    release,
)
from sglang_d3d.server.engine_holder import EngineHolder
from sglang_d3d.server.errors import APIError, bad_request
from sglang_d3d.server.generation import Generation, start_all, usage_of
from sglang_d3d.server.inputs import output_budget, sampling_params
from sglang_d3d.server.logprobs_out import TokenTexts
from sglang_d3d.server.metrics import MetricsRecorder
from sglang_d3d.server.protocol import SamplingFields
from sglang_d3d.server.responses import Answer, Header, ResponseFormat, as_call
from sglang_d3d.server.streaming import EventStreamResponse, sse_events
from sglang_d3d.server.structured import GrammarPools, check_grammar, compile_grammar, grammar_spec
from sglang_d3d.server.unsupported import check_logit_rules, check_supported
from starlette.responses import Response

from sglang_d3d.config import GrammarSpec, SamplingParams

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; nobody reads it
SEED_MAX = 2**63


@dataclass
class ServerState:
    cfg: ServerConfig
    holder: EngineHolder
    recorder: MetricsRecorder
    gc: GcPause = field(default_factory=GcPause)
    pools: GrammarPools | None = None  # grammar compiles (built from cfg when None)
    _names: TokenTexts | None = None
    _names_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.pools is None:
            self.pools = GrammarPools(self.cfg.grammar_workers, self.cfg.grammar_timeout,
                                      self.cfg.retry_after)

    def token_texts(self, tokenizer) -> TokenTexts:
        """Token names for log-probabilities, built once (call off the event loop)."""
        with self._names_lock:
            if self._names is None:
                self._names = TokenTexts(tokenizer)
            return self._names


@dataclass(frozen=True)
class Endpoint:
    """What differs between /v1/chat/completions and /v1/completions."""

    model: type[SamplingFields]
    fmt: ResponseFormat
    prompt_ids: Callable[[Any, Any], list[int]]  # (tokenizer, body) -> ids; raises APIError(400)
    prompt_param: str


@dataclass
class Prepared:
    """What serving a request needs; the parsed body itself (maybe 100k messages) is dropped."""

    engine: Any
    prompt_ids: list[int]
    params: list[SamplingParams]  # one per sequence generated
    names: TokenTexts | None
    n: int  # choices returned (fewer than len(params) with best_of)
    stops: list[str]
    num_logprobs: int | None
    stream: bool
    include_usage: bool
    calls: bool = False  # the answer is a forced tool call (server/tools.py)
    token_ids: bool = False  # each choice carries its token ids (`return_token_ids`)
    grammar: tuple[GrammarSpec, str] | None = None  # compiled before submitting; its field


def check_model(cfg: ServerConfig, model: str | None) -> None:
    if model is not None and model != cfg.model_name:
        raise APIError(
            404,
            f"the model `{model}` does not exist; this server serves `{cfg.model_name}`",
            param="model",
            code="model_not_found",
        )


def prepare(state: ServerState, ep: Endpoint, raw: bytes) -> Prepared:
    """Body bytes -> everything the engine needs. Runs on a worker thread; raises APIError."""
    with state.gc.paused(len(raw) > PAUSE_ABOVE_BYTES):
        return _prepare(state, ep, parse_body(raw, ep.model, state.cfg.limits.max_depth))


def _prepare(state: ServerState, ep: Endpoint, body: Any) -> Prepared:
    check_model(state.cfg, body.model)
    check_supported(body)
    if body.num_sequences > state.cfg.engine.max_queue:
        raise bad_request(
            f"n (or best_of) = {body.num_sequences} exceeds this server's queue "
            f"({state.cfg.engine.max_queue})",
            "n",
        )
    engine = state.holder.get()
    if not getattr(engine, "supports_logprobs", False):
        if body.num_logprobs is not None:
            raise bad_request("this backend does not report log-probabilities", "logprobs")
        if body.num_sequences > body.n:
            raise bad_request("best_of needs log-probabilities, which this backend lacks", "best_of")
    check_logit_rules(engine, body)
    asked = grammar_spec(body)
    grammar = check_grammar(engine, asked, state.cfg.limits)
    ids = ep.prompt_ids(engine.tokenizer, body)
    max_new = output_budget(body.output_limit, len(ids), state.cfg.engine.max_context, ep.prompt_param)
    check_work(body.num_sequences, max_new, state.cfg.request_token_budget)
    try:
        params = sampling_params(body, max_new, engine.tokenizer, grammar)
    except ValueError as e:
        raise bad_request(str(e)) from e
    names = state.token_texts(engine.tokenizer) if body.num_logprobs is not None else None
    if isinstance(getattr(body, "messages", None), list):
        release(body.messages)  # not needed any more; freed in slices, not in one go
    return Prepared(
        engine, ids, choice_params(params, body.num_sequences), names, body.n,
        body.stop_strings(), body.num_logprobs, body.stream, body.include_usage,
        asked is not None and asked[1] == "tool_choice", bool(body.return_token_ids), asked,
    )  # fmt: skip


def check_work(sequences: int, max_new: int, budget: int) -> None:
    """A 400 for a request that may generate more than `budget` tokens in all."""
    if sequences * max_new > budget:
        raise bad_request(
            f"n (or best_of) x max_tokens = {sequences} x {max_new} = {sequences * max_new} "
            f"tokens exceeds this server's limit of {budget} per request "
            "(--max-request-tokens); lower max_tokens, n or best_of",
            "max_tokens", code="request_too_large",
        )


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice. With a seed, choice i draws from seed + i: reproducible,
    and the choices differ from one another."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=(params.seed + i) % SEED_MAX) for i in range(n)]


async def serve(state: ServerState, request: Request, ep: Endpoint) -> Any:
    arrival = time.monotonic()
    try:
        raw = await read_body(request, state.cfg.max_body_bytes, state.cfg.body_timeout)
    except ClientLeft:  # mid-body: nobody reads the answer
        return Response(status_code=CLIENT_CLOSED)
    p = await asyncio.to_thread(prepare, state, ep, raw)
    del raw
    if p.grammar is not None:
        compiled = await until_disconnected(request, compile_grammar(p.engine, p.grammar, state.pools))
        if compiled is None:  # the client left: its compile was stopped
            return Response(status_code=CLIENT_CLOSED)
    # best_of ranks its sequences by their log-probability, reported or not.
    score = len(p.params) > p.n
    gens = [
        Generation(p.engine, state.recorder, p.prompt_ids, params, p.stops, arrival,
                   p.num_logprobs, i, score)
        for i, params in enumerate(p.params)
    ]  # fmt: skip
    start_all(gens, state.cfg.retry_after)
    h = Header(ep.fmt.id_prefix + gens[0].request_id, state.cfg.model_name)
    if p.stream:
        events = sse_events(gens, ep.fmt, h, p.include_usage, p.names, state.recorder.on_error,
                            p.calls)
        return EventStreamResponse(events, lambda: [g.close() for g in gens])
    pieces = await until_disconnected(request, collect_all(gens))
    if pieces is None:
        return Response(status_code=CLIENT_CLOSED)
    answers = [
        Answer(g.index, piece.text, g.finish_reason,
               piece.scored if g.num_logprobs is not None else None,
               token_ids=g.token_ids if p.token_ids else None)
        for g, piece in zip(gens, pieces)
    ]  # fmt: skip
    answers = best_answers(answers, [g.mean_logprob for g in gens], p.n)
    if p.calls:
        answers = [as_call(a) for a in answers]
    return ep.fmt.whole(h, answers, usage_of(gens), gens[0].d3d_stats(), p.names)


def best_answers(answers: list[Answer], scores: list[float], n: int) -> list[Answer]:
    """best_of: the n answers with the highest log-probability per token, re-indexed 0..n-1
    (OpenAI's rule); all of them, in order, when none are to be dropped."""
    if len(answers) <= n:
        return answers
    order = sorted(range(len(answers)), key=lambda i: -scores[i])[:n]
    return [replace(answers[i], index=k) for k, i in enumerate(order)]


async def collect_all(gens: list[Generation]) -> list:
    """Every choice's whole answer; if one fails, the others are stopped too."""
    tasks = [asyncio.ensure_future(g.collect()) for g in gens]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it if the client hangs up first (then None).

    Non-streaming handlers are not cancelled by Starlette when the client leaves, so without
    this a departed client's request would keep its batch slot until max_tokens.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
