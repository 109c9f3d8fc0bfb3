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
from ..engine.sequence import SamplingParams
from ..errors import NotFoundError, UnavailableError, UnsupportedError, ValidationError
from .common import parse_body, wait_disconnect
from .state import AppState


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=0, ge=0)
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    user: str | None = Field(default=None, max_length=256)
    logprobs: Any = None


class CompletionRequest(_Common):
    prompt: str | list[StrictInt]
    echo: StrictBool = False


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[dict]


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)


def _params(body: _Common, default_max: int) -> SamplingParams:
    if body.n != 1:
        raise UnsupportedError("n > 1 is not supported; send separate requests", param="n")
    if body.logprobs not in (None, False, 0):
        raise UnsupportedError("logprobs are not supported", param="logprobs")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or default_max
    return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                          max_tokens=max_tokens, stop=stop, seed=body.seed, ignore_eos=body.ignore_eos)


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

    def __post_init__(self):
        self.rid = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]

    def chunk(self, text: str | None, finish: str | None, first: bool = False) -> dict:
        """One SSE chunk in OpenAI's format."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.gen.name, "choices": [choice]}
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.gen.name,
                "choices": [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]}

    def whole(self, text: str, ev: GenerationEvent) -> dict:
        """The non-streaming response."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": ev.finish_reason, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": ev.finish_reason, "logprobs": None}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.gen.name,
                "choices": [choice], "usage": _usage(ev)}


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
                    yield f"data: {json.dumps(reply.chunk(ev.text, ev.finish_reason))}\n\n"
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
            if ev.finish_reason:
                break
    except asyncio.CancelledError:
        reply.gen.abort(seq_id)
        raise
    finally:
        gone.cancel()
    if ev.finish_reason == "error":
        raise UnavailableError("generation failed on the server; retry", retry_after=1)
    return JSONResponse(reply.whole("".join(parts), ev))


async def _run(request: Request, gen: Generator, body: _Common, prompt_ids: list[int],
               params: SamplingParams, kind: str):
    """Queue the sequence and answer as a stream or as one response."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
    seq_id = gen.add(prompt_ids, params, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
    reply = _Reply(gen, kind, body.stream_options or {})
    if body.stream:
        return _sse(reply, queue, seq_id)
    return await _collect(request, reply, queue, seq_id)


def build_router(state: AppState) -> APIRouter:
    """Routes bound to the app's state (its `generator`, once loaded)."""
    router = APIRouter()

    def generator_for(body: _Common) -> Generator:
        gen = state.generator
        if state.config.generate_model == "none":
            raise NotFoundError("generation is off on this server (--generate-model none)", param="model")
        if gen is None:
            raise UnavailableError("the generation model is loading; retry shortly", retry_after=5)
        if body.model is not None and body.model != gen.name:
            raise NotFoundError(f"model {body.model!r} is not a generation model served here; this server "
                                f"generates with {gen.name!r} (GET /v1/models)", param="model")
        return gen

    @router.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        gen = generator_for(body)
        if body.echo:
            raise UnsupportedError("echo is not supported", param="echo")
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

    @router.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parse_body(request, ChatRequest)
        gen = generator_for(body)
        msgs = [{"role": m.role, "content": _message_text(m.content, i)} for i, m in enumerate(body.messages)]
        ids = await run_in_threadpool(gen.encode_chat, msgs)
        max_default = gen.max_model_len - len(ids)
        return await _run(request, gen, body, ids, _params(body, max(1, min(max_default, 512))), "chat")

    return router
