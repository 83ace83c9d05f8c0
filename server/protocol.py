"""Request and response bodies in OpenAI's shapes (the subset this server supports).

Scalars are strict: `"max_tokens": "5"` or `"stream": 1` is a 400, not a silent coercion, and
floats must be finite (JSON's NaN and Infinity get a message of their own). Known OpenAI fields
the server cannot honour are declared loosely here and refused by `server/unsupported.py` when
set to anything but their neutral value; unknown fields are ignored, as OpenAI's own server and
vLLM do. Responses carry one extra field, `d3d`, with the request's speculative stats; OpenAI
clients ignore it.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_serializer, model_validator
from sglang_d3d.server.logprobs_out import ChatLogprobs, CompletionLogprobs

StrictInt = Annotated[int, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]
StrictStr = Annotated[str, Field(strict=True)]
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=20)]
Seed = Annotated[int, Field(strict=True, ge=0, le=2**63 - 1)]
StopList = Annotated[list[StrictStr], Field(max_length=16)]
TokenId = Annotated[int, Field(strict=True, ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Penalty = Annotated[Finite, Field(ge=-2, le=2)]  # OpenAI's range
# OpenAI's shape: token ids as JSON object keys (strings), each with a bias in [-100, 100]
LogitBias = dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[Finite, Field(ge=-100, le=100)]]

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    name: StrictStr | None = None  # OpenAI requires a name; it changes nothing here
    description: StrictStr | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(None, alias="schema")  # None: any object
    strict: StrictBool | None = None  # the schema is always enforced here


class ResponseFormat(BaseModel):
    """OpenAI's `response_format` (server/structured.py turns it into a grammar)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a `json_schema` object')
        return self


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: StrictStr | None = None  # None: the served model
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Finite, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Finite, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None  # -1 or 0: disabled
    # vLLM's and SGLang's extensions to OpenAI's fields, as they name them (logit rules too)
    min_p: Annotated[Finite, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[Finite, Field(gt=0, le=2)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    ignore_eos: StrictBool | None = None  # the model's end-of-sequence token does not end it
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    seed: Seed | None = None
    stop: StrictStr | StopList | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Logit rules: applied by backends that name them (server/unsupported.py, check_logit_rules)
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    # Structured output (server/structured.py): OpenAI's response_format, or SGLang's own
    # regular expression or EBNF grammar; one of the three at most.
    response_format: ResponseFormat | None = None
    regex: Annotated[StrictStr, Field(min_length=1)] | None = None
    ebnf: Annotated[StrictStr, Field(min_length=1)] | None = None
    # Known OpenAI fields honoured only at their neutral value (server/unsupported.py).
    user: StrictStr | None = None  # an end-user id for abuse monitoring: accepted, not stored
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    # vLLM's extension: each choice also carries the generated token ids (`token_ids`), so a
    # client (d3d datagen) gets exactly what the model produced instead of re-tokenizing text.
    return_token_ids: StrictBool | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    name: StrictStr
    arguments: StrictStr  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only for an assistant turn that made tool calls.
    content: StrictStr | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns only
    tool_call_id: StrictStr | None = None  # tool turns only: the call this answers

    @model_validator(mode="after")
    def _check_roles(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant turn with tool_calls may omit it)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDef(BaseModel):
    name: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: StrictBool | None = None  # the arguments always follow the schema here


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # newer alias
    logprobs: StrictBool | None = None
    top_logprobs: TopLogprobs | None = None
    # Known OpenAI fields honoured only at their neutral value (server/unsupported.py).
    # Tool calls (server/tools.py): made where tool_choice is "required" or names a tool.
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[Any] | None = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token for the engine; None: no log-probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_sequences(self) -> int:
        return self.n

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    # A string, token ids, or a batch of one of either (batches of more are refused: n=1 only).
    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    logprobs: TopLogprobs | None = None  # alternatives per token (OpenAI allows up to 5)
    best_of: Annotated[StrictInt, Field(ge=1, le=128)] | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_sequences(self) -> int:
        """Sequences generated: best_of of them, of which the n best are returned."""
        return max(self.n, self.best_of or self.n)

    @property
    def output_limit(self) -> int:
        return self.max_tokens or 16  # OpenAI's default for /v1/completions


# ---- responses ----


class _OmitNone(BaseModel):
    """Serialises without the optional fields in `_omit` when they are None."""

    _omit: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _drop(self, handler: Any) -> dict:
        data = handler(self)
        for key in self._omit:
            if data.get(key) is None:
                data.pop(key, None)
        return data


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class D3DStats(BaseModel):
    """Speculative decoding stats of one request (the `d3d` field of each response)."""

    mode: str
    num_cycles: int  # verify passes
    copy_cycles: int = 0  # of those, passes of tokens copied from the text, no drafter pass
    mean_accepted_length: float  # tokens gained per verify pass
    branch_hit_rate: float | None  # async mode: share of cycles whose pre-drafted branch matched
    overlap_fraction: float  # share of cycle time with drafter and target running together
    queue_time: float  # seconds waiting before prefill
    prefill_time: float


class AssistantMessage(_OmitNone):
    _omit: ClassVar[tuple[str, ...]] = ("tool_calls",)
    role: Literal["assistant"] = "assistant"
    content: str | None  # None with tool calls (OpenAI's shape)
    tool_calls: list[ToolCall] | None = None


class ToolCallDelta(BaseModel):
    """A streamed tool call: sent whole, in one chunk (a client appends `arguments`)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatChoice(_OmitNone):
    _omit: ClassVar[tuple[str, ...]] = ("token_ids",)
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None  # with `return_token_ids` only


def _now() -> int:
    return int(time.time())


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    d3d: D3DStats | None = None


class DeltaMessage(_OmitNone):
    _omit: ClassVar[tuple[str, ...]] = ("role", "content", "tool_calls")
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_OmitNone):
    _omit: ClassVar[tuple[str, ...]] = ("usage", "d3d")
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    d3d: D3DStats | None = None


class CompletionChoice(_OmitNone):
    _omit: ClassVar[tuple[str, ...]] = ("token_ids",)
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None  # with `return_token_ids` only


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    d3d: D3DStats | None = None


class CompletionChunk(_OmitNone):
    """A streamed /v1/completions event: the response's shape, usage only in the last."""

    _omit: ClassVar[tuple[str, ...]] = ("usage", "d3d")
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    d3d: D3DStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "sglang-d3d"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthStatus(BaseModel):
    status: Literal["ok"] = "ok"
