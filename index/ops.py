"""The one upsert path and the one search path, for every caller (HTTP routes, CLI, migrations).

An upsert is three steps so that a caller may embed in between however it likes (in process,
or awaiting a server's batcher): `plan_upsert` (which documents need vectors: new or changed
text), embed those texts, `commit_upsert`. `upsert_documents` does all three with an
`Embedder`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .core import Index, validate_documents
from .docstore import Document
from .embedder import DocumentVectors, Embedder
from .manifest import ModelIdentity
from .search import DEFAULT_WEIGHTS, Hit, Query


@dataclass(slots=True)
class UpsertResult:
    """What one upsert did, per outcome."""

    index: str
    version: str
    added: int = 0
    replaced: int = 0
    metadata: int = 0
    unchanged: int = 0
    truncated: list[str] = field(default_factory=list)
    sequence: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def plan_upsert(ix: Index, docs: list[Document]) -> list[int]:
    """The positions of `docs` (validated) whose text is not stored yet: they need vectors."""
    return [i for i, need in enumerate(ix.pending(docs)) if need]


def commit_upsert(ix: Index, docs: list[Document], todo: list[int], vectors: DocumentVectors,
                  identity: ModelIdentity) -> UpsertResult:
    """Write `docs`, with `vectors` for the documents at `todo` (the rest keep their stored ones)."""
    dense: list = [None] * len(docs)
    sparse: list = [None] * len(docs)
    for j, i in enumerate(todo):
        dense[i], sparse[i] = vectors.dense[j], vectors.sparse[j]
    change = ix.upsert(docs, dense, sparse, identity)
    result = UpsertResult(index=ix.name, version=ix.version, sequence=change.seq,
                          truncated=[docs[todo[j]].id for j in vectors.truncated])
    for outcome in change.outcomes.values():
        setattr(result, outcome, getattr(result, outcome) + 1)
    return result


def upsert_documents(ix: Index, docs: list[Document], embedder: Embedder) -> UpsertResult:
    """Insert or replace `docs`, embedding only those whose text changed."""
    validate_documents(docs)
    todo = plan_upsert(ix, docs)
    texts = [docs[i].text for i in todo]
    vectors = embedder.embed_documents(texts) if todo else DocumentVectors([], [])
    return commit_upsert(ix, docs, todo, vectors, embedder.identity)


def search_text(ix: Index, embedder: Embedder, text: str, *, top_k: int = 10, mode: str = "dense",
                fusion: str | None = None, weights: tuple[float, float] = DEFAULT_WEIGHTS,
                filter: dict | None = None) -> list[Hit]:
    """Search `ix` for `text`, embedded by `embedder` (refused unless it is the manifest's model)."""
    ix.manifest.check(embedder.identity, "search")
    dense, sparse = embedder.embed_query(text, mode)
    return ix.search(Query(dense=dense, sparse=sparse, top_k=top_k, mode=mode, fusion=fusion,
                           weights=weights, filter=filter), embedder.identity)
