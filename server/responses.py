"""Response bodies for the two endpoints, whole or as stream chunks.

Chat and completions differ only in where the text goes (message/delta vs text) and in the
shape of their log-probabilities, so each is a small "format" with the same builders; the
serving code never branches on the endpoint. A response holds one choice per `n`, each with its
index; stream chunks carry one choice each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from pydantic import BaseModel
from sglang_d3d.server.logprobs_out import (
    ChatLogprobs,
    CompletionLogprobs,
    ScoredToken,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
)
from sglang_d3d.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    D3DStats,
    DeltaMessage,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from sglang_d3d.server.tools import parse_call


@dataclass(frozen=True)
class Header:
    """Fields every body and chunk of one response repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def fields(self) -> dict:
        return {"id": self.id, "model": self.model, "created": self.created}


@dataclass
class Answer:
    """One finished choice. scored: its tokens' log-probabilities; None if not asked for."""

    index: int
    text: str
    finish: str | None
    scored: list[ScoredToken] | None = None
    tool_calls: list[ToolCall] | None = None  # a forced call that parsed (then `text` is its JSON)
    token_ids: list[int] | None = None  # the choice's tokens, where `return_token_ids` asked


def as_call(a: Answer) -> Answer:
    """A forced tool call's answer (server/tools.py): its calls and finish reason "tool_calls"
    where the model finished it; as text where `max_tokens` cut it short."""
    calls = parse_call(a.text) if a.finish == "stop" else None
    return a if calls is None else replace(a, tool_calls=calls, finish="tool_calls")


class ChatFormat:
    id_prefix = "chatcmpl-"

    def logprobs(self, scored, names: TokenTexts) -> ChatLogprobs | None:
        return None if scored is None else chat_logprobs(scored, names)

    def whole(self, h: Header, answers: list[Answer], usage: Usage, d3d, names: TokenTexts):
        choices = [
            ChatChoice(
                index=a.index,
                message=AssistantMessage(content=None if a.tool_calls else a.text,
                                         tool_calls=a.tool_calls),
                finish_reason=a.finish,
                logprobs=self.logprobs(a.scored, names),
                token_ids=a.token_ids,
            )
            for a in answers
        ]
        return ChatCompletionResponse(**h.fields(), choices=choices, usage=usage, d3d=d3d)

    def opening(self, h: Header, n: int) -> list[BaseModel]:
        # OpenAI's first chunk of each choice announces the role with empty content.
        delta = DeltaMessage(role="assistant", content="")
        return [
            ChatCompletionChunk(**h.fields(), choices=[ChatChunkChoice(index=i, delta=delta)])
            for i in range(n)
        ]

    def text(self, h: Header, a: Answer, names: TokenTexts) -> BaseModel:
        delta = DeltaMessage(content=a.text)
        lp = self.logprobs(a.scored, names)
        choice = ChatChunkChoice(index=a.index, delta=delta, logprobs=lp)
        return ChatCompletionChunk(**h.fields(), choices=[choice])

    def last(self, h: Header, index: int, finish: str, d3d: D3DStats | None) -> BaseModel:
        choice = ChatChunkChoice(index=index, delta=DeltaMessage(), finish_reason=finish)
        return ChatCompletionChunk(**h.fields(), choices=[choice], d3d=d3d)

    def calls(self, h: Header, a: Answer, names: TokenTexts) -> BaseModel:
        """A forced tool call, whole in one chunk (OpenAI's clients append the pieces)."""
        deltas = [ToolCallDelta(index=i, id=c.id, function=c.function)
                  for i, c in enumerate(a.tool_calls or [])]
        choice = ChatChunkChoice(index=a.index, delta=DeltaMessage(tool_calls=deltas),
                                 logprobs=self.logprobs(a.scored, names))
        return ChatCompletionChunk(**h.fields(), choices=[choice])

    def usage(self, h: Header, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(**h.fields(), choices=[], usage=usage)


class CompletionFormat:
    id_prefix = "cmpl-"

    def logprobs(self, scored, names: TokenTexts) -> CompletionLogprobs | None:
        return None if scored is None else completion_logprobs(scored, names)

    def whole(self, h: Header, answers: list[Answer], usage: Usage, d3d, names: TokenTexts):
        choices = [
            CompletionChoice(
                index=a.index,
                text=a.text,
                finish_reason=a.finish,
                logprobs=self.logprobs(a.scored, names),
                token_ids=a.token_ids,
            )
            for a in answers
        ]
        return CompletionResponse(**h.fields(), choices=choices, usage=usage, d3d=d3d)

    def opening(self, h: Header, n: int) -> list[BaseModel]:
        return []

    def text(self, h: Header, a: Answer, names: TokenTexts) -> BaseModel:
        lp = self.logprobs(a.scored, names)
        choice = CompletionChoice(index=a.index, text=a.text, logprobs=lp)
        return CompletionChunk(**h.fields(), choices=[choice])

    def last(self, h: Header, index: int, finish: str, d3d: D3DStats | None) -> BaseModel:
        choice = CompletionChoice(index=index, text="", finish_reason=finish)
        return CompletionChunk(**h.fields(), choices=[choice], d3d=d3d)

    def usage(self, h: Header, usage: Usage) -> BaseModel:
        return CompletionChunk(**h.fields(), choices=[], usage=usage)


ResponseFormat = ChatFormat | CompletionFormat
