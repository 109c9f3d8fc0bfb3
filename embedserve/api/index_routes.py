"""Index routes: create / list / inspect / delete indexes, upsert and delete documents, search.

The served model is the only model here: indexes are created bound to it, documents and
queries are embedded by it (through the engine's batcher), and an index whose manifest does
not match it is refused with 409. SQLite and FAISS work runs in the thread pool.
"""

from __future__ import annotations

import logging
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt
from starlette.concurrency import run_in_threadpool

from index.core import Index, validate_documents
from index.docstore import Document
from index.encode import doc_vectors, lexical_terms, passage_inputs, query_inputs, wanted
from index.manifest import DenseConfig, ModelIdentity
from index.search import Query
from index.store import IndexStore, check_name

from ..config import embedserve_home
from ..errors import ConflictError, NotFoundError, UnavailableError, ValidationError
from .app import AppState, _parse_body, embed_via_engine

logger = logging.getLogger(__name__)


class CreateIndexRequest(BaseModel):
    """POST /v1/indexes."""

    model_config = ConfigDict(extra="forbid")

    name: Any
    model: str | None = None
    dense: Literal["flat", "hnsw"] = "flat"
    hnsw_m: StrictInt = 32
    ef_construction: StrictInt = 200
    ef_search: StrictInt = 128


class DocumentIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(..., min_length=1, max_length=512)
    text: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class UpsertRequest(BaseModel):
    """POST /v1/indexes/{name}/documents."""

    model_config = ConfigDict(extra="forbid")

    documents: list[DocumentIn] = Field(..., min_length=1)


class DeleteDocumentsRequest(BaseModel):
    """DELETE /v1/indexes/{name}/documents."""

    model_config = ConfigDict(extra="forbid")

    ids: list[str] = Field(..., min_length=1)


