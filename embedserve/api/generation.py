"""/v1/completions and /v1/chat/completions (OpenAI shapes, SSE streaming)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from starlette.concurrency import run_in_threadpool

from ..engine.decode_engine import GenerationEvent
from ..engine.generator import Generator
from ..engine.sequence import MAX_LOGPROBS, SamplingParams, TokenLogprob
from ..errors import NotFoundError, UnavailableError, UnsupportedError, ValidationError
from .openapi import route_doc
from .common import parse_body, wait_disconnect
from .state import AppState


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


class _Common(BaseModel):
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


class CompletionRequest(_Common):
    prompt: str | list[StrictInt]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: Any = None
    best_of: Any = None
    suffix: Any = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str | list[dict]


class ChatRequest(_Common):
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


def _refuse_not_implemented(body: _Common) -> None:
    """A field we do not implement is refused by name unless its value changes nothing."""
    for name, harmless in _NOT_IMPLEMENTED.items():
        value = getattr(body, name, None)
        if value is not None and value not in harmless:
            instead = f" or set it to {json.dumps(harmless[0])}" if harmless else ""
            raise UnsupportedError(f"`{name}` is not supported by this server; remove it{instead}", param=name)


def _num_logprobs(body: _Common) -> int | None:
    """Top logprobs per token, or None for no logprobs (completions: `logprobs: k`; chat:
    `logprobs: true` with an optional `top_logprobs: k`)."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise ValidationError("`top_logprobs` needs `logprobs: true`; set it or remove top_logprobs",
                              param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _params(body: _Common, default_max: int) -> SamplingParams:
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


def _message_text(content: str | list[dict], i: int) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise UnsupportedError(f"message {i} has a content part of type {part.get('type')!r}; only text "
                                   "parts are supported", param=f"messages.{i}.content")
        parts.append(part["text"])
    return "".join(parts)


def _usage(ev: GenerationEvent) -> dict:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": ev.cached_tokens}}


