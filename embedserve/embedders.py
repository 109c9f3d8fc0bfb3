"""The model side of the index's `Embedder` protocol: texts -> the vectors an index stores,
with the model's own conventions.

Documents are embedded as `passage` and queries as `query` (the model's prefixes); a document
over the input limit is truncated, never refused. The lexical side is the model's sparse head
where it has one, else the term counts of the text under the model's tokenizer (no prefix,
special tokens dropped) for BM25. `ModelEmbedder` works over an `EmbeddingModel` or an
`EmbedEngine` (which exposes the same tokenizer methods); in process it batches by tokens, and
the HTTP layer runs the same conversions around the engine's batcher.
"""

from __future__ import annotations

import numpy as np

from index.docstore import Sparse
from index.embedder import DocumentVectors, document_types, query_types
from index.manifest import ModelIdentity


def token_batches(lengths: list[int], budget: int, order: list[int] | None = None) -> list[list[int]]:
    """Positions grouped, in `order` (default: as given), into runs of at most `budget` tokens
    (a single longer item gets a run of its own)."""
    batches: list[list[int]] = []
    batch: list[int] = []
    tokens = 0
    for i in (order if order is not None else range(len(lengths))):
        if batch and tokens + lengths[i] > budget:
            batches.append(batch)
            batch, tokens = [], 0
        batch.append(i)
        tokens += lengths[i]
    if batch:
        batches.append(batch)
    return batches


