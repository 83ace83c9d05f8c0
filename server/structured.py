"""Structured output requests -> a GrammarSpec for the engine (speculative/grammar.py).

OpenAI's `response_format` (`json_object`: any JSON object; `json_schema`: its schema), or
SGLang's `regex` and `ebnf` fields, or a forced tool call (server/tools.py). A source that does not compile is a 400 naming the field,
found here on the worker thread rather than at submit. A backend without a grammar compiler
(the SGLang backend; a server without xgrammar) refuses them with a 400.
"""

from __future__ import annotations

import json

from sglang_d3d.server.errors import bad_request
from sglang_d3d.server.protocol import ChatCompletionRequest, ResponseFormat, SamplingFields
from sglang_d3d.server.tools import call_grammar, forced_tools

from sglang_d3d.config import JSON_OBJECT, GrammarSpec
from sglang_d3d.speculative.grammar import GrammarError


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


def check_grammar(engine, asked: tuple[GrammarSpec, str] | None) -> GrammarSpec | None:
    """Compile the request's grammar once (the engine's compiler caches it): a 400 for a
    source that does not compile, or a backend that cannot constrain its output."""
    if asked is None:
        return None
    spec, field = asked
    compile_grammar = getattr(engine, "compile_grammar", None)
    if compile_grammar is None:
        raise bad_request(f"`{field}` (structured output) is not supported by this server's "
                          "backend", field)
    try:
        compile_grammar(spec)
    except GrammarError as e:
        raise bad_request(f"`{field}`: {e}", field) from e
    return spec
