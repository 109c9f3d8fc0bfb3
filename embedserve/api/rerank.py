"""Reranking in the shapes clients send, on the same token-budget batcher as embeddings.

    POST /v1/rerank, /rerank   Jina / Cohere v1: model, query, documents, top_n, return_documents
    POST /rerank with `texts`  text-embeddings-inference: query, texts, raw_scores, return_text, truncate
    POST /v2/rerank            Cohere v2: model, query, documents (strings), top_n, max_tokens_per_doc
    POST /v1/score, /score     vLLM: text_1 (one string or a list), text_2 (a list)

Each (query, document) pair is one item of the reranker's batcher; one request's pairs may
spread over batches and come back in order. A cross-encoder's `relevance_score` is the sigmoid
of its logit (the logit with `raw_scores`); a BGE-M3 embedder reranks with its own vectors
(`scoring`: colbert, dense, sparse, or FlagEmbedding's weighted sums, `weights` = [dense,
sparse, colbert]). Documents are cut to fit (counted in `usage`), never the query: a query that
leaves no room is a 400.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ..errors import UnsupportedError, ValidationError
from ..models.cross_encoder import DocumentTooLong, QueryTooLong
from ..models.scoring import M3_DEFAULT_WEIGHTS, m3_score
from .common import check_unicode, parse_body, read_json, through_batcher, validate_body
from .openapi import route_doc
from .rerank_schemas import (M3_DEFAULT_METHOD, AnyRerankRequest, AnyRerankResponse, RerankRequest, RerankRequestV2,
                             RerankResponse, ScoreRequest, ScoreResponse, TEIRerankRequest)
from .state import AppState, rerank_methods


@dataclass(slots=True)
class Scored:
    """Every document's score against its query, in request order, and what it cost."""

    model: str
    scores: list[float]
    tokens: int = 0
    truncated: list[int] = field(default_factory=list)
    cut_tokens: int = 0

    def usage(self) -> dict:
        u: dict = {"prompt_tokens": self.tokens, "total_tokens": self.tokens}
        if self.truncated:
            u["truncated_documents"], u["truncated_tokens"] = self.truncated, self.cut_tokens
        return u


def check_query(query: str, param: str = "query") -> str:
    if not query.strip():
        raise ValidationError(f"`{param}` is blank; send the text to rank the documents against", param=param)
    return check_unicode(query, f"`{param}`", param)


def document_texts(raw: Any, rank_fields: list[str] | None, limit: int, param: str = "documents") -> list[str]:
    """The texts to rank: strings, or objects' `text` (or their `rank_fields`, joined in order)."""
    if not isinstance(raw, list) or not raw:
        raise ValidationError(f"`{param}` must be a non-empty list of strings or of objects with `text`", param=param)
    if len(raw) > limit:
        raise ValidationError(f"`{param}` has {len(raw)} items; the limit (--max-client-batch-size) is {limit}; "
                              "split the request", param=param, code="too_many_inputs")
    texts = []
    for i, d in enumerate(raw):
        if isinstance(d, str):
            texts.append(check_unicode(d, f"document {i}", param))
            continue
        if not isinstance(d, dict):
            raise ValidationError(f"document {i} is a {type(d).__name__}; send a string or an object with `text`",
                                  param=param)
        fields = rank_fields or ["text"]
        missing = [f for f in fields if f not in d]
        if missing:
            raise ValidationError(f"document {i} has no {missing[0]!r} field" +
                                  ("" if rank_fields else "; give each object a `text`, or name its fields in "
                                   "`rank_fields`"), param=param)
        bad = next((f for f in fields if not isinstance(d[f], str)), None)
        if bad is not None:
            raise ValidationError(f"document {i}'s {bad!r} is a {type(d[bad]).__name__}, not a string", param=param)
        texts.append(check_unicode(d[fields[0]] if len(fields) == 1 else "\n".join(f"{f}: {d[f]}" for f in fields),
                           f"document {i}", param))
    return texts


def _positive(value: int | None, param: str) -> int | None:
    if value is not None and value < 1:
        raise ValidationError(f"`{param}` is {value}; give a whole number of at least 1, or omit it", param=param)
    return value