@dataclass
class _Reply:
    """One generation's response framing: ids, kind (chat or completion), the model's name."""

    gen: Generator
    kind: str
    stream_opts: dict
    rid: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text_offset: int = 0            # completions' logprobs: characters of the tokens reported so far

    def __post_init__(self):
        self.rid = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]

    def chunk(self, text: str | None, finish: str | None, first: bool = False,
              logprobs: list[TokenLogprob] | None = None) -> dict:
        """One SSE chunk in OpenAI's format, with the logprobs of the tokens sampled since the last."""
        lp = self.logprobs(logprobs)
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
            return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.gen.name, "choices": [choice]}
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.gen.name,
                "choices": [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lp}]}

    def whole(self, text: str, ev: GenerationEvent, logprobs: list[TokenLogprob] | None = None) -> dict:
        """The non-streaming response."""
        lp = self.logprobs(logprobs)
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": ev.finish_reason, "logprobs": lp}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": ev.finish_reason, "logprobs": lp}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.gen.name,
                "choices": [choice], "usage": _usage(ev)}

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's logprobs object for these tokens, each token's text decoded on its own (as
        vLLM does; `bytes` are that text's UTF-8). Completions: {tokens, token_logprobs,
        top_logprobs (the top k and the chosen token), text_offset (into the completion)};
        chat: {"content": [{token, logprob, bytes, top_logprobs: the top k}]}."""
        if not entries:
            return None
        ids = list({t: None for e in entries for t in (e.token_id, *(i for i, _ in e.top))})
        text = dict(zip(ids, self.gen.token_texts(ids)))
        if self.kind == "chat":
            def item(t: int, lp: float) -> dict:
                return {"token": text[t], "logprob": lp, "bytes": list(text[t].encode())}
            return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                                for e in entries]}
        offsets, tops = [], []
        for e in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(text[e.token_id])
            top = {text[t]: v for t, v in e.top}
            top.setdefault(text[e.token_id], e.logprob)     # OpenAI's "up to logprobs + 1" entries
            tops.append(top)
        return {"tokens": [text[e.token_id] for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": tops, "text_offset": offsets}


def _sse(reply: _Reply, queue: asyncio.Queue, seq_id: int):
    """The SSE stream; a client that leaves early aborts the sequence (its blocks are freed)."""
    async def events():
        finished = False
        try:
            if reply.kind == "chat":
                yield f"data: {json.dumps(reply.chunk(None, None, first=True))}\n\n"
            while True:
                ev = await queue.get()
                if ev.text or ev.finish_reason:
                    yield f"data: {json.dumps(reply.chunk(ev.text, ev.finish_reason, logprobs=ev.logprobs))}\n\n"
                if ev.finish_reason:
                    finished = True
                    if reply.stream_opts.get("include_usage"):
                        c = reply.chunk(None, None)
                        c["choices"] = []
                        c["usage"] = _usage(ev)
                        yield f"data: {json.dumps(c)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not finished:
                reply.gen.abort(seq_id)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _collect(request: Request, reply: _Reply, queue: asyncio.Queue, seq_id: int):
    """Wait for the whole answer; a client that leaves first aborts the sequence (499)."""
    gone = asyncio.ensure_future(wait_disconnect(request))
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    try:
        while True:
            get = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                reply.gen.abort(seq_id)
                return JSONResponse({}, status_code=499)
            ev = get.result()
            parts.append(ev.text)
            logprobs += ev.logprobs or ()
            if ev.finish_reason:
                break
    except asyncio.CancelledError:
        reply.gen.abort(seq_id)
        raise
    finally:
        gone.cancel()
    if ev.finish_reason == "error":           # a failed step (retry), or the engine's thread died (why)
        problem = reply.gen.health_problem()
        raise UnavailableError("generation failed on the server" + (f": {problem}" if problem else "; retry"),
                               retry_after=1)
    return JSONResponse(reply.whole("".join(parts), ev, logprobs))


async def _run(request: Request, gen: Generator, body: _Common, prompt_ids: list[int],
               params: SamplingParams, kind: str):
    """Queue the sequence and answer as a stream or as one response."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
    seq_id = gen.add(prompt_ids, params, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
    reply = _Reply(gen, kind, body.stream_options.model_dump(exclude_none=True) if body.stream_options else {})
    if body.stream:
        return _sse(reply, queue, seq_id)
    return await _collect(request, reply, queue, seq_id)


def build_router(state: AppState) -> APIRouter:
    """Routes bound to the app's state (its `generator`, once loaded)."""
    router = APIRouter()

    def generator_for(body: _Common) -> Generator:
        gen = state.generator
        if not state.config.decode.enabled:
            raise NotFoundError("generation is off on this server (--generate-model none)", param="model")
        if gen is None:
            raise UnavailableError("the generation model is loading; retry shortly", retry_after=5)
        if body.model is not None and body.model != gen.name:
            raise NotFoundError(f"model {body.model!r} is not a generation model served here; this server "
                                f"generates with {gen.name!r} (GET /v1/models)", param="model")
        return gen

    @router.post("/v1/completions", **route_doc(CompletionRequest, 404, ok=CompletionResponse, stream=CompletionChunk))
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        gen = generator_for(body)
        if isinstance(body.prompt, str):
            if not body.prompt:
                raise ValidationError("`prompt` is empty", param="prompt")
            ids = await run_in_threadpool(gen.encode_prompt, body.prompt)
        else:
            if not body.prompt:
                raise ValidationError("`prompt` is an empty token list", param="prompt")
            vocab = gen.vocab_size
            bad = next((t for t in body.prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValidationError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
            ids = list(body.prompt)
        return await _run(request, gen, body, ids, _params(body, 16), "completion")

    @router.post("/v1/chat/completions", **route_doc(ChatRequest, 404, ok=ChatCompletionResponse, stream=ChatCompletionChunk))
    async def chat(request: Request):
        body = await parse_body(request, ChatRequest)
        gen = generator_for(body)
        msgs = [{"role": m.role, "content": _message_text(m.content, i)} for i, m in enumerate(body.messages)]
        ids = await run_in_threadpool(gen.encode_chat, msgs)
        max_default = gen.max_model_len - len(ids)
        return await _run(request, gen, body, ids, _params(body, max(1, min(max_default, 512))), "chat")

    return router
