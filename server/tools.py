"""Tool calls the model is made to make: chat `tools` with `tool_choice` "required" or naming
one of them (OpenAI's shapes).

The answer is held inside a JSON schema of one call, `{"name": <a tool's name>, "arguments":
<that tool's parameters>}` (structured output, speculative/grammar.py), so it always parses and
its arguments follow the tool's schema; it is returned as `tool_calls` with finish reason
"tool_calls". An answer cut by `max_tokens` is returned as text with "length". The model learns
the tools from the chat template where the template renders them, or else from a system turn
that lists them (`tools_turn`). `tool_choice: "auto"`, where the model would choose between
text and a call, is refused (server/unsupported.py): nothing here parses calls out of free text.
"""

from __future__ import annotations

import json
import uuid

from sglang_d3d.server.errors import bad_request
from sglang_d3d.server.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    FunctionDef,
    NamedToolChoice,
    Tool,
    ToolCall,
)

from sglang_d3d.config import GrammarSpec

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def forced_tools(body: ChatCompletionRequest) -> list[Tool] | None:
    """The tools one of which the answer must call, or None where it answers in text."""
    choice = body.tool_choice
    if not body.tools or choice in (None, "none", "auto"):
        return None
    if not isinstance(choice, NamedToolChoice):
        return body.tools  # "required": any of them
    named = [t for t in body.tools if t.function.name == choice.function.name]
    if not named:
        raise bad_request(f"tool_choice names `{choice.function.name}`, which is not in `tools`",
                          "tool_choice")
    return named


def call_grammar(tools: list[Tool]) -> GrammarSpec:
    """One call of one of `tools`, as a JSON schema."""
    defs: dict = {}
    calls = [_call_schema(t.function, f"tool{i}", defs) for i, t in enumerate(tools)]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return GrammarSpec("json_schema", json.dumps({**schema, "$defs": defs} if defs else schema))


def _call_schema(f: FunctionDef, key: str, defs: dict) -> dict:
    """The schema of a call of `f`. Parameters with references (pydantic's `$defs` and
    `"$ref": "#/$defs/..."`) move under the call schema's root `$defs` (as `key`, theirs as
    `key.NAME`), their references rewritten, since `#` now names the call schema's root."""
    arguments = f.parameters or NO_ARGUMENTS
    if _has_ref(arguments):
        arguments = _hoisted(arguments, key, defs)
    return {
        "type": "object",
        "properties": {"name": {"const": f.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


DEF_KEYS = ("$defs", "definitions")


def _has_ref(node) -> bool:
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if isinstance(x.get("$ref"), str):
                return True
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False


def _hoisted(parameters: dict, key: str, defs: dict) -> dict:
    """`{"$ref": "#/$defs/KEY"}`, the parameters and their own definitions put into `defs`."""
    own = {k: v for k, v in parameters.items() if k not in DEF_KEYS}
    defs[key] = _rebased(own, key)
    for group in DEF_KEYS:
        for name, sub in (parameters.get(group) or {}).items():
            defs[f"{key}.{name}"] = _rebased(sub, key)
    return {"$ref": f"#/$defs/{key}"}


def _rebased(node, key: str):
    """A copy of `node` whose local references point where their targets now are."""
    if isinstance(node, list):
        return [_rebased(x, key) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rebased(v, key) for k, v in node.items()}
    if isinstance(node.get("$ref"), str):
        out["$ref"] = _moved(node["$ref"], key)
    return out


def _moved(ref: str, key: str) -> str:
    """A reference into the parameters -> the same target under `$defs/KEY` (remote ones as
    they are)."""
    if ref == "#" or ref == "#/":
        return f"#/$defs/{key}"
    if not ref.startswith("#/"):
        return ref
    parts = ref[2:].split("/")
    if parts[0] in DEF_KEYS and len(parts) > 1:
        return "/".join([f"#/$defs/{key}.{parts[1]}", *parts[2:]])
    return f"#/$defs/{key}/" + "/".join(parts)


def tools_turn(tools: list[Tool]) -> dict:
    """A system turn that lists the tools, for chat templates that do not render them."""
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
    return {"role": "system", "content": (
        "These tools can be called. Each is described by one JSON object inside <tools>:\n"
        f"<tools>\n{listed}\n</tools>\n"
        'To call one, answer with {"name": <the tool\'s name>, "arguments": <its arguments as '
        "a JSON object>}."
    )}


def parse_call(text: str) -> list[ToolCall] | None:
    """The answer as OpenAI's `tool_calls`, or None where it is not a whole call (cut short)."""
    try:
        call = json.loads(text)
        name, arguments = call["name"], call["arguments"]
    except (ValueError, TypeError, KeyError):
        return None
    fn = FunctionCall(name=name, arguments=json.dumps(arguments))
    return [ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=fn)]
