"""How a version's vectors are typed in PostgreSQL (pgvector)."""

from __future__ import annotations

HALFVEC_ABOVE = 2000            # pgvector's HNSW takes vector up to 2,000 dimensions, halfvec up to 4,000
SPARSE_DIM = 1_000_000_000      # sparsevec's largest dimension: any tokenizer's ids fit


def dense_type(dimension: int) -> str:
    return "halfvec" if dimension > HALFVEC_ABOVE else "vector"
