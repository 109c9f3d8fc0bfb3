"""Index routes: create / list / inspect / delete indexes, upsert and delete documents, search.

An index is created bound to a served model (`model`, default the first `--model`); its
documents and queries are embedded by the served model whose identity its live version's
manifest names (through that model's engine), looked up on every request, so a reindex swap
switches model and version together; an index no served model built is refused with 409. The upsert and search logic is the index library's own
(`index.ops`), shared with the CLI; SQLite and FAISS work runs in the thread pool.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio
from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt
from starlette.concurrency import run_in_threadpool

from index import ops
from index.core import validate_documents
from index.docstore import Document
from index.embedder import DocumentVectors
from index.manifest import DenseConfig
from index.search import DEFAULT_WEIGHTS, MAX_TOP_K, Query
from index.store import NAME_PATTERN, check_name

from ..errors import UnsupportedError, ValidationError
from index.errors import ConflictError
from .openapi import route_doc
from .common import parse_body
from .index_vectors import embed_documents, embed_query
from .rerank import score_documents
from .state import AppState

logger = logging.getLogger(__name__)

DEFAULT_CANDIDATES = 30       # hits a search retrieves for reranking unless told
_BOUND = " and its indexes are bound to it"      # said when a request names a model not served

# what `check_name` accepts, for the document (the route checks it, with its own message)
_NAME = {"type": "string", "pattern": NAME_PATTERN,
         "description": "1-64 letters, digits, '_', '.' or '-', not starting with '.'"}
_NAME_IN_PATH = Path(json_schema_extra=_NAME)


class CreateIndexRequest(BaseModel):
    """POST /v1/indexes."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Any = Field(..., json_schema_extra=_NAME)
    model: str | None = None
    sparse_model: str | None = Field(default=None, description="a served sparse model (SPLADE) whose vectors are "
                                     "the index's sparse side, paired with `model`'s dense ones")
    dense: Literal["flat", "hnsw"] = "flat"
    hnsw_m: StrictInt = 32
    ef_construction: StrictInt = 200
    ef_search: StrictInt = 128


class DocumentIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    id: str = Field(..., min_length=1, max_length=512)
    text: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class UpsertRequest(BaseModel):
    """POST /v1/indexes/{name}/documents."""

    model_config = ConfigDict(extra="forbid", strict=True)

    documents: list[DocumentIn] = Field(..., min_length=1)


class DeleteDocumentsRequest(BaseModel):
    """DELETE /v1/indexes/{name}/documents."""

    model_config = ConfigDict(extra="forbid", strict=True)

    ids: list[str] = Field(..., min_length=1)


