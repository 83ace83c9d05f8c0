"""Request -> prompt token ids: the chat template for messages, plain encoding for prompts."""

from __future__ import annotations

from collections.abc import Sequence

from server.errors import bad_request
from server.protocol import ChatMessage, CompletionRequest


def chat_prompt_ids(tokenizer, messages: Sequence[ChatMessage]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    # "developer" is OpenAI's newer name for the system role; templates know only "system".
    turns = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in messages
    ]
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - templates raise on e.g. non-alternating roles
        raise bad_request(f"messages do not fit the chat template: {e}", "messages") from e
    # The template already holds the special tokens it wants (BOS, role markers).
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def completion_prompt_ids(tokenizer, req: CompletionRequest) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        ids = tokenizer(prompt)["input_ids"]
    else:
        ids = list(prompt)
        check_token_ids(ids, len(tokenizer))
    if not ids:
        raise bad_request("prompt is empty", "prompt")
    return ids


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}", "prompt")
