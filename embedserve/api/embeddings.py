"""POST /v1/embeddings: OpenAI's request and response shapes plus embedserve's extensions
(`embedding_types`, `input_type`, `truncate`).

`input` is validated by hand rather than by a pydantic union, so each error names the
offending index and says what to change instead of listing four union branches.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from starlette.concurrency import run_in_threadpool

from ..engine.batch_queue import EmbedRequest
from ..errors import UnsupportedError, ValidationError
from .openapi import route_doc
from .common import check_unicode, embed_via_engine, parse_body
from .state import AppState

# A request this small is tokenized and rendered on the event loop (~0.1 ms each) rather than
# handed to the thread pool and back, two thread wake-ups per request that take the cores from
# the model's threads when many one-text requests arrive.
INLINE_CHARS = 2048
INLINE_FLOATS = 8192


def _small_output(req: EmbedRequest) -> bool:
    n = 0
    for out in req.outputs:
        if out.colbert is not None:
            return False
        n += 0 if out.dense is None else len(out.dense)
        n += 0 if out.sparse is None else 2 * len(out.sparse[0])
    return n <= INLINE_FLOATS


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI's fields plus embedserve's extensions)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: Any = Field(..., description="a string, a list of strings, a list of token ids, or a list of such lists",
                       json_schema_extra={"anyOf": [
                           {"type": "string", "minLength": 1},
                           {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                           {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                           {"type": "array", "minItems": 1,
                            "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}}]})
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = Field(default=None, max_length=256)
    # extensions
    embedding_types: list[Literal["dense", "sparse", "colbert"]] | None = Field(default=None, min_length=1)
    input_type: Literal["query", "passage"] | None = None
    prompt_name: str | None = Field(default=None, max_length=256, description="one of the model's named prompts "
                                    "(GET /v1/models lists them); query and passage are input_type's two")
    truncate: StrictBool = False
    truncation_direction: Literal["right", "left", "Right", "Left"] = Field(
        default="right", description="with truncate: keep the first tokens (right, the default) or the last (left)")


class SparseEmbedding(BaseModel):
    """Lexical weights: vocabulary ids and their weights."""

    indices: list[int]
    values: list[float]


class EmbeddingObject(BaseModel):
    object: Literal["embedding"]
    index: int = Field(description="the input's position in the request")
    embedding: list[float] | str | None = Field(
        default=None, description="the dense vector (with `dense` in `embedding_types`, the default); with "
                                  "encoding_format=base64 its little-endian float32 bytes in base64")
    sparse_embedding: SparseEmbedding | None = None
    colbert_embedding: list[list[float]] | None = Field(default=None, description="one vector per token")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    truncated_inputs: list[int] | None = Field(default=None, description="inputs cut with truncate=true")
    truncated_tokens: int | None = Field(default=None, description="tokens cut from them in all")


class EmbeddingResponse(BaseModel):
    """200 of POST /v1/embeddings (OpenAI's shape; sparse and ColBERT vectors as asked)."""

    object: Literal["list"]
    data: list[EmbeddingObject]
    model: str
    usage: EmbeddingUsage


def parse_inputs(raw: Any, max_inputs: int) -> tuple[list[str] | None, list[list[int]] | None]:
    """Split `input` into texts or token-id lists, refusing anything ambiguous or empty."""
    if isinstance(raw, str):
        raw = [raw]
        single = True
    else:
        single = False
    if not isinstance(raw, list):
        raise ValidationError("`input` must be a string, a list of strings, a list of token ids or a "
                              f"list of token-id lists, not {type(raw).__name__}", param="input")
    if not raw:
        raise ValidationError("`input` is an empty list; send at least one text", param="input")
    if len(raw) > max_inputs:
        raise ValidationError(f"`input` has {len(raw)} items; the limit (--max-client-batch-size) is "
                              f"{max_inputs}; split the request", param="input", code="too_many_inputs")
    if all(isinstance(x, str) for x in raw):
        for i, t in enumerate(raw):
            if not t.strip():
                where = "`input`" if single else f"input {i}"
                raise ValidationError(f"{where} is an empty string; every input needs text", param="input")
            check_unicode(t, "`input`" if single else f"input {i}", "input")
        return raw, None
    if all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        return None, [raw]
    if all(isinstance(x, list) for x in raw):
        for i, ids in enumerate(raw):
            if not ids:
                raise ValidationError(f"input {i} is an empty token list", param="input")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValidationError(f"input {i} must be a list of integer token ids", param="input")
        return None, raw
    odd = next((i for i, x in enumerate(raw) if not isinstance(x, (str, int, list)) or isinstance(x, bool)), None)
    if odd is not None:
        raise ValidationError(f"input {odd} is a {type(raw[odd]).__name__}; inputs are strings, integer token "
                              "ids or lists of token ids", param="input")
    raise ValidationError("`input` mixes types; send all strings, or all token ids, or all token-id lists",
                          param="input")


def build_router(state: AppState) -> APIRouter:
    """The embeddings route, bound to the app's state."""
    router = APIRouter()

    @router.post("/v1/embeddings", **route_doc(EmbeddingRequest, 404, ok=EmbeddingResponse))
    async def embeddings(request: Request):
        body = await parse_body(request, EmbeddingRequest)
        engine = state.require_embedder(body.model)
        name = state.name_of(engine)
        want = _check_types(name, engine, body)
        inputs = await _token_inputs(state, engine, body)
        limit = engine.max_input_length
        truncated, cut = [], 0
        for i, ids in enumerate(inputs):
            if len(ids) > limit:
                if not body.truncate:
                    raise ValidationError(f"input {i} has {len(ids):,} tokens; the limit is {limit:,}; send "
                                          "shorter input or set truncate=true", param="input",
                                          code="context_length_exceeded")
                inputs[i] = engine.truncate(ids, limit, body.truncation_direction.lower())
                truncated.append(i)
                cut += len(ids) - len(inputs[i])
        req = await embed_via_engine(state, inputs, want, request, engine)
        if req is None:
            return Response(status_code=499)
        if _small_output(req):
            payload = render_embeddings(req, body, name, truncated, cut)
        else:
            payload = await run_in_threadpool(render_embeddings, req, body, name, truncated, cut)
        return Response(payload, media_type="application/json")

    return router


def _check_types(name: str, engine, body: EmbeddingRequest) -> set[str]:
    """The embedding types to compute; refuses what this model cannot give."""
    spec = engine.spec
    if body.dimensions is not None and body.dimensions != spec.dim:
        raise UnsupportedError(f"model {name!r} has {spec.dim} dimensions and was not "
                               "trained to be shortened (Matryoshka); omit `dimensions`", param="dimensions")
    # default: dense, or everything a model without a dense output has (a SPLADE model: sparse)
    want = set(body.embedding_types or (["dense"] if "dense" in engine.embedding_types else engine.embedding_types))
    missing = sorted(want - engine.embedding_types)
    if missing:
        has = sorted(engine.embedding_types)
        raise UnsupportedError(f"model {name!r} has no {' or '.join(missing)} head (a BGE-M3 directory with "
                               "sparse_linear.pt / colbert_linear.pt has sparse and ColBERT heads, a SPLADE model "
                               f"only sparse); this one gives {has}: request embedding_types={has}",
                               param="embedding_types")
    return want


async def _token_inputs(state: AppState, engine, body: EmbeddingRequest) -> list[list[int]]:
    """Token ids of every input (tokenized off the event loop), with the model's specials."""
    texts, id_lists = parse_inputs(body.input, state.config.http.max_client_batch_size)
    prompt = engine.prompt_name(body.prompt_name, body.input_type)
    if texts is not None:
        if sum(map(len, texts)) <= INLINE_CHARS:
            return engine.tokenize(texts, prompt)
        return await run_in_threadpool(engine.tokenize, texts, prompt)
    asked = body.prompt_name or body.input_type        # token ids never get a default prompt
    if engine.has_prefix(asked):
        raise ValidationError(f"the prompt {asked!r} adds text before the input and cannot apply to token-id input; "
                              "send text, or include the prompt's tokens yourself",
                              param="prompt_name" if body.prompt_name else "input_type")
    vocab = engine.spec.vocab_size
    for i, ids in enumerate(id_lists):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValidationError(f"input {i} has token id {bad}, outside this model's vocabulary "
                                  f"[0, {vocab})", param="input")
    return [engine.wrap_token_ids(ids) for ids in id_lists]


def render_embeddings(req: EmbedRequest, body: EmbeddingRequest, name: str, truncated: list[int],
                      cut: int = 0) -> bytes:
    """The response body. orjson writes the numpy arrays directly (float32 values in their
    shortest round-trip form), ~10x faster than `tolist()` + `json.dumps` for float vectors."""
    data = []
    b64 = body.encoding_format == "base64"
    for i, out in enumerate(req.outputs):
        item: dict = {"object": "embedding", "index": i}
        if out.dense is not None:
            v = np.ascontiguousarray(out.dense, dtype="<f4")
            item["embedding"] = base64.b64encode(v.tobytes()).decode("ascii") if b64 else v
        if out.sparse is not None:
            ids, w = out.sparse
            item["sparse_embedding"] = {"indices": np.ascontiguousarray(ids, dtype=np.int64),
                                        "values": np.ascontiguousarray(w, dtype=np.float32)}
        if out.colbert is not None:
            item["colbert_embedding"] = np.ascontiguousarray(out.colbert, dtype=np.float32)
        data.append(item)
    usage = {"prompt_tokens": req.num_tokens, "total_tokens": req.num_tokens}
    if truncated:
        usage["truncated_inputs"], usage["truncated_tokens"] = truncated, cut
    return orjson.dumps({"object": "list", "data": data, "model": name, "usage": usage},
                        option=orjson.OPT_SERIALIZE_NUMPY)
