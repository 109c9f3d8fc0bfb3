"""/v1/completions and /v1/chat/completions (OpenAI shapes, SSE streaming)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from starlette.concurrency import run_in_threadpool

from ..engine.decode_engine import DecodeEngine, GenerationEvent
from ..engine.sequence import SamplingParams
from ..errors import NotFoundError, UnavailableError, UnsupportedError, ValidationError


@dataclass
class Generator:
    """A loaded decoder: its served name, engine and tokenizer."""

    name: str
    engine: DecodeEngine
    tokenizer: Any


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


def build_router(state) -> APIRouter:
    """Routes bound to the app's state (its `generator` attribute, once loaded)."""
    from .app import _parse_body, _wait_disconnect

    router = APIRouter()

    def generator_for(body: _Common) -> Generator:
        gen: Generator | None = state.generator
        if state.config.generate_model == "none":
            raise NotFoundError("generation is off on this server (--generate-model none)", param="model")
        if gen is None:
            raise UnavailableError("the generation model is loading; retry shortly", retry_after=5)
        if body.model is not None and body.model != gen.name:
            raise NotFoundError(f"model {body.model!r} is not a generation model served here; this server "
                                f"generates with {gen.name!r} (GET /v1/models)", param="model")
        return gen

    async def run(request: Request, gen: Generator, body: _Common, prompt_ids: list[int],
                  params: SamplingParams, kind: str):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        seq_id = gen.engine.add(prompt_ids, params, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        stream_opts = body.stream_options or {}

        def chunk(text: str | None, finish: str | None, first: bool = False) -> dict:
            if kind == "chat":
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                return {"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": gen.name, "choices": [choice]}
            return {"id": rid, "object": "text_completion", "created": created, "model": gen.name,
                    "choices": [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]}

        if body.stream:
            async def sse():
                finished = False
                try:
                    if kind == "chat":
                        yield f"data: {json.dumps(chunk(None, None, first=True))}\n\n"
                    while True:
                        ev = await queue.get()
                        if ev.text or ev.finish_reason:
                            yield f"data: {json.dumps(chunk(ev.text, ev.finish_reason))}\n\n"
                        if ev.finish_reason:
                            finished = True
                            if stream_opts.get("include_usage"):
                                c = chunk(None, None)
                                c["choices"] = []
                                c["usage"] = _usage(ev)
                                yield f"data: {json.dumps(c)}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                finally:
                    if not finished:
                        gen.engine.abort(seq_id)

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        gone = asyncio.ensure_future(_wait_disconnect(request))
        parts: list[str] = []
        try:
            while True:
                get = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    gen.engine.abort(seq_id)
                    return JSONResponse({}, status_code=499)
                ev = get.result()
                parts.append(ev.text)
                if ev.finish_reason:
                    break
        except asyncio.CancelledError:
            gen.engine.abort(seq_id)
            raise
        finally:
            gone.cancel()
        if ev.finish_reason == "error":
            raise UnavailableError("generation failed on the server; retry", retry_after=1)
        text = "".join(parts)
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": ev.finish_reason, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": ev.finish_reason, "logprobs": None}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": gen.name,
                             "choices": [choice], "usage": _usage(ev)})

    @router.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse_body(request, CompletionRequest)
        gen = generator_for(body)
        if body.echo:
            raise UnsupportedError("echo is not supported", param="echo")
        if isinstance(body.prompt, str):
            if not body.prompt:
                raise ValidationError("`prompt` is empty", param="prompt")
            ids = await run_in_threadpool(lambda: gen.tokenizer(body.prompt).input_ids)
        else:
            if not body.prompt:
                raise ValidationError("`prompt` is an empty token list", param="prompt")
            vocab = gen.engine.model.cfg.vocab_size
            bad = next((t for t in body.prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValidationError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
            ids = list(body.prompt)
        return await run(request, gen, body, ids, _params(body, 16), "completion")

    @router.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _parse_body(request, ChatRequest)
        gen = generator_for(body)
        msgs = [{"role": m.role, "content": _message_text(m.content, i)} for i, m in enumerate(body.messages)]

        def encode():
            out = gen.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if hasattr(out, "keys") else out)

        ids = await run_in_threadpool(encode)
        max_default = gen.engine.config.max_model_len - len(ids)
        return await run(request, gen, body, ids, _params(body, max(1, min(max_default, 512))), "chat")

    return router