class ModelEmbedder:
    """`index.Embedder` over an embedding model (documents in length-sorted token batches)."""

    def __init__(self, model, *, max_input_length: int | None = None, batch_tokens: int = 4096,
                 sparse_model=None, sparse_max_input_length: int | None = None, prompts: dict | None = None):
        """`sparse_model`: a sparse-only model (SPLADE) whose vectors are the index's sparse side,
        paired with `model`'s dense ones (an `EmbeddingModel` or an engine, like `model`).
        `prompts` (name -> text): applied instead of the model's own (an index's recorded ones, or a
        prompt migration's)."""
        if getattr(model.spec, "task", "embed") != "embed":
            raise ValueError(f"{model.spec.name} is a reranker: it scores query-document pairs and gives no vectors "
                             "for an index")
        if not getattr(model.spec, "has_dense", True):
            raise ValueError(f"{model.spec.name} gives sparse vectors only (SPLADE); an index needs a model with "
                             "a dense output")
        self.model = model
        self.limit = max_input_length or model.max_input_length
        self.batch_tokens = batch_tokens
        self.identity = ModelIdentity.from_spec(model.spec)
        if prompts:
            self.identity = self.identity.with_prompts(prompts)
        self.prompts = self.identity.prompt_texts()
        self.sparse_model = sparse_model
        if sparse_model is not None:
            if "sparse" not in sparse_model.spec.embedding_types:
                raise ValueError(f"{sparse_model.spec.name} gives no sparse vectors: pair a SPLADE model (or a "
                                 "model with a sparse head) as the sparse side")
            self.sparse_limit = sparse_max_input_length or sparse_model.max_input_length
            self.identity = self.identity.with_sparse_model(sparse_model.spec)

    # ------------------------------------------------------ conversions (shared with HTTP)
    def sparse_inputs(self, texts: list[str]) -> list[list[int]]:
        """A pair's sparse side: token ids of `texts` under the sparse model, cut to its limit."""
        return [self.sparse_model.truncate(x, self.sparse_limit) for x in self.sparse_model.tokenize(texts, None)]

    def passage_inputs(self, texts: list[str]) -> tuple[list[list[int]], list[int]]:
        """Token ids of documents (passage prompt), truncated to the limit; and which were cut."""
        ids = self._tokenize(texts, self.prompts["passage"])
        cut = [i for i, x in enumerate(ids) if len(x) > self.limit]
        for i in cut:
            ids[i] = self.model.truncate(ids[i], self.limit)
        return ids, cut

    def query_inputs(self, text: str, prompt_name: str = "query") -> list[int]:
        """Token ids of a query (its prompt: query unless named), truncated to the limit."""
        return self.model.truncate(self._tokenize([text], self.prompts[prompt_name])[0], self.limit)

    def _tokenize(self, texts: list[str], prompt: str) -> list[list[int]]:
        return self.model.tokenize([prompt + t for t in texts] if prompt else texts, None)

    def lexical_terms(self, texts: list[str]) -> list[Sparse]:
        """BM25's side: (unique token ids, their counts) of each raw text, special tokens dropped."""
        special = np.array(sorted(self.model.special_ids), dtype=np.int64)
        out = []
        for ids in self.model.tokenize(texts, None):
            arr = np.asarray(ids, dtype=np.int64)
            uniq, counts = np.unique(arr[~np.isin(arr, special)], return_counts=True)
            out.append((uniq, counts.astype(np.float32)))
        return out

    def document_vectors(self, outputs: list, texts: list[str], cut: list[int],
                         sparse_outputs: list | None = None) -> DocumentVectors:
        """Index vectors from the model's outputs (`EmbedOutput`s) for `texts` (a pair: the
        sparse side from the sparse model's `sparse_outputs`)."""
        dense = [np.asarray(o.dense, dtype=np.float32) for o in outputs]
        if self.identity.paired:
            outputs = sparse_outputs
        if self.identity.has_sparse:
            sparse = [(np.asarray(o.sparse[0], np.int64), np.asarray(o.sparse[1], np.float32)) for o in outputs]
        else:
            sparse = self.lexical_terms(texts)
        return DocumentVectors(dense, sparse, cut)

    def query_vectors(self, out, text: str, mode: str, sparse_out=None) -> tuple[np.ndarray | None, Sparse | None]:
        """The query's dense vector and lexical terms from its output (None if `mode` needs no
        model; a pair: the sparse side from the sparse model's `sparse_out`)."""
        dense = None if out is None or out.dense is None else np.asarray(out.dense, np.float32)
        sparse = None
        if self.identity.paired:
            out = sparse_out
        if mode != "dense":
            if self.identity.has_sparse:
                sparse = (np.asarray(out.sparse[0], np.int64), np.asarray(out.sparse[1], np.float32))
            else:
                sparse = self.lexical_terms([text])[0]
        return dense, sparse

    # ------------------------------------------------------ index.Embedder, in process
    def embed_documents(self, texts: list[str]) -> DocumentVectors:
        ids, cut = self.passage_inputs(texts)
        outputs = self._embed_in_batches(self.model, ids, document_types(self.identity))
        sparse = self._sparse_outputs(texts) if self.identity.paired else None
        return self.document_vectors(outputs, texts, cut, sparse)

    def _sparse_outputs(self, texts: list[str]) -> list:
        return self._embed_in_batches(self.sparse_model, self.sparse_inputs(texts), {"sparse"})

    def embed_queries(self, texts: list[str]) -> list[np.ndarray]:
        """Dense vectors of many queries (query prompt, truncated to the limit), batched under the
        token budget as documents are: what the gate's overlap check embeds."""
        ids = [self.model.truncate(x, self.limit) for x in self._tokenize(texts, self.prompts["query"])]
        outputs = self._embed_in_batches(self.model, ids, query_types(self.identity, "dense"))
        return [np.asarray(o.dense, np.float32) for o in outputs]

    def _embed_in_batches(self, model, ids: list[list[int]], want) -> list:
        """`model`'s outputs for `ids`, in their order, from length-sorted batches under the token budget."""
        lengths = [len(x) for x in ids]
        outputs: list = [None] * len(ids)
        for batch in token_batches(lengths, self.batch_tokens, sorted(range(len(ids)), key=lengths.__getitem__)):
            for i, o in zip(batch, model.embed([ids[i] for i in batch], want)[0]):
                outputs[i] = o
        return outputs

    def embed_query(self, text: str, mode: str) -> tuple[np.ndarray | None, Sparse | None]:
        want = query_types(self.identity, mode)
        out = self.model.embed([self.query_inputs(text)], want)[0][0] if want else None
        sparse = self._sparse_outputs([text])[0] if self.identity.paired and mode != "dense" else None
        return self.query_vectors(out, text, mode, sparse)


def load_embedder(model: str, dtype: str = "auto", *, threads: int | None = None,
                  sparse_model: str | None = None, prompts: dict | None = None) -> ModelEmbedder:
    """An in-process embedder for `model` (a bundled name or a local directory) in `dtype`, its
    sparse side from `sparse_model` if given (a pair), with `prompts` instead of the model's own
    if given. A module-level function, so a Ray worker can be handed it by reference and load
    the model itself."""
    if threads:
        import torch
        torch.set_num_threads(threads)
    from .models.cross_encoder import load_model
    from .models.registry import resolve_model
    name, path = resolve_model(model)
    sparse = None
    if sparse_model is not None:
        sname, spath = resolve_model(sparse_model)
        sparse = load_model(spath, name=sname, dtype=dtype)
    return ModelEmbedder(load_model(path, name=name, dtype=dtype), sparse_model=sparse, prompts=prompts)
