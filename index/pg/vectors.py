"""How a version's vectors are typed and spelled in PostgreSQL (pgvector and full-text)."""

from __future__ import annotations

HALFVEC_ABOVE = 2000            # pgvector's HNSW takes vector up to 2,000 dimensions, halfvec up to 4,000
SPARSE_DIM = 1_000_000_000      # sparsevec's largest dimension: any tokenizer's ids fit


def dense_type(dimension: int) -> str:
    return "halfvec" if dimension > HALFVEC_ABOVE else "vector"


def lexemes(ids, weights) -> str:
    """The model's tokens of a text as words for `to_tsvector('simple', ...)`: token id t counted
    w times becomes 't<id>' w times (language-neutral: Chinese is split as the tokenizer splits it)."""
    return " ".join(" ".join([f"t{int(i)}"] * max(1, int(round(float(w))))) for i, w in zip(ids, weights))


def tsquery(ids) -> str:
    """A query's tokens as an OR of lexemes (ids are integers: nothing of the text reaches the query)."""
    return " | ".join(f"t{int(i)}" for i in dict.fromkeys(int(i) for i in ids))
