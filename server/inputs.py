"""Request -> what the engine takes: prompt token ids (the chat template for messages, plain
encoding for prompts) and SamplingParams, with the limits OpenAI's API enforces.

Runs on a worker thread (tokenizing megabytes takes seconds). Text the tokenizer cannot take,
such as a lone UTF-16 surrogate that JSON's `\\ud800` escape lets through, is a 400 naming the
field, never a 500.

Tool history: `tool` messages and assistant `tool_calls` are passed to the chat template as
Hugging Face templates expect them. A template that does not mention `tool_calls` (SmolLM2's
ChatML template among them) would drop the calls or fail on the empty content, so for those the
calls are written into the assistant's content, one `<tool_call>{"name": ..., "arguments": ...}
</tool_call>` block each (the Hermes convention ChatML tool-use models are trained on); `tool`
messages render as a ChatML `tool` turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from sglang_d3d.server.body import release
from sglang_d3d.server.errors import bad_request
from sglang_d3d.server.protocol import (
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    Tool,
    ToolCall,
)
from sglang_d3d.server.tools import tools_turn

from sglang_d3d.config import GrammarSpec, SamplingParams


def chat_prompt_ids(tokenizer, messages: Sequence[ChatMessage],
                    tools: Sequence[Tool] | None = None) -> list[int]:
    """`tools`: the ones the answer must call (server/tools.py), shown to the model."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    for i, m in enumerate(messages):
        check_text(m.text(), f"messages.{i}.content")
        for call in m.tool_calls or []:
            check_text(call.function.name + call.function.arguments, f"messages.{i}.tool_calls")
    turns = render_turns(messages, structured_tools="tool_calls" in template)
    shown = {}
    if tools and "tools" in template:  # the template renders them its own way
        shown = {"tools": [t.model_dump(exclude_none=True) for t in tools]}
    elif tools:
        turns = with_system(turns, tools_turn(list(tools)))
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False,
                                             **shown)
    except Exception as e:  # noqa: BLE001 - templates raise on e.g. non-alternating roles
        raise bad_request(f"messages do not fit the chat template: {e}", "messages") from e
    finally:
        release(turns)
    # The template already holds the special tokens it wants (BOS, role markers).
    return encode(tokenizer, text, "messages", add_special_tokens=False)


def with_system(turns: list[dict], system: dict) -> list[dict]:
    """`system` first, joined to the request's own system turn where it has one."""
    if turns and turns[0]["role"] == "system":
        joined = f"{turns[0]['content']}\n\n{system['content']}" if turns[0]["content"] else system["content"]
        return [{**turns[0], "content": joined}, *turns[1:]]
    return [system, *turns]


def render_turns(messages: Sequence[ChatMessage], structured_tools: bool) -> list[dict]:
    """Messages as the dicts a Hugging Face chat template reads."""
    return [_turn(m, structured_tools) for m in messages]


def _turn(m: ChatMessage, structured_tools: bool) -> dict:
    # "developer" is OpenAI's newer name for the system role; templates know only "system".
    turn: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.role == "tool":
        turn["tool_call_id"] = m.tool_call_id
        if m.name:
            turn["name"] = m.name
    if m.tool_calls:
        if structured_tools:
            turn["tool_calls"] = [_structured(c) for c in m.tool_calls]
        else:
            blocks = [f"<tool_call>\n{_call_json(c)}\n</tool_call>" for c in m.tool_calls]
            turn["content"] = "\n".join(([turn["content"]] if turn["content"] else []) + blocks)
    return turn


def _arguments(call: ToolCall):
    """Templates format arguments with `tojson`, so they want an object, not JSON text."""
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


def _structured(call: ToolCall) -> dict:
    fn = {"name": call.function.name, "arguments": _arguments(call)}
    return {"id": call.id, "type": "function", "function": fn}


def _call_json(call: ToolCall) -> str:
    return json.dumps({"name": call.function.name, "arguments": _arguments(call)})