class Weights(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dense: StrictFloat | StrictInt = 0.4
    sparse: StrictFloat | StrictInt = 0.2


class SearchRequest(BaseModel):
    """POST /v1/search."""

    model_config = ConfigDict(extra="forbid")

    index: Any
    query: str = Field(..., min_length=1)
    model: str | None = None
    top_k: StrictInt = 10
    mode: Literal["dense", "sparse", "hybrid"] = "dense"
    fusion: Literal["weighted", "rrf"] | None = None
    weights: Weights | None = None
    filter: dict[str, Any] | None = None


class OpenIndexes:
    """The store and the indexes this server has open, one per name, following `CURRENT`."""

    def __init__(self, root: Path):
        self.root = root
        self._store: IndexStore | None = None
        self._open: dict[str, Index] = {}
        self._lock = threading.Lock()

    @property
    def store(self) -> IndexStore:
        if self._store is None:
            self._store = IndexStore(self.root)
        return self._store

    def get(self, name: str, identity: ModelIdentity | None) -> Index:
        """The live version of `name`, (re)opened when `CURRENT` moved; refused on mismatch."""
        version = self.store.current(name)
        with self._lock:
            ix = self._open.get(name)
            if ix is not None and ix.version != version:
                logger.info("index %s: current moved %s -> %s; reopening", name, ix.version, version)
                self._open.pop(name).close()
                ix = None
            if ix is None:
                ix = self.store.open(name, version=version)
                self._open[name] = ix
        if identity is not None:
            ix.manifest.check(identity, "open")
        return ix

    def drop(self, name: str) -> None:
        """Forget `name` (it is being deleted: no snapshot)."""
        with self._lock:
            ix = self._open.pop(name, None)
        if ix is not None:
            ix.close(snapshot=False)

    def close_all(self) -> None:
        with self._lock:
            items, self._open = list(self._open.values()), {}
        for ix in items:
            ix.close()


def build_router(state: AppState) -> APIRouter:
    """The index routes, bound to the app's state (model, engine, config)."""
    root = Path(state.config.index_dir).expanduser() if state.config.index_dir else embedserve_home() / "indexes"
    indexes = OpenIndexes(root)

    @asynccontextmanager
    async def lifespan(app):
        yield
        # Snapshot on the way out, so the next start replays little (nothing is lost without it).
        await run_in_threadpool(indexes.close_all)

    router = APIRouter(lifespan=lifespan)

    def identity() -> ModelIdentity:
        if not state.ready or state.model is None:
            raise UnavailableError("model is loading; retry shortly", retry_after=5)
        return ModelIdentity.from_spec(state.model.spec)

    def check_model(requested: str | None) -> None:
        if requested is not None and requested not in (state.served_name, state.model.spec.name):
            raise NotFoundError(f"model {requested!r} is not served here; this server serves {state.served_name!r} "
                                "and its indexes are bound to it", param="model")

    @router.post("/v1/indexes", status_code=201)
    async def create_index(request: Request):
        body = await _parse_body(request, CreateIndexRequest)
        name = check_name(body.name)
        ident = identity()
        check_model(body.model)
        dense = DenseConfig(kind=body.dense, hnsw_m=body.hnsw_m, ef_construction=body.ef_construction,
                            ef_search=body.ef_search)

        def create():
            ix = indexes.store.create(name, ident, dense)
            ix.close()
            return indexes.get(name, ident).describe()
        return JSONResponse(_index_object(await run_in_threadpool(create)), status_code=201)

    @router.get("/v1/indexes")
    async def list_indexes():
        def summaries():
            out = []
            for name in indexes.store.names():
                m = indexes.store.manifest(name)
                out.append({"object": "index", "name": name, "version": m.version, "model": m.model,
                            "dimension": m.dimension, "dense_index": m.dense_index["kind"], "sparse": m.sparse,
                            "counts": m.counts, "compatible": _mismatch(m, state) is None})
            return out
        return {"object": "list", "data": await run_in_threadpool(summaries)}

    @router.get("/v1/indexes/{name}")
    async def get_index(name: str):
        check_name(name)
        ix = await run_in_threadpool(indexes.get, name, None)
        info = _index_object(await run_in_threadpool(ix.describe))
        info["compatible"] = _mismatch(ix.manifest, state) is None
        info["mismatch"] = _mismatch(ix.manifest, state)
        return info

    @router.delete("/v1/indexes/{name}")
    async def delete_index(name: str):
        check_name(name)

        def delete():
            indexes.drop(name)
            indexes.store.delete(name)
        await run_in_threadpool(delete)
        return {"object": "index.deleted", "name": name, "deleted": True}

    @router.post("/v1/indexes/{name}/documents")
    async def upsert_documents(name: str, request: Request):
        check_name(name)
        body = await _parse_body(request, UpsertRequest)
        ident = identity()
        model = state.model
        docs = [Document(d.id, d.text, d.metadata) for d in body.documents]
        validate_documents(docs)
        if len(docs) > state.config.max_client_batch_size:
            raise ValidationError(f"{len(docs)} documents; the limit (--max-client-batch-size) is "
                                  f"{state.config.max_client_batch_size}; split the upsert", param="documents")
        ix = await run_in_threadpool(indexes.get, name, ident)
        need = await run_in_threadpool(ix.pending, docs)
        todo = [i for i, n in enumerate(need) if n]
        dense: list = [None] * len(docs)
        sparse: list = [None] * len(docs)
        truncated: list[str] = []
        if todo:
            texts = [docs[i].text for i in todo]
            inputs, cut = await run_in_threadpool(passage_inputs, model, texts, state.max_input_length)
            truncated = [docs[todo[i]].id for i in cut]
            outputs = []
            # Several engine requests when the documents hold more tokens than the queue may.
            budget = max(state.config.max_batch_tokens, state.config.max_queued_tokens // 4)
            for chunk in _chunk_by_tokens(inputs, budget):
                req = await embed_via_engine(state, chunk, wanted(ident), request)
                if req is None:
                    return Response(status_code=499)
                outputs.extend(req.outputs)
            d, s = await run_in_threadpool(doc_vectors, model, ident, outputs, texts)
            for j, i in enumerate(todo):
                dense[i], sparse[i] = d[j], s[j]
        change = await run_in_threadpool(ix.upsert, docs, dense, sparse, ident)
        tally = {k: 0 for k in ("added", "replaced", "metadata", "unchanged")}
        for outcome in change.outcomes.values():
            tally[outcome] += 1
        return {"object": "index.upsert", "index": name, "version": ix.version, **tally,
                "truncated": truncated, "sequence": change.seq}

    @router.delete("/v1/indexes/{name}/documents")
    async def delete_documents(name: str, request: Request):
        check_name(name)
        body = await _parse_body(request, DeleteDocumentsRequest)
        ident = identity() if state.ready else None
        ix = await run_in_threadpool(indexes.get, name, ident)
        change = await run_in_threadpool(ix.delete, body.ids, ident)
        missing = [k for k, v in change.outcomes.items() if v == "missing"]
        return {"object": "index.delete", "index": name, "version": ix.version,
                "deleted": len(change.outcomes) - len(missing), "missing": missing, "sequence": change.seq}

    @router.post("/v1/search")
    async def search(request: Request):
        body = await _parse_body(request, SearchRequest)
        name = check_name(body.index)
        ident = identity()
        check_model(body.model)
        if not body.query.strip():
            raise ValidationError("`query` is blank; send the text to search for", param="query")
        model = state.model
        ix = await run_in_threadpool(indexes.get, name, ident)
        want = set()
        if body.mode != "sparse":
            want.add("dense")
        if body.mode != "dense" and ident.has_sparse:
            want.add("sparse")
        q_dense = q_sparse = None
        if want:
            ids = await run_in_threadpool(query_inputs, model, body.query, state.max_input_length)
            req = await embed_via_engine(state, [ids], want, request)
            if req is None:
                return Response(status_code=499)
            out = req.outputs[0]
            q_dense = out.dense
            if out.sparse is not None:
                q_sparse = out.sparse
        if body.mode != "dense" and not ident.has_sparse:
            q_sparse = (await run_in_threadpool(lexical_terms, model, [body.query]))[0]
        weights = (body.weights.dense, body.weights.sparse) if body.weights else (0.4, 0.2)
        query = Query(dense=q_dense, sparse=q_sparse, top_k=body.top_k, mode=body.mode, fusion=body.fusion,
                      weights=weights, filter=body.filter)
        hits = await run_in_threadpool(ix.search, query, ident)
        return {"object": "list", "index": name, "version": ix.version, "model": state.served_name,
                "mode": body.mode,
                "data": [{"id": h.id, "score": h.score, "text": h.text, "metadata": h.metadata,
                          "scores": h.scores} for h in hits]}

    return router


def _index_object(info: dict) -> dict:
    return {"object": "index", "name": info["index"], **info}


def _mismatch(manifest, state: AppState) -> str | None:
    """Why the served model cannot use this index, or None."""
    if state.model is None:
        return "no model loaded"
    try:
        manifest.check(ModelIdentity.from_spec(state.model.spec), "serve")
    except ConflictError as exc:
        return exc.message
    return None


def _chunk_by_tokens(inputs: list[list[int]], budget: int):
    chunk, tokens = [], 0
    for ids in inputs:
        if chunk and tokens + len(ids) > budget:
            yield chunk
            chunk, tokens = [], 0
        chunk.append(ids)
        tokens += len(ids)
    if chunk:
        yield chunk
