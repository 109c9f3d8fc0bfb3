"""Texts -> the vectors an index stores, with the model's own conventions.

Documents are embedded as `passage` and queries as `query` (the model's prefixes); a document
over the model's input limit is truncated, never refused. The lexical side is the model's
sparse head where it has one, else the term counts of the text under the model's tokenizer
(no prefix, special tokens dropped) for BM25.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from .docstore import Sparse
from .manifest import ModelIdentity

logger = logging.getLogger(__name__)


def wanted(identity: ModelIdentity) -> set[str]:
    """Embedding types the model must produce for this index."""
    return {"dense", "sparse"} if identity.has_sparse else {"dense"}


def passage_inputs(model, texts: list[str], limit: int | None = None) -> tuple[list[list[int]], list[int]]:
    """Token ids for documents (passage prefix), truncated to `limit`; and which were cut."""
    ids = model.tokenize(texts, "passage")
    limit = limit or model.max_input_length
    cut = [i for i, x in enumerate(ids) if len(x) > limit]
    for i in cut:
        ids[i] = model.truncate(ids[i], limit)
    return ids, cut


def query_inputs(model, text: str, limit: int | None = None) -> list[int]:
    return model.truncate(model.tokenize([text], "query")[0], limit or model.max_input_length)


def lexical_terms(model, texts: list[str]) -> list[Sparse]:
    """BM25's side: (unique token ids, their counts) of each raw text, special tokens dropped."""
    special = np.array(sorted(model.special_ids), dtype=np.int64)
    out = []
    for ids in model.tokenize(texts, None):
        arr = np.asarray(ids, dtype=np.int64)
        arr = arr[~np.isin(arr, special)]
        uniq, counts = np.unique(arr, return_counts=True)
        out.append((uniq, counts.astype(np.float32)))
    return out


def doc_vectors(model, identity: ModelIdentity, outputs: list, texts: list[str]) -> tuple[list, list[Sparse]]:
    """(dense, sparse) per document from the model's outputs (`EmbedOutput`s)."""
    dense = [np.asarray(o.dense, dtype=np.float32) for o in outputs]
    if identity.has_sparse:
        sparse = [(np.asarray(o.sparse[0], np.int64), np.asarray(o.sparse[1], np.float32)) for o in outputs]
    else:
        sparse = lexical_terms(model, texts)
    return dense, sparse


def embed_documents(model, texts: list[str], batch_tokens: int = 4096,
                    on_batch: Callable[[int], None] | None = None) -> tuple[list, list[Sparse], list[int]]:
    """Embed documents in-process (CLI, tests), in batches of about `batch_tokens` tokens,
    sorted by length so a batch wastes little; returns dense, sparse and the truncated indices."""
    identity = ModelIdentity.from_spec(model.spec)
    ids, cut = passage_inputs(model, texts)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    outputs: list = [None] * len(ids)
    batch: list[int] = []
    tokens = 0

    def flush():
        outs, _ = model.embed([ids[i] for i in batch], wanted(identity))
        for i, o in zip(batch, outs):
            outputs[i] = o
        if on_batch:
            on_batch(len(batch))

    for i in order:
        if batch and tokens + len(ids[i]) > batch_tokens:
            flush()
            batch, tokens = [], 0
        batch.append(i)
        tokens += len(ids[i])
    if batch:
        flush()
    dense, sparse = doc_vectors(model, identity, outputs, texts)
    return dense, sparse, cut


def encode_query(model, text: str, mode: str) -> tuple[np.ndarray | None, Sparse | None]:
    """The query's dense vector and lexical terms, as the index's mode needs them."""
    identity = ModelIdentity.from_spec(model.spec)
    want = set()
    if mode != "sparse":
        want.add("dense")
    if mode != "dense" and identity.has_sparse:
        want.add("sparse")
    out = model.embed([query_inputs(model, text)], want)[0][0] if want else None
    dense = None if out is None or out.dense is None else np.asarray(out.dense, np.float32)
    sparse = None
    if mode != "dense":
        if identity.has_sparse:
            sparse = (np.asarray(out.sparse[0], np.int64), np.asarray(out.sparse[1], np.float32))
        else:
            sparse = lexical_terms(model, [text])[0]
    return dense, sparse