async def score_documents(state: AppState, request: Request | None, engine, query: str | list[str], texts: list[str],
                          *, raw: bool = False, truncate: bool = True, max_doc_tokens: int | None = None,
                          scoring: str | None = None, weights=None, param: str = "documents") -> Scored | None:
    """Every text's score against `query` (or against its own query: a list as long as `texts`)
    through `engine` (a cross-encoder, or a BGE-M3 embedder): a cross-encoder's pairs of every
    query go through its batcher together. None if the client went away (its queued pairs never
    reach the model)."""
    name = state.name_of(engine)
    groups: dict[str, list[int]] = {}
    for i in range(len(texts)):
        groups.setdefault(query if isinstance(query, str) else query[i], []).append(i)
    if engine.task != "rerank":
        return await _score_groups_m3(state, request, engine, name, groups, texts, scoring, weights, truncate, param)
    if scoring is not None or weights is not None:
        raise UnsupportedError(f"`scoring` and `weights` choose how a BGE-M3 model reranks; {name!r} is a "
                               "cross-encoder: omit them", param="scoring" if scoring is not None else "weights")
    model = engine.model
    problem = model.label_problem()
    if problem:
        raise UnsupportedError(problem, param="model")

    def build():
        return [(idx, model.pairs(q, [texts[i] for i in idx], engine.max_input_length, max_doc_tokens, truncate))
                for q, idx in groups.items()]
    try:
        built = await run_in_threadpool(build)
    except QueryTooLong as exc:
        raise ValidationError(str(exc), param="query", code="context_length_exceeded") from None
    except DocumentTooLong as exc:
        raise ValidationError(str(exc), param=param, code="context_length_exceeded") from None
    order = [i for idx, _ in built for i in idx]
    outputs = await through_batcher(state, request, engine, [x for _, p in built for x in p.inputs], {"score"},
                                    [x for _, p in built for x in p.segments])
    if outputs is None:
        return None
    scores = [0.0] * len(texts)
    for i, o in zip(order, outputs):
        scores[i] = model.relevance(o.score, raw)
    return Scored(name, scores, sum(p.num_tokens for _, p in built),
                  sorted(idx[k] for idx, p in built for k in p.truncated), sum(p.cut_tokens for _, p in built))


async def _score_groups_m3(state, request, engine, name, groups, texts, scoring, weights, truncate,
                           param) -> Scored | None:
    """`_score_m3` for each query's documents (BGE-M3 embeds each query with its own documents)."""
    total = Scored(name, [0.0] * len(texts))
    for q, idx in groups.items():
        part = await _score_m3(state, request, engine, name, q, [texts[i] for i in idx], scoring, weights,
                               truncate, param)
        if part is None:
            return None
        for k, i in enumerate(idx):
            total.scores[i] = part.scores[k]
        total.tokens += part.tokens
        total.truncated += [idx[k] for k in part.truncated]
        total.cut_tokens += part.cut_tokens
    total.truncated.sort()
    return total


async def _score_m3(state, request, engine, name, query, texts, scoring, weights, truncate, param) -> Scored | None:
    """BGE-M3 reranking from the model's own vectors (FlagEmbedding's compute_score)."""
    methods = rerank_methods(engine)
    method = scoring or (M3_DEFAULT_METHOD if M3_DEFAULT_METHOD in methods else methods[0])
    if method not in methods:
        raise UnsupportedError(f"model {name!r} cannot score {method!r}: it has the heads for "
                               f"{', '.join(methods)}", param="scoring")
    w = tuple(float(x) for x in weights) if weights is not None else M3_DEFAULT_WEIGHTS
    if any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
        raise ValidationError("`weights` are [dense, sparse, colbert]: finite, not negative, not all zero",
                              param="weights")
    parts = method.split("+")
    limit = engine.max_input_length
    ids = await run_in_threadpool(engine.tokenize, [query, *texts])
    if len(ids[0]) > limit:
        raise ValidationError(f"the query has {len(ids[0]):,} tokens; the limit is {limit:,}; shorten the query",
                              param="query", code="context_length_exceeded")
    truncated = [i - 1 for i in range(1, len(ids)) if len(ids[i]) > limit]
    if truncated and not truncate:
        raise ValidationError(f"document {truncated[0]} has {len(ids[truncated[0] + 1]):,} tokens, over the limit "
                              f"of {limit:,}; shorten it or set truncate=true", param=param,
                              code="context_length_exceeded")
    cut = sum(len(ids[i + 1]) - limit for i in truncated)
    for i in truncated:
        ids[i + 1] = engine.truncate(ids[i + 1], limit)
    outputs = await through_batcher(state, request, engine, ids, set(parts))
    if outputs is None:
        return None
    scores = [m3_score(outputs[0], d, method, w) for d in outputs[1:]]
    return Scored(name, scores, sum(map(len, ids)), truncated, cut)


def _ranked(scores: list[float], top_n: int | None) -> list[int]:
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return order[:top_n] if top_n else order


def _rerank_body(scored: Scored, order: list[int], documents, return_documents: bool, version: str) -> dict:
    results = []
    for i in order:
        item: dict = {"index": i, "relevance_score": scored.scores[i]}
        if return_documents:
            d = documents[i]
            item["document"] = {"text": d} if isinstance(d, str) else d
        results.append(item)
    return {"id": str(uuid.uuid4()), "model": scored.model, "results": results, "usage": scored.usage(),
            "meta": {"api_version": {"version": version},
                     "billed_units": {"search_units": max(1, math.ceil(len(scored.scores) / 100)),
                                      "input_tokens": scored.tokens}}}


