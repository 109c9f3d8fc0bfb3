"""POST /tokenize and /detokenize in vLLM's shape, for every served model (embedders,
rerankers, the decoder): ingestion jobs count tokens to chunk documents without loading the
tokenizer themselves. TEI's per-token view (`id`, `text`, `special`, `start`, `stop`, character
offsets into the text) on request.

    /tokenize    {model, prompt | messages, add_special_tokens, input_type, return_token_strs, return_offsets}
                 -> {model, count, max_model_len, tokens, token_strs?, offsets?}
    /detokenize  {model, tokens, skip_special_tokens} -> {model, prompt}
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from starlette.concurrency import run_in_threadpool

from ..errors import ValidationError
from .common import check_unicode, parse_body
from .generation_schemas import ChatMessage, message_text
from .openapi import route_doc
from .state import AppState


class TokenizeRequest(BaseModel):
    """POST /tokenize: `prompt` (any model) or `messages` (the generation model's chat template)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(default=None, description="any served model (default: the default embedder, "
                                                        "else the generation model)")
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    input_type: Literal["query", "passage"] | None = Field(default=None, description="an embedder's prefix, as "
                                                           "/v1/embeddings applies it")
    return_token_strs: StrictBool = False
    return_offsets: StrictBool = False


class TokenOffset(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None = Field(description="character offset of the token's text in the prompt (None: special)")
    stop: int | None = None


class TokenizeResponse(BaseModel):
    """200 of POST /tokenize."""

    model: str
    count: int
    max_model_len: int = Field(description="the model's input limit: an embedder's longest input, the decoder's "
                                           "context")
    tokens: list[int]
    token_strs: list[str] | None = None
    offsets: list[TokenOffset] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[StrictInt] = Field(..., min_length=1)
    skip_special_tokens: StrictBool = False


class DetokenizeResponse(BaseModel):
    """200 of POST /detokenize."""

    model: str
    prompt: str


def _pick(state: AppState, requested: str | None, chat: bool = False):
    """(served name, an encoder engine or the generator) for `requested`; None: the generation
    model for a chat, else the default embedder, else the first encoder, else the generation model."""
    gen = state.generator
    if gen is not None and (requested == gen.name or (requested is None and (chat or not state.embedders))):
        return gen.name, gen
    engine = state.find(requested, also=[gen.name] if gen is not None else [])
    if engine is None:
        engine = state.embedder or next(iter(state.embedders.values()))
    return state.name_of(engine), engine


def _encoder_tokens(engine, body: TokenizeRequest) -> dict:
    model = engine.model
    if body.messages is not None:
        raise ValidationError("`messages` uses a chat template, which only the generation model has; send `prompt`",
                              param="messages")
    text = model.prefixes.get(body.input_type or "", "") + body.prompt
    enc = model.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    out = {"tokens": list(enc.ids), "max_model_len": engine.max_input_length}
    if body.return_token_strs:
        out["token_strs"] = list(enc.tokens)
    if body.return_offsets:
        out["offsets"] = [_offset(i, tok, special, off, text)
                          for i, tok, special, off in zip(enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets)]
    return out


def _generator_tokens(gen, body: TokenizeRequest) -> dict:
    tok = gen.tokenizer
    if body.messages is not None:
        msgs = [{"role": m.role, "content": message_text(m.content, i)} for i, m in enumerate(body.messages)]
        text = tok.apply_chat_template(msgs, add_generation_prompt=body.add_generation_prompt, tokenize=False)
        specials = False                      # the template writes the model's specials itself
    else:
        text, specials = body.prompt, body.add_special_tokens
    enc = tok(text, add_special_tokens=specials, return_offsets_mapping=True, return_special_tokens_mask=True)
    ids = list(enc["input_ids"])
    out = {"tokens": ids, "max_model_len": gen.max_model_len}
    if body.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    if body.return_offsets:
        strs = tok.convert_ids_to_tokens(ids)
        out["offsets"] = [_offset(i, s, special, off, text)
                          for i, s, special, off in zip(ids, strs, enc["special_tokens_mask"], enc["offset_mapping"])]
    return out


def _offset(token_id: int, token: str, special, span, text: str) -> dict:
    """TEI's per-token record: a special token has no place in the text."""
    if special:
        return {"id": token_id, "text": token, "special": True, "start": None, "stop": None}
    start, stop = int(span[0]), int(span[1])
    return {"id": token_id, "text": text[start:stop], "special": False, "start": start, "stop": stop}


def build_router(state: AppState) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize", **route_doc(TokenizeRequest, 404, ok=TokenizeResponse))
    async def tokenize(request: Request):
        body = await parse_body(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise ValidationError("send exactly one of `prompt` (text) and `messages` (a chat)", param="prompt")
        if body.prompt is not None:
            check_unicode(body.prompt, "`prompt`", "prompt")
        name, target = _pick(state, body.model, chat=body.messages is not None)
        if target is state.generator:
            if body.input_type is not None:
                raise ValidationError("`input_type` is an embedding model's prefix; the generation model has none",
                                      param="input_type")
            out = await run_in_threadpool(_generator_tokens, target, body)
        else:
            out = await run_in_threadpool(_encoder_tokens, target, body)
        return {"model": name, "count": len(out["tokens"]), **out}

    @router.post("/detokenize", **route_doc(DetokenizeRequest, 404, ok=DetokenizeResponse))
    async def detokenize(request: Request):
        body = await parse_body(request, DetokenizeRequest)
        name, target = _pick(state, body.model)
        if target is state.generator:
            vocab, decode = len(target.tokenizer), target.tokenizer.decode
        else:
            tok = target.model.tokenizer
            vocab, decode = tok.get_vocab_size(with_added_tokens=True), tok.decode
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValidationError(f"token id {bad} is outside the vocabulary of {name!r} [0, {vocab})", param="tokens")
        text = await run_in_threadpool(decode, body.tokens, skip_special_tokens=body.skip_special_tokens)
        return {"model": name, "prompt": text}

    return router
