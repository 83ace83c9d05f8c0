"""Structured output requests -> a GrammarSpec for the engine (speculative/grammar.py).

OpenAI's `response_format` (`json_object`: any JSON object; `json_schema`: its schema), or
SGLang's `regex` and `ebnf` fields, or a forced tool call (server/tools.py). A source over the
size limits (limits.py), or one that does not compile in time, is a 400 naming the field, found
before the request is submitted. Compiles run in worker processes (grammar_pool.py) that are
killed on timeout, when the client leaves, and on shutdown. A backend without a grammar
compiler (the SGLang backend; a server without xgrammar) refuses grammars with a 400.
"""

from __future__ import annotations

import asyncio
import json

from sglang_d3d.server.errors import bad_request, unavailable
from sglang_d3d.server.limits import GrammarLimits, check_source
from sglang_d3d.server.protocol import ChatCompletionRequest, ResponseFormat, SamplingFields
from sglang_d3d.server.tools import call_grammar, forced_tools

from sglang_d3d.config import JSON_OBJECT, GrammarSpec
from sglang_d3d.speculative.grammar import GrammarError, Grammars
from sglang_d3d.speculative.grammar_pool import CompileTimeout, GrammarPool, PoolBusy, PoolClosed


def grammar_spec(fields: SamplingFields) -> tuple[GrammarSpec, str] | None:
    """(the grammar, the field that asked for it), or None for free text."""
    asked = [(spec, name) for name, spec in (
        ("response_format", _from_format(fields.response_format)),
        ("regex", fields.regex and GrammarSpec("regex", fields.regex)),
        ("ebnf", fields.ebnf and GrammarSpec("ebnf", fields.ebnf)),
        ("tool_choice", _calls(fields)),
    ) if spec]
    if len(asked) > 1:
        raise bad_request("give at most one of response_format (json), regex, ebnf and a "
                          "forced tool call", asked[1][1])
    return asked[0] if asked else None


def _calls(fields: SamplingFields) -> GrammarSpec | None:
    if not isinstance(fields, ChatCompletionRequest):
        return None
    tools = forced_tools(fields)
    return None if tools is None else call_grammar(tools)


def _from_format(fmt: ResponseFormat | None) -> GrammarSpec | None:
    if fmt is None or fmt.type == "text":
        return None
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    if fmt.type == "json_object" or schema is None:
        return JSON_OBJECT
    return GrammarSpec("json_schema", json.dumps(schema))


def check_grammar(engine, asked: tuple[GrammarSpec, str] | None,
                  limits: GrammarLimits = GrammarLimits()) -> GrammarSpec | None:
    """A 400 for a backend that cannot constrain its output, or a source over the size
    limits; else the grammar, compiled later by `compile_grammar`. Runs on a worker thread."""
    if asked is None:
        return None
    spec, field = asked
    if getattr(engine, "compile_grammar", None) is None:
        raise bad_request(f"`{field}` (structured output) is not supported by this server's "
                          "backend", field)
    if (problem := check_source(spec, limits)) is not None:
        raise bad_request(f"`{field}`: {problem.message}", field, code=problem.code)
    return spec


def engine_grammars(engine) -> Grammars | None:
    """The embedded engine's compiler, which adopts grammars compiled in worker processes;
    None for a backend that compiles them itself."""
    return getattr(getattr(engine, "engine", None), "grammars", None)


async def compile_grammar(engine, asked: tuple[GrammarSpec, str], pools: GrammarPools) -> bool:
    """Compile the request's grammar (once: the engine keeps it) where it can be stopped:
    400 for a source that does not compile in time or that the vocabulary cannot start, 503
    when as many compiles are in flight as allowed. Cancelling it (the client left) stops
    the compile. True once compiled."""
    spec, field = asked
    grammars = engine_grammars(engine)
    if grammars is None:  # a backend without a Grammars: its own compile_grammar, on a thread
        await asyncio.to_thread(_compile_in_thread, engine, spec, field)
        return True
    if grammars.has(spec):
        return True
    try:
        serialized = await pools.get(grammars).compile(spec)
    except GrammarError as e:
        raise bad_request(f"`{field}`: {e}", field, code=e.code) from None
    except CompileTimeout:
        raise bad_request(
            f"`{field}`: the grammar did not compile within this server's limit of "
            f"{pools.timeout:g} s (--grammar-timeout); simplify it", field,
            code="grammar_too_slow") from None
    except PoolBusy:
        raise unavailable(
            f"the server is compiling as many grammars as it allows at once "
            f"({pools.workers}, --grammar-workers); retry shortly", "grammar_busy",
            pools.retry_after) from None
    except PoolClosed:
        raise unavailable("the server is shutting down", "unavailable", pools.retry_after) from None
    await asyncio.to_thread(grammars.adopt, spec, serialized)
    return True


def _compile_in_thread(engine, spec: GrammarSpec, field: str) -> None:
    try:
        engine.compile_grammar(spec)
    except GrammarError as e:
        raise bad_request(f"`{field}`: {e}", field, code=getattr(e, "code", None)) from e


class GrammarPools:
    """The server's compile pool, started for the engine's tokenizer when first needed."""

    def __init__(self, workers: int, timeout: float, retry_after: int) -> None:
        self.workers, self.timeout, self.retry_after = workers, timeout, retry_after
        self._pool: GrammarPool | None = None
        self._closed = False

    def get(self, grammars: Grammars) -> GrammarPool:
        if self._closed:
            raise PoolClosed
        if self._pool is None:
            self._pool = GrammarPool(grammars.info.serialize_json(), self.workers, self.timeout)
        return self._pool

    @property
    def in_flight(self) -> int:
        return 0 if self._pool is None else self._pool.in_flight

    @property
    def num_workers(self) -> int:
        """Worker processes alive (started, not killed)."""
        return 0 if self._pool is None else self._pool.num_workers

    def close(self) -> None:
        """Stop every compile (shutdown): their requests get 503."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()
