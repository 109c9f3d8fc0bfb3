"""The request and response bodies of /v1/completions and /v1/chat/completions (OpenAI's shapes),
and a request turned into the engine's SamplingParams: what is not implemented refused by name."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from ..engine.sequence import MAX_LOGPROBS, SamplingParams
from ..errors import UnsupportedError, ValidationError

# OpenAI (and vLLM) fields that would change the output and that this server does not
# implement, each with the values that change nothing: any other value is refused by name.
# Fields that are no field at all are refused too (extra="forbid"): nothing is silently dropped.
_NOT_IMPLEMENTED: dict[str, tuple] = {
    "echo": (False,), "best_of": (1,), "suffix": ("",),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "response_format": ({"type": "text"},), "modalities": (["text"],), "audio": (), "prediction": (),
    "reasoning_effort": (), "verbosity": (), "web_search_options": (), "moderation": (),
    "repetition_penalty": (1,),
}


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`; any other key is refused by name (extra="forbid")."""
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: StrictBool | None = None


class GenerationRequest(BaseModel):
    """The fields completions and chat requests share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=0, ge=0)
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    repetition_penalty: Any = None
    # accepted, and change nothing in the output
    user: str | None = Field(default=None, max_length=256)


class CompletionRequest(GenerationRequest):
    prompt: str | list[StrictInt]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: Any = None
    best_of: Any = None
    suffix: Any = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str | list[dict]


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    # accepted, and change nothing in the output (tools, which parallel_tool_calls is about, are refused)
    metadata: dict | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    parallel_tool_calls: StrictBool | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    safety_identifier: str | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] = Field(description="`cached_tokens`: prompt tokens found in the "
                                                              "prefix cache")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    """200 of POST /v1/completions without `stream` (OpenAI's shape); with `stream: true` the
    same objects arrive as server-sent events, each choice holding the text since the last."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One server-sent event of POST /v1/completions with `stream: true`: the text since the
    last event; with stream_options.include_usage a last chunk with no choices and the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] | None
    logprobs: ChatLogprobs | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: Literal["stop", "length"] | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of POST /v1/chat/completions with `stream: true` (the first
    carries the role; with stream_options.include_usage a last one with no choices and the usage)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ChatCompletionResponse(BaseModel):
    """200 of POST /v1/chat/completions without `stream` (OpenAI's shape); with `stream: true`,
    `chat.completion.chunk` objects as server-sent events (`delta` in place of `message`)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


def _refuse_not_implemented(body: GenerationRequest) -> None:
    """A field we do not implement is refused by name unless its value changes nothing."""
    for name, harmless in _NOT_IMPLEMENTED.items():
        value = getattr(body, name, None)
        if value is not None and value not in harmless:
            instead = f" or set it to {json.dumps(harmless[0])}" if harmless else ""
            raise UnsupportedError(f"`{name}` is not supported by this server; remove it{instead}", param=name)


def _num_logprobs(body: GenerationRequest) -> int | None:
    """Top logprobs per token, or None for no logprobs (completions: `logprobs: k`; chat:
    `logprobs: true` with an optional `top_logprobs: k`)."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise ValidationError("`top_logprobs` needs `logprobs: true`; set it or remove top_logprobs",
                              param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def sampling_params(body: GenerationRequest, default_max: int) -> SamplingParams:
    """The request's SamplingParams (`default_max` tokens unless it sets max_tokens); fields we do
    not implement, n > 1 and stream_options without stream are refused."""
    _refuse_not_implemented(body)
    if body.n != 1:
        raise UnsupportedError("n > 1 is not supported; send separate requests", param="n")
    if body.stream_options is not None and not body.stream:
        raise ValidationError("`stream_options` is only allowed with `stream: true`; set stream or remove "
                              "stream_options", param="stream_options")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or default_max
    return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                          max_tokens=max_tokens, stop=stop, seed=body.seed, ignore_eos=body.ignore_eos,
                          presence_penalty=body.presence_penalty or 0.0,
                          frequency_penalty=body.frequency_penalty or 0.0,
                          logit_bias=body.logit_bias, logprobs=_num_logprobs(body))


def message_text(content: str | list[dict], i: int) -> str:
    """Message `i`'s text: a string, or its text parts joined (any other part is refused)."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise UnsupportedError(f"message {i} has a content part of type {part.get('type')!r}; only text "
                                   "parts are supported", param=f"messages.{i}.content")
        parts.append(part["text"])
    return "".join(parts)