def completion_prompt_ids(tokenizer, req: CompletionRequest) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        check_text(prompt, "prompt")
        ids = encode(tokenizer, prompt, "prompt")
    else:
        ids = list(prompt)
        check_token_ids(ids, len(tokenizer))
    if not ids:
        raise bad_request("prompt is empty", "prompt")
    return ids


def check_text(text: str, param: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate) before a tokenizer sees it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(
            f"{param} is not valid Unicode: a lone UTF-16 surrogate "
            f"({text[e.start]!a}) at character {e.start}",
            param,
            "invalid_text",
        ) from e


def encode(tokenizer, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    try:
        return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    except Exception as e:  # noqa: BLE001 - whatever the tokenizer refuses is the client's input
        raise bad_request(
            f"the tokenizer refused {param}: {type(e).__name__}: {e}", param, "invalid_text"
        ) from e


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}", "prompt")


# ---- sampling ------------------------------------------------------------------------------
def eos_ids(tokenizer) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def output_budget(
    requested: int | None, prompt_len: int, max_context: int, prompt_param: str
) -> int:
    """max_tokens, checked against the context; None means "up to the end of the context"."""
    if prompt_len >= max_context:
        raise bad_request(
            f"the prompt is {prompt_len} tokens; this model's context length is {max_context}",
            prompt_param,
            "context_length_exceeded",
        )
    if requested is None:
        return max_context - prompt_len
    if prompt_len + requested > max_context:
        raise bad_request(
            f"prompt ({prompt_len} tokens) + max_tokens ({requested}) exceeds the context "
            f"length ({max_context})",
            "max_tokens",
            "context_length_exceeded",
        )
    return requested


def sampling_params(fields: SamplingFields, max_new_tokens: int, tokenizer,
                    grammar: GrammarSpec | None = None) -> SamplingParams:
    top_k = fields.top_k or 0
    return SamplingParams(
        temperature=1.0 if fields.temperature is None else fields.temperature,  # OpenAI's default
        top_p=1.0 if fields.top_p is None else fields.top_p,
        top_k=max(0, top_k),  # -1 (vLLM's "off") and 0 both disable top-k
        min_p=fields.min_p or 0.0,
        seed=fields.seed,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_ids(fields, tokenizer),
        ignore_eos=bool(fields.ignore_eos),
        min_tokens=min_tokens(fields.min_tokens, max_new_tokens),
        frequency_penalty=fields.frequency_penalty or 0.0,
        presence_penalty=fields.presence_penalty or 0.0,
        logit_bias=logit_bias(fields.logit_bias, len(tokenizer)),
        repetition_penalty=1.0 if fields.repetition_penalty is None else fields.repetition_penalty,
        grammar=grammar,
    )


def stop_ids(fields: SamplingFields, tokenizer) -> tuple[int, ...]:
    """The tokens that end an answer: the model's EOS unless `ignore_eos`, and vLLM's
    `stop_token_ids`, checked against the vocabulary."""
    extra = tuple(fields.stop_token_ids or ())
    if any(t >= len(tokenizer) for t in extra):
        raise bad_request(f"stop_token_ids must be below the vocabulary size ({len(tokenizer)})",
                          "stop_token_ids")
    eos = () if fields.ignore_eos else eos_ids(tokenizer)
    return tuple(dict.fromkeys(eos + extra))


def min_tokens(requested: int | None, max_new_tokens: int) -> int:
    if requested and requested > max_new_tokens:
        raise bad_request(f"min_tokens ({requested}) exceeds the tokens this request may generate "
                          f"({max_new_tokens})", "min_tokens")
    return requested or 0


def logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} -> ((id, bias), ...), ids checked against the vocabulary.
    Keys are digit strings (protocol.py), but "7" and "07" name one token."""
    pairs: dict[int, float] = {}
    for key, value in (bias or {}).items():
        t = int(key)
        if t >= vocab:
            raise bad_request(f"logit_bias names token {t}, outside the vocabulary ({vocab} tokens)",
                              "logit_bias")
        if t in pairs:
            raise bad_request(f"logit_bias names token {t} twice", "logit_bias")
        pairs[t] = float(value)
    return tuple(sorted(pairs.items()))
