"""Sparse postings: token id -> (doc, weight), scored as Σ w_q · term(d, t).

Two kinds, fixed per index by the manifest:
  lexical_weights  BGE-M3's sparse head: term = w_d (FlagEmbedding's lexical score Σ w_q·w_d)
  bm25             models without a sparse head: the stored weight is the term count in the doc
                   text (the model's tokenizer), term = Okapi BM25 with k1=1.2, b=0.75

Postings are built in bulk (sorted arrays, one `bincount` per query). Rows written since the
last build live in a small delta with postings of its own, and removed rows are masked, so a
write costs a rebuild of the delta only; both fold into the main postings once they grow. Corpus statistics for BM25 (df, average length) are kept exact on every write.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .durable import atomic_write_with

logger = logging.getLogger(__name__)

K1, B = 1.2, 0.75
KINDS = ("lexical_weights", "bm25")


@dataclass(slots=True)
class _Postings:
    """Immutable postings over a set of rows; row r is `labels[r]`."""

    labels: np.ndarray      # (R,) int64
    tokens: np.ndarray      # (U,) sorted unique token ids
    ptr: np.ndarray         # (U+1,) postings of tokens[u] are rows[ptr[u]:ptr[u+1]]
    rows: np.ndarray        # (nnz,) int64 row positions
    weights: np.ndarray     # (nnz,) float32
    doclen: np.ndarray      # (R,) float32: Σ weights of the row (bm25: its token count)

    @classmethod
    def build(cls, items: list[tuple[int, np.ndarray, np.ndarray]]) -> "_Postings":
        labels = np.array([it[0] for it in items], dtype=np.int64)
        lengths = np.array([len(it[1]) for it in items], dtype=np.int64)
        ids = np.concatenate([it[1] for it in items]) if items else np.zeros(0, np.int64)
        w = np.concatenate([it[2] for it in items]).astype(np.float32) if items else np.zeros(0, np.float32)
        rows = np.repeat(np.arange(len(items), dtype=np.int64), lengths)
        doclen = np.array([float(it[2].sum()) for it in items], dtype=np.float32)
        order = np.argsort(ids, kind="stable")
        ids, rows, w = ids[order], rows[order], w[order]
        tokens, starts = np.unique(ids, return_index=True)
        ptr = np.append(starts, len(ids)).astype(np.int64)
        return cls(labels, tokens, ptr, rows, w, doclen)


class SparseIndex:
    """All live sparse rows, their postings, and the statistics BM25 needs."""

    def __init__(self, kind: str):
        assert kind in KINDS, kind
        self.kind = kind
        self.rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.df = np.zeros(0, dtype=np.int64)       # live rows holding each token id
        self.total_len = 0.0                        # Σ doclen over live rows
        self._main = _Postings.build([])
        self._pos: dict[int, int] = {}              # label -> row in _main
        self._dead = np.zeros(0, dtype=bool)        # rows of _main removed since the build
        self._delta: set[int] = set()               # labels added since the build
        self._delta_postings: _Postings | None = None  # postings of the delta, built on demand

    def __len__(self) -> int:
        return len(self.rows)

    # ----------------------------------------------------------------- writes
    def add(self, label: int, ids: np.ndarray, weights: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        weights = np.asarray(weights, dtype=np.float32)
        if label in self.rows:
            self.remove(label)
        self.rows[label] = (ids, weights)
        self._delta.add(label)
        self._delta_postings = None
        if len(ids):
            if ids.max() >= len(self.df):
                self.df = np.concatenate([self.df, np.zeros(int(ids.max()) + 1 - len(self.df), np.int64)])
            np.add.at(self.df, ids, 1)
        self.total_len += float(weights.sum())

    def remove(self, label: int) -> None:
        row = self.rows.pop(label, None)
        if row is None:
            return
        ids, weights = row
        np.subtract.at(self.df, ids, 1)
        self.total_len -= float(weights.sum())
        if label in self._delta:
            self._delta.discard(label)
            self._delta_postings = None
        else:
            self._dead[self._pos[label]] = True

    def _maybe_rebuild(self) -> None:
        n_main = len(self._main.labels)
        if len(self._delta) > max(1000, n_main // 10) or self._dead.sum() > max(1000, n_main // 4):
            self.rebuild()

    def rebuild(self) -> None:
        """Fold the delta and the removals into fresh postings."""
        items = [(label, ids, w) for label, (ids, w) in sorted(self.rows.items())]
        self._main = _Postings.build(items)
        self._pos = {int(label): r for r, label in enumerate(self._main.labels)}
        self._dead = np.zeros(len(items), dtype=bool)
        self._delta = set()
        self._delta_postings = None

    # ----------------------------------------------------------------- search
    def scores(self, q_ids: np.ndarray, q_weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(labels, scores) of every live row sharing a token with the query (score > 0)."""
        self._maybe_rebuild()
        q_ids = np.asarray(q_ids, dtype=np.int64)
        q_weights = np.asarray(q_weights, dtype=np.float32)
        if not len(q_ids) or not self.rows:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        if self._delta_postings is None:
            self._delta_postings = _Postings.build([(lab, *self.rows[lab]) for lab in sorted(self._delta)])
        idf = self._idf(q_ids)
        parts = [self._score(self._main, self._dead, q_ids, q_weights, idf),
                 self._score(self._delta_postings, None, q_ids, q_weights, idf)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]).astype(np.float32)

    def _score(self, m: _Postings, dead: np.ndarray | None, q_ids, q_weights, idf) -> tuple[np.ndarray, np.ndarray]:
        """Score the rows of one postings set: one slice per query token, one bincount."""
        if not len(m.labels) or not len(m.tokens):
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        at = np.searchsorted(m.tokens, q_ids)
        hit = (at < len(m.tokens)) & (m.tokens[np.minimum(at, len(m.tokens) - 1)] == q_ids)
        row_parts, val_parts = [], []
        for u, qi in zip(at[hit], np.nonzero(hit)[0]):
            sl = slice(m.ptr[u], m.ptr[u + 1])
            rows = m.rows[sl]
            row_parts.append(rows)
            val_parts.append(q_weights[qi] * self._term(m.weights[sl], m.doclen[rows], idf[qi]))
        if not row_parts:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        acc = np.bincount(np.concatenate(row_parts), weights=np.concatenate(val_parts), minlength=len(m.labels))
        if dead is not None:
            acc[dead] = 0.0
        nz = np.nonzero(acc > 0)[0]
        return m.labels[nz], acc[nz]

    def _idf(self, q_ids: np.ndarray) -> np.ndarray:
        if self.kind != "bm25":
            return np.ones(len(q_ids), dtype=np.float32)
        n = len(self.rows)
        df = np.zeros(len(q_ids), dtype=np.float64)
        inside = q_ids < len(self.df)
        df[inside] = self.df[q_ids[inside]]
        return np.log1p((n - df + 0.5) / (df + 0.5)).astype(np.float32)

    def _term(self, w: np.ndarray, doclen: np.ndarray, idf) -> np.ndarray:
        if self.kind == "lexical_weights":
            return w
        avgdl = self.total_len / max(len(self.rows), 1)
        return idf * w * (K1 + 1) / (w + K1 * (1 - B + B * doclen / max(avgdl, 1e-9)))

    # -------------------------------------------------------------- snapshots
    def save(self, path: Path) -> None:
        """Write every live row (temp name, fsync, rename)."""
        items = sorted(self.rows.items())
        labels = np.array([k for k, _ in items], dtype=np.int64)
        lengths = np.array([len(v[0]) for _, v in items], dtype=np.int64)
        ids = np.concatenate([v[0] for _, v in items]) if items else np.zeros(0, np.int64)
        w = np.concatenate([v[1] for _, v in items]) if items else np.zeros(0, np.float32)

        def write(tmp: Path):
            with open(tmp, "wb") as f:
                np.savez(f, labels=labels, lengths=lengths, ids=ids.astype(np.int64), weights=w.astype(np.float32))
        atomic_write_with(path, write)

    @classmethod
    def load(cls, path: Path, kind: str) -> "SparseIndex":
        with np.load(path, allow_pickle=False) as z:
            labels, lengths, ids, w = z["labels"], z["lengths"], z["ids"], z["weights"]
        self = cls(kind)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        for r, label in enumerate(labels.tolist()):
            self.rows[label] = (ids[bounds[r]:bounds[r + 1]], w[bounds[r]:bounds[r + 1]])
        if len(ids):
            self.df = np.bincount(ids, minlength=int(ids.max()) + 1).astype(np.int64)
        self.total_len = float(w.sum())
        self.rebuild()
        return self
