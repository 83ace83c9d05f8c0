"""Log-probabilities in OpenAI's two shapes: chat's `logprobs.content` list, and the legacy
completions object of parallel lists.

`TokenTexts` names each token as OpenAI does: its text and its UTF-8 bytes. A byte-level BPE
token can hold part of a character; its `token` is then `bytes:\\xNN...` and `bytes` is exact.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from sglang_d3d.speculative.logprobs import TokenLogprob

# JSON has no -inf; a token the model rules out entirely reads as this (vLLM does the same).
LOGPROB_FLOOR = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


@dataclass(frozen=True)
class ScoredToken:
    """An emitted token's log-probabilities and where its text starts in the output."""

    logprob: TokenLogprob
    text_offset: int


class TokenTexts:
    """token id -> (text, UTF-8 bytes), cached. Built once per tokenizer (off the event loop:
    reading the tokenizer's JSON takes a moment on a large vocabulary)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._byte_map = _byte_level_map(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._name(token_id)
        return hit

    def _name(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._tok.convert_ids_to_tokens(token_id)
        if self._byte_map is not None and all(c in self._byte_map for c in piece):
            raw = bytes(self._byte_map[c] for c in piece)
        elif m := _BYTE_TOKEN.fullmatch(piece):
            raw = bytes([int(m.group(1), 16)])
        else:
            raw = self._tok.convert_tokens_to_string([piece]).encode("utf-8")
        return token_string(raw), list(raw)


def token_string(raw: bytes) -> str:
    """A token's text; a token ending inside a character is spelled by its bytes."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _byte_level_map(tokenizer) -> dict[str, int] | None:
    """GPT-2 byte-level BPE spells each byte as a printable character; the inverse of that map,
    if this tokenizer decodes byte-level, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    if "ByteLevel" not in kinds:
        return None
    return {c: b for b, c in byte_level_alphabet().items()}


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, and the
    other 68 bytes take the characters from U+0100 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(256 + i) for i, b in enumerate(others)})
    return table


def _floor(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


def chat_logprobs(tokens: Sequence[ScoredToken], names: TokenTexts) -> ChatLogprobs:
    def top(token_id: int, lp: float) -> TopLogprob:
        text, raw = names(token_id)
        return TopLogprob(token=text, logprob=_floor(lp), bytes=raw)

    content = []
    for t in tokens:
        chosen = top(t.logprob.token_id, t.logprob.logprob)
        alts = [top(i, lp) for i, lp in t.logprob.top]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=alts))
    return ChatLogprobs(content=content)


def completion_logprobs(tokens: Sequence[ScoredToken], names: TokenTexts) -> CompletionLogprobs:
    """The legacy shape: per token its text, log-probability, the k likeliest alternatives
    plus the token itself (OpenAI always includes the sampled token), and its text offset."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for t in tokens:
        lp = t.logprob
        out.tokens.append(names(lp.token_id)[0])
        out.token_logprobs.append(_floor(lp.logprob))
        alts = {names(i)[0]: _floor(x) for i, x in lp.top}
        alts.setdefault(names(lp.token_id)[0], _floor(lp.logprob))
        out.top_logprobs.append(alts)
        out.text_offset.append(t.text_offset)
    return out