class Weights(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    dense: StrictFloat | StrictInt = 0.4
    sparse: StrictFloat | StrictInt = 0.2


class SearchRerank(BaseModel):
    """Rerank the retrieved candidates: retrieve `candidates` hits, score each against the query
    with `model` (a cross-encoder, or a BGE-M3 embedder), return the best `top_k`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(default=None, description="the reranking model (default: the first served reranker)")
    candidates: StrictInt | None = Field(default=None, description="hits retrieved for reranking (default: "
                                         f"max(top_k, {DEFAULT_CANDIDATES}))")
    raw_scores: StrictBool = False


class SearchRequest(BaseModel):
    """POST /v1/search."""

    model_config = ConfigDict(extra="forbid", strict=True)

    index: Any = Field(..., json_schema_extra=_NAME)
    query: str = Field(..., min_length=1)
    model: str | None = None
    top_k: StrictInt = 10
    mode: Literal["dense", "sparse", "hybrid"] = "dense"
    fusion: Literal["weighted", "rrf"] | None = None
    weights: Weights | None = None
    filter: dict[str, Any] | None = None
    rerank: SearchRerank | None = None
    prompt_name: str | None = Field(default=None, max_length=256, description="one of the index's named prompts for "
                                    "the query (default: its query prompt)")


class Counts(BaseModel):
    documents: int
    dense: int = Field(description="vectors in the dense (FAISS) index")
    sparse: int = Field(description="documents in the sparse postings")


class IndexObject(BaseModel):
    """An index: its live version's manifest (the identity of the model that built it, which
    every write and search must match) and its live counts."""

    object: Literal["index"]
    name: str
    version: str
    model: str
    fingerprint: str
    dimension: int
    normalize: bool
    metric: str
    pooling: str
    sparse: str = Field(description='"lexical_weights" (the model\'s sparse head) or "bm25"')
    dense_index: dict[str, Any]
    counts: Counts = Field(description="live: every acknowledged write included")
    snapshot_counts: Counts = Field(description="what the last snapshot on disk holds")
    sequence: int = Field(description="the last write applied")
    compatible: bool | None = Field(default=None, description="whether a served model can use this index")
    mismatch: str | None = Field(default=None, description="why not, when it cannot")


class IndexSummary(BaseModel):
    object: Literal["index"]
    name: str
    version: str
    model: str
    dimension: int
    dense_index: str = Field(description='"flat" or "hnsw"')
    sparse: str
    counts: Counts = Field(description="live")
    compatible: bool


class IndexList(BaseModel):
    """200 of GET /v1/indexes."""

    object: Literal["list"]
    data: list[IndexSummary]


class IndexReload(BaseModel):
    """200 of POST /v1/indexes/{name}/reload: the live version and the served model that answers for it."""

    object: Literal["index.reload"]
    name: str
    version: str
    model: str | None
    mismatch: str | None


class IndexDeleted(BaseModel):
    object: Literal["index.deleted"]
    name: str
    deleted: bool


class UpsertResponse(BaseModel):
    """200 of an upsert: what happened to each document, by outcome."""

    object: Literal["index.upsert"]
    index: str
    version: str
    added: int
    replaced: int = Field(description="text changed: re-embedded")
    metadata: int = Field(description="only the metadata changed: not re-embedded")
    unchanged: int
    truncated: list[str] = Field(description="ids of documents cut to the model's input length")
    sequence: int


class DeleteDocumentsResponse(BaseModel):
    object: Literal["index.delete"]
    index: str
    version: str
    deleted: int
    missing: list[str]
    sequence: int


class SearchHit(BaseModel):
    id: str
    score: float
    text: str
    metadata: dict[str, Any]
    scores: dict[str, float] = Field(description="per side (dense, sparse) where computed; with `rerank`, also "
                                     "`retrieval` (the score it was retrieved with) and `rerank` (= `score`)")


class SearchResponse(BaseModel):
    """200 of POST /v1/search: the hits and the (version, model) pair that answered."""

    object: Literal["list"]
    index: str
    version: str
    model: str
    mode: Literal["dense", "sparse", "hybrid"]
    data: list[SearchHit]
    sparse_model: str | None = Field(default=None, description="a pair index's sparse model (SPLADE)")
    rerank_model: str | None = Field(default=None, description="the model that reranked the hits (with `rerank`)")


def _why_not(state: AppState, manifest) -> str | None:
    """Why no served model can use this index version, or None."""
    if not state.ready:
        return "no model loaded"
    try:
        state.engine_for_index(manifest)
    except ConflictError as exc:
        return exc.message
    return None


@asynccontextmanager
async def _leased(indexes, name: str):
    """The live version of `name`, leased for the rest of the request (a version a swap
    replaces meanwhile closes only once the requests that took it are done)."""
    ix = await run_in_threadpool(indexes.acquire, name, None)
    try:
        yield ix
    finally:
        with anyio.CancelScope(shield=True):        # released even if the request is cancelled
            await run_in_threadpool(indexes.release, ix)


def build_router(state: AppState) -> APIRouter:
    """The index routes, bound to the app's state (engine, config, open indexes)."""
    indexes = state.indexes

    router = APIRouter()

    @router.post("/v1/indexes", status_code=201, **route_doc(CreateIndexRequest, 404, 409, 507, ok=IndexObject, status=201))
    async def create_index(request: Request):
        body = await parse_body(request, CreateIndexRequest)
        name = check_name(body.name)
        engine = state.require_embedder(body.model, _BOUND)
        if not engine.spec.has_dense:
            raise UnsupportedError(f"model {state.name_of(engine)!r} gives sparse vectors only (SPLADE); an index "
                                   "needs a model with a dense output", param="model")
        ident = state.identity(engine)
        if body.sparse_model is not None:
            sparse = state.require_embedder(body.sparse_model, _BOUND)
            if "sparse" not in sparse.embedding_types or sparse is engine:
                raise UnsupportedError(f"sparse_model {body.sparse_model!r} gives no sparse vectors of its own: pair "
                                       "a SPLADE model (e.g. splade-tiny) with the dense model", param="sparse_model")
            ident = ident.with_sparse_model(sparse.spec)
        dense = DenseConfig(kind=body.dense, hnsw_m=body.hnsw_m, ef_construction=body.ef_construction,
                            ef_search=body.ef_search)
        info = await run_in_threadpool(indexes.create, name, ident, dense)
        return JSONResponse(_index_object(info), status_code=201)

    @router.get("/v1/indexes", **route_doc(ok=IndexList))
    async def list_indexes():
        rows = await run_in_threadpool(indexes.summaries, lambda m: _why_not(state, m))
        return {"object": "list", "data": [{"object": "index", **row} for row in rows]}

    @router.get("/v1/indexes/{name}", **route_doc(None, 400, 404, ok=IndexObject))
    async def get_index(name: str = _NAME_IN_PATH):
        check_name(name)
        async with _leased(indexes, name) as ix:
            info = _index_object(await run_in_threadpool(ix.describe))
            why = _why_not(state, ix.manifest)
        info["compatible"], info["mismatch"] = why is None, why
        return info

    @router.post("/v1/indexes/{name}/reload", **route_doc(None, 400, 404, 409, ok=IndexReload))
    async def reload_index(name: str = _NAME_IN_PATH):
        """Pick up a moved `CURRENT` now (every request also checks it): the live version and the
        served model that will answer for it."""
        async with _leased(indexes, check_name(name)) as ix:
            why = _why_not(state, ix.manifest)
            model = state.name_of(state.engine_for_index(ix.manifest)) if why is None else None
            return {"object": "index.reload", "name": name, "version": ix.version, "model": model, "mismatch": why}

    @router.delete("/v1/indexes/{name}", **route_doc(None, 400, 404, ok=IndexDeleted))
    async def delete_index(name: str = _NAME_IN_PATH):
        await run_in_threadpool(indexes.delete, check_name(name))
        return {"object": "index.deleted", "name": name, "deleted": True}

    _add_document_routes(router, state)
    return router


