"""Known OpenAI fields this server cannot honour: a 400 naming the field, never a silent answer
that ignored it. A field set to its neutral value (a zero penalty, `tool_choice:
"none"`, `response_format: {"type": "text"}`, ...) asks for nothing and is accepted, so that
clients which always send their defaults keep working. docs/api.md lists the fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_d3d.server.errors import bad_request
from sglang_d3d.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

Check = tuple[str, Callable[[Any], bool], str]  # (field, is it neutral?, what we cannot do)


def _absent(v: Any) -> bool:
    return v is None


def _empty(v: Any) -> bool:
    return not v


SHARED: tuple[Check, ...] = (
    ("store", lambda v: not v, "this server stores no completions"),
    ("service_tier", lambda v: v in (None, "auto", "default"), "there is one service tier"),
)
CHAT: tuple[Check, ...] = (
    ("audio", _absent, "audio output is not supported"),
    ("modalities", lambda v: v in (None, ["text"]), "only the text modality is supported"),
    ("prediction", _absent, "predicted outputs are not supported"),
    ("web_search_options", _absent, "web search is not supported"),
    ("reasoning_effort", _absent, "this model has no reasoning-effort setting"),
    ("verbosity", _absent, "this model has no verbosity setting"),
    ("function_call", lambda v: v in (None, "none"), "function calling is not supported"),
)
COMPLETION: tuple[Check, ...] = (
    ("echo", lambda v: not v, "echo is not supported"),
    ("suffix", _empty, "suffix (insertion) is not supported"),
)


def check_supported(body: SamplingFields) -> None:
    """Raise a 400 for the first field asking for something this server cannot do."""
    checks = SHARED + (CHAT if isinstance(body, ChatCompletionRequest) else COMPLETION)
    for name, neutral, why in checks:
        if not neutral(getattr(body, name)):
            raise bad_request(f"`{name}` is not supported by this server: {why}", name)
    if isinstance(body, ChatCompletionRequest):
        _check_tools(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    if isinstance(body, CompletionRequest):
        _check_best_of(body)
    if body.stream_options is not None and not body.stream:
        raise bad_request("`stream_options` is only allowed with `stream: true`", "stream_options")


def _check_tools(body: ChatCompletionRequest) -> None:
    """Tool calls are made where the request forces one (server/tools.py): `tool_choice`
    "required" or naming a tool. Where the model would choose between text and a call ("auto",
    OpenAI's default with tools) nothing here could read a call out of free text, so that is a
    400; tool history, and tools with tool_choice "none" (answered in text), are fine."""
    forced = body.tool_choice not in (None, "none", "auto")
    if forced and not body.tools:
        raise bad_request("`tool_choice` that asks for a call needs `tools`", "tool_choice")
    if body.tools and body.tool_choice in (None, "auto"):
        raise bad_request(
            '`tools` with tool_choice "auto" (the default) is not supported: send tool_choice '
            '"required" or {"type": "function", "function": {"name": ...}} for a call, or "none" '
            "for an answer in text",
            "tools",
        )
    if body.functions and body.tool_choice != "none":
        raise bad_request(
            "`functions` (the legacy form) is not supported: send `tools` with tool_choice "
            '"required" or a named function, or `tool_choice: "none"` for an answer in text',
            "functions",
        )


def _check_best_of(body: CompletionRequest) -> None:
    if body.best_of is None:
        return
    if body.best_of < body.n:
        raise bad_request("`best_of` must be at least `n`", "best_of")
    if body.stream and body.best_of > body.n:
        raise bad_request("`best_of` greater than `n` cannot be streamed", "best_of")


# Fields that reshape the target's logits, each with its neutral value: a backend applies those
# it names in its `logit_rules`, and refuses the others unless they are neutral.
LOGIT_RULES: dict[str, Callable[[Any], bool]] = {
    "frequency_penalty": _empty,
    "presence_penalty": _empty,
    "logit_bias": _empty,
    "repetition_penalty": lambda v: v is None or v == 1,
    "min_p": _empty,
    "min_tokens": _empty,
}


def check_logit_rules(engine, body: SamplingFields) -> None:
    """Penalties, logit_bias, min_p and min_tokens need a backend that applies them inside verification
    (speculative/penalties.py); elsewhere a 400, never an answer that silently ignored them."""
    applied = getattr(engine, "logit_rules", frozenset())
    for name, neutral in LOGIT_RULES.items():
        if name not in applied and not neutral(getattr(body, name)):
            raise bad_request(f"`{name}` is not supported by this server's backend", name)
