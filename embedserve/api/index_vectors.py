"""An index's vectors through the served engines' batchers: documents and queries of an index
version, embedded by the model that built it (and, for a pair, its sparse side by the paired
SPLADE model's engine), with the conversions of `embedserve.embedders.ModelEmbedder`."""

from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from index.embedder import DocumentVectors, document_types, query_types

from ..embedders import ModelEmbedder
from .common import through_batcher
from .state import AppState


def index_embedder(engine, sparse=None, manifest=None) -> ModelEmbedder:
    """A served model's conversions (texts -> index vectors), over its engine (and the engine of
    the paired sparse model), with the prompts the index version `manifest` records."""
    return ModelEmbedder(engine, max_input_length=engine.max_input_length, sparse_model=sparse,
                         sparse_max_input_length=sparse.max_input_length if sparse is not None else None,
                         prompts=manifest.prompt_texts() if manifest is not None else None)


async def embed_documents(state: AppState, request: Request, texts: list[str], engine,
                          sparse=None, manifest=None) -> DocumentVectors | None:
    """Document vectors through the engines' batchers (in several engine requests when the
    documents hold more tokens than a queue may take); None if the client went away."""
    emb = index_embedder(engine, sparse, manifest)
    ids, cut = await run_in_threadpool(emb.passage_inputs, texts)
    outputs = await through_batcher(state, request, engine, ids, document_types(emb.identity))
    if outputs is None:
        return None
    sparse_outputs = None
    if sparse is not None:
        sparse_ids = await run_in_threadpool(emb.sparse_inputs, texts)
        sparse_outputs = await through_batcher(state, request, sparse, sparse_ids, {"sparse"})
        if sparse_outputs is None:
            return None
    return await run_in_threadpool(emb.document_vectors, outputs, texts, cut, sparse_outputs)


async def embed_query(state: AppState, request: Request, text: str, mode: str, engine, sparse=None,
                      manifest=None, prompt_name: str = "query"):
    """(dense, sparse) of a query through the engines (its prompt: the index's `prompt_name`);
    None if the client went away."""
    emb = index_embedder(engine, sparse, manifest)
    want = query_types(emb.identity, mode)
    out = sparse_out = None
    if want:
        ids = await run_in_threadpool(emb.query_inputs, text, prompt_name)
        outs = await through_batcher(state, request, engine, [ids], want)
        if outs is None:
            return None
        out = outs[0]
    if sparse is not None and mode != "dense":
        outs = await through_batcher(state, request, sparse, await run_in_threadpool(emb.sparse_inputs, [text]),
                                     {"sparse"})
        if outs is None:
            return None
        sparse_out = outs[0]
    return await run_in_threadpool(emb.query_vectors, out, text, mode, sparse_out)
