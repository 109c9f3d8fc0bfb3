"""What the index needs from an embedding model, as a small protocol.

The index never loads or runs a model: a caller hands it an `Embedder` (in process, or a
server's batching engine behind the same methods) whose `identity` is checked against each
version's manifest before its vectors are written or searched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .docstore import Sparse
from .manifest import ModelIdentity


@dataclass(slots=True)
class DocumentVectors:
    """Vectors for a list of documents, in order; `truncated` lists the documents cut to fit."""

    dense: list[np.ndarray]
    sparse: list[Sparse]
    truncated: list[int] = field(default_factory=list)


class Embedder(Protocol):
    """A model as the index sees it."""

    @property
    def identity(self) -> ModelIdentity:
        """Who made the vectors (compared field by field with a manifest)."""
        ...

    def embed_documents(self, texts: list[str]) -> DocumentVectors:
        """Dense vectors and lexical terms of documents (the model's passage convention)."""
        ...

    def embed_query(self, text: str, mode: str) -> tuple[np.ndarray | None, Sparse | None]:
        """The query's dense vector and lexical terms, as far as `mode` needs them."""
        ...


def document_types(identity: ModelIdentity) -> set[str]:
    """Embedding types a document needs in an index of this model: dense, and the sparse head's
    lexical weights where the model has one (else BM25 terms from the text; in a pair, the
    sparse model's)."""
    return {"dense", "sparse"} if identity.has_sparse and not identity.paired else {"dense"}


def query_types(identity: ModelIdentity, mode: str) -> set[str]:
    """Embedding types a query in `mode` (dense | sparse | hybrid) needs from the model; BM25's
    terms come from the tokenizer, not the model."""
    want = set()
    if mode != "sparse":
        want.add("dense")
    if mode != "dense" and identity.has_sparse and not identity.paired:
        want.add("sparse")
    return want
