"""BGE-M3's relevance scores over our outputs (FlagEmbedding's definitions: `compute_score` of
`BGEM3FlagModel`, FlagEmbedding 1.4.2; tests/fixtures/make_bgem3_fixture.py quotes its source).

    dense   = <q_cls, d_cls> (both L2-normalized)
    sparse  = Σ w_q · w_d over the token ids both hold
    colbert = mean over the query's vectors (CLS dropped, </s> kept) of the best dot product
    sums    = Σ w_m · score_m / Σ w_m over the methods named, weights [dense, sparse, colbert] (default 1, 1, 1)
"""

from __future__ import annotations

import numpy as np


def lexical_score(q: tuple[np.ndarray, np.ndarray], d: tuple[np.ndarray, np.ndarray]) -> float:
    """Σ w_q · w_d over token ids present in both sparse vectors."""
    common, qi, di = np.intersect1d(q[0], d[0], assume_unique=True, return_indices=True)
    return float(np.dot(q[1][qi].astype(np.float64), d[1][di]))


def colbert_score(q: np.ndarray, d: np.ndarray) -> float:
    """Mean over query vectors of the best dot product with any document vector."""
    return float((q @ d.T).max(axis=1).mean())


M3_METHODS = ("colbert", "dense", "sparse", "sparse+dense", "colbert+sparse+dense")
M3_DEFAULT_WEIGHTS = (1.0, 1.0, 1.0)      # FlagEmbedding's weights_for_different_modes=None


def m3_score(q, d, method: str, weights=M3_DEFAULT_WEIGHTS) -> float:
    """`method`'s score of document output `d` for query output `q` (`EmbedOutput`s holding the
    vectors it needs); `weights` = [dense, sparse, colbert]."""
    parts = method.split("+")
    w = dict(zip(("dense", "sparse", "colbert"), map(float, weights)))
    score = {}
    if "dense" in parts:
        score["dense"] = float(np.dot(q.dense.astype(np.float64), d.dense))
    if "sparse" in parts:
        score["sparse"] = lexical_score(q.sparse, d.sparse)
    if "colbert" in parts:
        score["colbert"] = colbert_score(q.colbert, d.colbert)
    if len(parts) == 1:
        return score[parts[0]]
    return sum(score[m] * w[m] for m in parts) / sum(w[m] for m in parts)
