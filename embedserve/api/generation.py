"""/v1/completions and /v1/chat/completions: the routes, and the answer as OpenAI's response or
as server-sent events (the bodies and their checks are in generation_schemas)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..engine.decode_engine import GenerationEvent
from ..engine.generator import Generator
from ..engine.sequence import SamplingParams, TokenLogprob
from ..errors import NotFoundError, UnavailableError, ValidationError
from .common import parse_body, wait_disconnect
from .generation_schemas import (ChatCompletionChunk, ChatCompletionResponse, ChatRequest, CompletionChunk,
                                 CompletionRequest, CompletionResponse, GenerationRequest, message_text,
                                 sampling_params)
from .openapi import route_doc
from .state import AppState


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


async def _run(request: Request, gen: Generator, body: GenerationRequest, prompt_ids: list[int],
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

    def generator_for(body: GenerationRequest) -> Generator:
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
        return await _run(request, gen, body, ids, sampling_params(body, 16), "completion")

    @router.post("/v1/chat/completions", **route_doc(ChatRequest, 404, ok=ChatCompletionResponse, stream=ChatCompletionChunk))
    async def chat(request: Request):
        body = await parse_body(request, ChatRequest)
        gen = generator_for(body)
        msgs = [{"role": m.role, "content": message_text(m.content, i)} for i, m in enumerate(body.messages)]
        ids = await run_in_threadpool(gen.encode_chat, msgs)
        max_default = gen.max_model_len - len(ids)
        return await _run(request, gen, body, ids, sampling_params(body, max(1, min(max_default, 512))), "chat")

    return router
