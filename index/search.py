"""Search over one index version: dense | sparse | hybrid, with a metadata filter.

Hybrid takes the top candidates of each side, scores every candidate exactly on both sides,
and fuses them per query, either by FlagEmbedding's weighted sum
(w_dense·s_dense + w_sparse·s_sparse) / (w_dense + w_sparse), or by weighted reciprocal-rank
fusion Σ w/(60 + rank) / Σ w (with equal weights, plain RRF). BM25 scores are unbounded, so the weighted sum divides them by the query's best
BM25 score first (lexical weights are used as they are, as FlagEmbedding does); without a
`fusion`, indexes with lexical weights fuse by weighted sum, BM25 ones by RRF.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

from .dense import DenseIndex
from .docstore import DocStore, Sparse
from .errors import ValidationError
from .sparse import SparseIndex

logger = logging.getLogger(__name__)

MODES = ("dense", "sparse", "hybrid")
FUSIONS = ("weighted", "rrf")
RRF_K = 60
DEFAULT_WEIGHTS = (0.4, 0.2)     # FlagEmbedding's defaults for dense and sparse
MAX_TOP_K = 1000


@dataclass(slots=True)
class Query:
    """One search; the vectors come from the model the manifest names."""

    dense: np.ndarray | None = None
    sparse: Sparse | None = None
    top_k: int = 10
    mode: str = "dense"
    fusion: str | None = None
    weights: tuple[float, float] = DEFAULT_WEIGHTS
    filter: dict | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValidationError(f"mode {self.mode!r}: choose dense, sparse or hybrid", param="mode")
        if self.fusion is not None and self.fusion not in FUSIONS:
            raise ValidationError(f"fusion {self.fusion!r}: choose weighted or rrf", param="fusion")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= MAX_TOP_K:
            raise ValidationError(f"top_k must be an integer in [1, {MAX_TOP_K}], not {self.top_k!r}", param="top_k")
        wd, ws = self.weights
        if not all(isinstance(w, (int, float)) and math.isfinite(w) and w >= 0 for w in (wd, ws)) or wd + ws <= 0:
            raise ValidationError("weights must be two non-negative numbers (dense, sparse) that are not both 0",
                                  param="weights")
        if self.filter is not None and not isinstance(self.filter, dict):
            raise ValidationError("filter must be an object of metadata key -> value (or list of values)",
                                  param="filter")
        if self.mode != "sparse" and self.dense is None:
            raise ValidationError(f"mode {self.mode} needs the query's dense vector", param="mode")
        if self.mode != "dense" and self.sparse is None:
            raise ValidationError(f"mode {self.mode} needs the query's sparse terms", param="mode")


@dataclass(slots=True)
class Hit:
    """One result: the document and its scores (fused, and per side where computed)."""

    id: str
    score: float
    text: str
    metadata: dict
    scores: dict[str, float] = field(default_factory=dict)
    label: int = -1

    def to_dict(self) -> dict:
        """The hit as an API or the CLI shows it (the internal label left out)."""
        return {"id": self.id, "score": self.score, "text": self.text, "metadata": self.metadata,
                "scores": self.scores}


def run(query: Query, dense: DenseIndex, sparse: SparseIndex, docs: DocStore) -> list[Hit]:
    """Execute `query`; the caller holds the index lock and has checked the manifest."""
    allowed = docs.filter_labels(query.filter) if query.filter else None
    if allowed is not None and not len(allowed):
        return []
    k = query.top_k
    if query.mode == "dense":
        d = _dense_top(dense, query.dense, k, allowed)
        ranked = [(lab, s, {"dense": s}) for lab, s in d]
    elif query.mode == "sparse":
        labels, scores = _sparse_all(sparse, query.sparse, allowed)
        ranked = [(lab, s, {"sparse": s}) for lab, s in _top(labels, scores, k)]
    else:
        ranked = _hybrid(query, dense, sparse, docs, allowed)
    found = docs.fetch([lab for lab, _, _ in ranked])
    hits = []
    for lab, score, parts in ranked:
        if lab in found:   # a row deleted by another process after our catch-up is skipped
            ext_id, text, meta = found[lab]
            hits.append(Hit(ext_id, float(score), text, meta, {k_: float(v) for k_, v in parts.items()}, lab))
    return hits


def _dense_top(dense: DenseIndex, q: np.ndarray, k: int, allowed) -> list[tuple[int, float]]:
    if dense.live == 0:
        return []
    scores, labels = dense.search(q[None, :], k, allowed)
    return [(int(lab), float(s)) for lab, s in zip(labels[0], scores[0]) if lab >= 0]


def _sparse_all(sparse: SparseIndex, q: Sparse, allowed) -> tuple[np.ndarray, np.ndarray]:
    labels, scores = sparse.scores(q[0], q[1])
    if allowed is not None and len(labels):
        keep = np.isin(labels, allowed)
        labels, scores = labels[keep], scores[keep]
    return labels, scores


def _top(labels: np.ndarray, scores: np.ndarray, k: int) -> list[tuple[int, float]]:
    """Top k by score, ties broken by label (deterministic)."""
    if not len(labels):
        return []
    order = np.lexsort((labels, -scores))[:k]
    return [(int(labels[i]), float(scores[i])) for i in order]


def _hybrid(query: Query, dense: DenseIndex, sparse: SparseIndex, docs: DocStore, allowed):
    k = query.top_k
    n = max(4 * k, 50)
    d_top = _dense_top(dense, query.dense, n, allowed)
    s_labels, s_scores = _sparse_all(sparse, query.sparse, allowed)
    s_top = _top(s_labels, s_scores, n)
    # Exact scores on both sides for every candidate (a candidate of one side may rank low on the other).
    d_score = dict(d_top)
    s_score = dict(zip(s_labels.tolist(), s_scores.tolist()))
    cands = list(dict.fromkeys([lab for lab, _ in d_top] + [lab for lab, _ in s_top]))
    missing = [lab for lab in cands if lab not in d_score]
    for lab, vec in docs.dense_for(missing).items():
        d_score[lab] = float(vec @ query.dense)
    s_max = float(s_scores.max()) if len(s_scores) else 0.0
    return fuse(query, sparse.kind, d_top, s_top, d_score, s_score, s_max)


def fuse(query: Query, kind: str, d_top: list[tuple[int, float]], s_top: list[tuple[int, float]],
         d_score: dict[int, float], s_score: dict[int, float], s_max: float) -> list[tuple[int, float, dict]]:
    """The hybrid ranking of the candidates of both sides (`d_top`, `s_top`, best first), from
    their exact scores on each side; `s_max` is the query's best sparse score (BM25-like scores
    are divided by it in the weighted sum). Every backend fuses here."""
    k = query.top_k
    cands = list(dict.fromkeys([lab for lab, _ in d_top] + [lab for lab, _ in s_top]))
    fusion = query.fusion or ("weighted" if kind == "lexical_weights" else "rrf")
    fused = {}
    wd, ws = query.weights
    if fusion == "weighted":
        scale = 1.0
        if kind != "lexical_weights" and s_max > 0:
            scale = 1.0 / max(s_max, 1e-9)
        for lab in cands:
            fused[lab] = (wd * d_score.get(lab, 0.0) + ws * scale * s_score.get(lab, 0.0)) / (wd + ws)
    else:
        d_rank = {lab: r for r, (lab, _) in enumerate(d_top, 1)}
        s_rank = {lab: r for r, (lab, _) in enumerate(s_top, 1)}
        for lab in cands:
            fused[lab] = sum(w / (RRF_K + rk[lab]) for w, rk in ((wd, d_rank), (ws, s_rank)) if lab in rk) / (wd + ws)
    labels = np.array(cands, dtype=np.int64)
    scores = np.array([fused[lab] for lab in cands], dtype=np.float64)
    return [(lab, s, {"dense": d_score.get(lab, 0.0), "sparse": s_score.get(lab, 0.0)})
            for lab, s in _top(labels, scores, k)]