def build_router(state: AppState) -> APIRouter:
    """The rerank and score routes, bound to the app's state."""
    router = APIRouter()
    max_docs = state.config.http.max_client_batch_size

    async def ranked(request: Request, body, rank_fields: list[str] | None, version: str):
        """The Cohere / Jina answer: every document scored, best first, `top_n` kept."""
        engine = state.require_reranker(body.model)
        query = check_query(body.query)
        texts = document_texts(body.documents, rank_fields, max_docs)
        top_n = _positive(body.top_n, "top_n")
        scored = await score_documents(state, request, engine, query, texts, raw=body.raw_scores,
                                       max_doc_tokens=_positive(body.max_tokens_per_doc, "max_tokens_per_doc"),
                                       scoring=body.scoring, weights=body.weights)
        if scored is None:
            return Response(status_code=499)
        return _rerank_body(scored, _ranked(scored.scores, top_n), body.documents, body.return_documents, version)

    async def rerank_v1(request: Request, body: RerankRequest):
        if body.max_chunks_per_doc is not None:
            raise UnsupportedError("`max_chunks_per_doc` is not supported: documents are cut to fit the model "
                                   "(set `max_tokens_per_doc` to cut them shorter); omit it",
                                   param="max_chunks_per_doc")
        return await ranked(request, body, body.rank_fields, "1")

    @router.post("/v1/rerank", **route_doc(RerankRequest, 404, ok=RerankResponse))
    async def rerank(request: Request):
        """Jina's and Cohere v1's rerank."""
        return await rerank_v1(request, await parse_body(request, RerankRequest))

    @router.post("/rerank", **route_doc(AnyRerankRequest, 404, ok=AnyRerankResponse))
    async def rerank_any(request: Request):
        """Jina's / Cohere v1's shape; with `texts`, text-embeddings-inference's (TEIRerankRequest ->
        TEIRerankResponse, a list)."""
        obj = await read_json(request)
        if "texts" in obj:
            return await rerank_tei(request, validate_body(obj, TEIRerankRequest))
        return await rerank_v1(request, validate_body(obj, RerankRequest))

    async def rerank_tei(request: Request, body: TEIRerankRequest):
        engine = state.require_reranker(body.model)
        query = check_query(body.query)
        if len(body.texts) > max_docs:
            raise ValidationError(f"`texts` has {len(body.texts)} items; the limit (--max-client-batch-size) is "
                                  f"{max_docs}; split the request", param="texts", code="too_many_inputs")
        texts = [check_unicode(t, f"text {i}", "texts") for i, t in enumerate(body.texts)]
        scored = await score_documents(state, request, engine, query, texts, raw=body.raw_scores,
                                       truncate=body.truncate, param="texts")
        if scored is None:
            return Response(status_code=499)
        out = []
        for i in _ranked(scored.scores, None):
            item: dict = {"index": i, "score": scored.scores[i]}
            if body.return_text:
                item["text"] = texts[i]
            out.append(item)
        return JSONResponse(out)

    @router.post("/v2/rerank", **route_doc(RerankRequestV2, 404, ok=RerankResponse))
    async def rerank_v2(request: Request):
        """Cohere v2's rerank."""
        body = await parse_body(request, RerankRequestV2)
        if body.relevant_spans is not None:
            raise UnsupportedError("`relevant_spans` is not supported; omit it", param="relevant_spans")
        return await ranked(request, body, None, "2")

    async def score(request: Request):
        body = await parse_body(request, ScoreRequest)
        engine = state.require_reranker(body.model)
        firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if not firsts or not seconds:
            raise ValidationError("`text_1` and `text_2` need at least one text each", param="text_1" if not firsts
                                  else "text_2")
        if len(firsts) != 1 and len(firsts) != len(seconds):
            raise ValidationError(f"`text_1` has {len(firsts)} texts and `text_2` {len(seconds)}: send one `text_1` "
                                  "to score against every `text_2`, or two lists of the same length (pairwise)",
                                  param="text_1")
        seconds = document_texts(seconds, None, max_docs, "text_2")
        firsts = [check_query(t, "text_1") for t in firsts]
        scored = await score_documents(state, request, engine, firsts[0] if len(firsts) == 1 else firsts, seconds,
                                       raw=body.raw_scores, param="text_2",
                                       max_doc_tokens=_positive(body.truncate_prompt_tokens, "truncate_prompt_tokens"))
        if scored is None:
            return Response(status_code=499)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": scored.model, "usage": scored.usage(),
                "data": [{"index": i, "object": "score", "score": x} for i, x in enumerate(scored.scores)]}

    doc = route_doc(ScoreRequest, 404, ok=ScoreResponse)
    router.post("/v1/score", **doc)(score)
    router.post("/score", **doc)(score)
    return router