def _add_document_routes(router: APIRouter, state: AppState) -> None:
    """Upsert and delete documents, and search: the routes that embed through the engine."""
    indexes = state.indexes

    @router.post("/v1/indexes/{name}/documents", **route_doc(UpsertRequest, 404, 409, 507, ok=UpsertResponse))
    async def upsert_documents(request: Request, name: str = _NAME_IN_PATH):
        check_name(name)
        body = await parse_body(request, UpsertRequest)
        state.require_embedder()
        docs = [Document(d.id, d.text, d.metadata) for d in body.documents]
        validate_documents(docs)
        if len(docs) > state.config.http.max_client_batch_size:
            raise ValidationError(f"{len(docs)} documents; the limit (--max-client-batch-size) is "
                                  f"{state.config.http.max_client_batch_size}; split the upsert", param="documents")
        async with _leased(indexes, name) as ix:
            engine, sparse = state.engines_for_index(ix.manifest)
            ident = state.index_identity(engine, sparse, ix.manifest)
            todo = await run_in_threadpool(ops.plan_upsert, ix, docs)
            vectors = DocumentVectors([], [])
            if todo:
                vectors = await embed_documents(state, request, [docs[i].text for i in todo], engine, sparse,
                                                ix.manifest)
                if vectors is None:
                    return Response(status_code=499)
            result = await run_in_threadpool(ops.commit_upsert, ix, docs, todo, vectors, ident)
        return {"object": "index.upsert", **result.to_dict()}

    @router.delete("/v1/indexes/{name}/documents", **route_doc(DeleteDocumentsRequest, 404, 409, 507, ok=DeleteDocumentsResponse))
    async def delete_documents(request: Request, name: str = _NAME_IN_PATH):
        check_name(name)
        body = await parse_body(request, DeleteDocumentsRequest)
        async with _leased(indexes, name) as ix:
            ident = state.index_identity(*state.engines_for_index(ix.manifest), ix.manifest) if state.ready else None
            change = await run_in_threadpool(ix.delete, body.ids, ident)
        missing = [k for k, v in change.outcomes.items() if v == "missing"]
        return {"object": "index.delete", "index": name, "version": ix.version,
                "deleted": len(change.outcomes) - len(missing), "missing": missing, "sequence": change.seq}

    @router.post("/v1/search", **route_doc(SearchRequest, 404, 409, ok=SearchResponse))
    async def search(request: Request):
        body = await parse_body(request, SearchRequest)
        name = check_name(body.index)
        requested = state.require_embedder(body.model, _BOUND)
        if not body.query.strip():
            raise ValidationError("`query` is blank; send the text to search for", param="query")
        reranker, top_k = None, body.top_k
        if body.rerank is not None:
            reranker = state.require_reranker(body.rerank.model)
            top_k = body.rerank.candidates if body.rerank.candidates is not None else max(body.top_k, DEFAULT_CANDIDATES)
            if not 1 <= body.top_k <= MAX_TOP_K:
                raise ValidationError(f"top_k must be an integer in [1, {MAX_TOP_K}], not {body.top_k}", param="top_k")
            if not body.top_k <= top_k <= MAX_TOP_K:
                raise ValidationError(f"rerank.candidates is {top_k}: give a number from top_k ({body.top_k}) to "
                                      f"{MAX_TOP_K}", param="rerank.candidates")
        # the index version and the model that built it, taken together: a swap of `CURRENT`
        # during this request changes neither (this request finishes on the pair it took, leased)
        async with _leased(indexes, name) as ix:
            engine, sparse = state.engines_for_index(ix.manifest)
            if body.model is not None and requested is not engine:
                ix.manifest.check(state.identity(requested), "search")
            ident = state.index_identity(engine, sparse, ix.manifest)
            prompt = _search_prompt(ix.manifest, body.prompt_name)
            vectors = await embed_query(state, request, body.query, body.mode, engine, sparse, ix.manifest, prompt)
            if vectors is None:
                return Response(status_code=499)
            weights = (body.weights.dense, body.weights.sparse) if body.weights else DEFAULT_WEIGHTS
            # a pair's scores live on two scales (cosine, SPLADE dot products): fuse ranks by default
            fusion = body.fusion or ("rrf" if sparse is not None else None)
            query = Query(dense=vectors[0], sparse=vectors[1], top_k=top_k, mode=body.mode, fusion=fusion,
                          weights=weights, filter=body.filter)
            hits = [h.to_dict() for h in await run_in_threadpool(ix.search, query, ident)]
        out = {"object": "list", "index": name, "version": ix.version, "model": state.name_of(engine),
               "mode": body.mode, "data": hits}
        if sparse is not None:
            out["sparse_model"] = state.name_of(sparse)
        if reranker is not None:          # outside the lease: the hits hold their text
            scored = await score_documents(state, request, reranker, body.query, [h["text"] for h in hits],
                                           raw=body.rerank.raw_scores, param="rerank")
            if scored is None:
                return Response(status_code=499)
            for h, s in zip(hits, scored.scores):
                h["scores"] = {**h["scores"], "retrieval": h["score"], "rerank": s}
                h["score"] = s
            out["data"] = sorted(hits, key=lambda h: -h["score"])[:body.top_k]
            out["rerank_model"] = scored.model
        return out


def _search_prompt(manifest, name: str | None) -> str:
    """The prompt a search's query gets: the index's `query` prompt, or the named one it records
    (409 naming both when the index was not built with that prompt)."""
    if name is None:
        return "query"
    have = manifest.prompt_texts()
    if name not in have:
        raise ConflictError(f"index {manifest.index!r} (version {manifest.version}) was built with the prompts "
                            f"{', '.join(repr(n) for n in sorted(have))}; the request names {name!r}; use one of "
                            "those, or reindex with it (embedserve reindex --prompt NAME=TEXT)", param="prompt_name",
                            code="prompt_mismatch")
    return name


def _index_object(info: dict) -> dict:
    return {"object": "index", "name": info["index"], **info}
