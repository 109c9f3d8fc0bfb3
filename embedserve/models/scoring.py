"""BGE-M3's relevance scores over our outputs (FlagEmbedding's definitions)."""

from __future__ import annotations

import numpy as np


def lexical_score(q: tuple[np.ndarray, np.ndarray], d: tuple[np.ndarray, np.ndarray]) -> float:
    """Σ w_q · w_d over token ids present in both sparse vectors."""
    common, qi, di = np.intersect1d(q[0], d[0], assume_unique=True, return_indices=True)
    return float(np.dot(q[1][qi].astype(np.float64), d[1][di]))


def colbert_score(q: np.ndarray, d: np.ndarray) -> float:
    """Mean over query vectors of the best dot product with any document vector."""
    return float((q @ d.T).max(axis=1).mean())
