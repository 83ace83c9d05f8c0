"""Response bodies for the two endpoints, whole or as stream chunks.

Chat and completions differ only in where the text goes (message/delta vs text), so each is a
small "format" with the same four builders; the serving code never branches on the endpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pydantic import BaseModel

from server.protocol import (
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
    Usage,
)


@dataclass(frozen=True)
class Header:
    """Fields every body and chunk of one response repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def fields(self) -> dict:
        return {"id": self.id, "model": self.model, "created": self.created}


class ChatFormat:
    id_prefix = "chatcmpl-"

    def whole(self, h: Header, text: str, finish: str, usage: Usage, d3d: D3DStats | None):
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish)
        return ChatCompletionResponse(**h.fields(), choices=[choice], usage=usage, d3d=d3d)

    def opening(self, h: Header) -> list[BaseModel]:
        # OpenAI's first chunk announces the role with empty content.
        delta = DeltaMessage(role="assistant", content="")
        return [ChatCompletionChunk(**h.fields(), choices=[ChatChunkChoice(delta=delta)])]

    def text(self, h: Header, text: str) -> BaseModel:
        choice = ChatChunkChoice(delta=DeltaMessage(content=text))
        return ChatCompletionChunk(**h.fields(), choices=[choice])

    def last(self, h: Header, finish: str, d3d: D3DStats | None) -> BaseModel:
        choice = ChatChunkChoice(delta=DeltaMessage(), finish_reason=finish)
        return ChatCompletionChunk(**h.fields(), choices=[choice], d3d=d3d)

    def usage(self, h: Header, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(**h.fields(), choices=[], usage=usage)


class CompletionFormat:
    id_prefix = "cmpl-"

    def whole(self, h: Header, text: str, finish: str, usage: Usage, d3d: D3DStats | None):
        choice = CompletionChoice(text=text, finish_reason=finish)
        return CompletionResponse(**h.fields(), choices=[choice], usage=usage, d3d=d3d)

    def opening(self, h: Header) -> list[BaseModel]:
        return []

    def text(self, h: Header, text: str) -> BaseModel:
        return CompletionChunk(**h.fields(), choices=[CompletionChoice(text=text)])

    def last(self, h: Header, finish: str, d3d: D3DStats | None) -> BaseModel:
        choice = CompletionChoice(text="", finish_reason=finish)
        return CompletionChunk(**h.fields(), choices=[choice], d3d=d3d)

    def usage(self, h: Header, usage: Usage) -> BaseModel:
        return CompletionChunk(**h.fields(), choices=[], usage=usage)


ResponseFormat = ChatFormat | CompletionFormat
