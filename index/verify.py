"""`embedserve index verify`: is an index whole and consistent, and how good is its search?

Checks: SQLite's own integrity check; snapshot checksums against the manifest; the same
labels in SQLite, FAISS and the postings; each document's content hash; each vector's
dimension, finiteness and norm; sampled documents are their own top hit; and for an
approximate (HNSW) index, recall@10 against exact search over the doc store's vectors.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .core import NORM_TOLERANCE, Index
from .docstore import content_hash
from .durable import sha256_file

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class VerifyReport:
    """What `verify` found; `ok` is False when any problem was found."""

    index: str
    version: str
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    self_hits: int = 0
    sampled: int = 0
    recall_at_10: float | None = None
    seconds: float = 0.0

    def problem(self, msg: str) -> None:
        self.ok = False
        if len(self.problems) < 100:
            self.problems.append(msg)

    def to_dict(self) -> dict:
        return asdict(self)


def verify_index(ix: Index, sample: int = 200, seed: int = 0) -> VerifyReport:
    """Check `ix` (under its lock: writes wait until the report is done; a PostgreSQL version is
    checked by `index.pg.verify`)."""
    if hasattr(ix, "verify"):
        return ix.verify(sample, seed)
    with ix.lock:
        return _verify(ix, sample, seed)


def _verify(ix: Index, sample: int, seed: int) -> VerifyReport:
    t0 = time.perf_counter()
    m = ix.manifest
    rep = VerifyReport(m.index, m.version)
    ix.catch_up()
    quick = ix.docs.integrity()
    if quick != "ok":
        rep.problem(f"SQLite integrity check: {quick}")
    for part, info in m.files.items():
        p = ix.path / info["file"]
        if not p.is_file():
            rep.problem(f"{part} snapshot {info['file']} is missing")
        elif sha256_file(p) != info["sha256"]:
            rep.problem(f"{part} snapshot {info['file']} does not match its manifest checksum")

    db = ix.docs.counts()
    rep.counts = {"sqlite_documents": db["documents"], "sqlite_dense": db["dense"], "sqlite_sparse": db["sparse"],
                  "faiss": ix.dense.live, "faiss_stale": len(ix.dense.stale), "postings": len(ix.sparse)}
    if not db["documents"] == db["dense"] == ix.dense.live == db["sparse"] == len(ix.sparse):
        rep.problem(f"counts disagree: {rep.counts}")

    labels, vectors = scan_documents(ix.docs.iter_docs(), m, rep)
    label_arr = np.array(labels, dtype=np.int64)
    faiss_live = np.setdiff1d(ix.dense.labels(), np.fromiter(ix.dense.stale, np.int64, len(ix.dense.stale)))
    if not np.array_equal(np.sort(faiss_live), np.sort(label_arr)):
        rep.problem(f"FAISS holds {len(np.setdiff1d(faiss_live, label_arr))} labels SQLite does not, and lacks "
                    f"{len(np.setdiff1d(label_arr, faiss_live))} it has")
    if set(ix.sparse.rows) != set(ix.docs.live_labels().tolist()):
        rep.problem("the postings and SQLite hold different documents")

    if len(label_arr):
        mat = np.stack(vectors).astype(np.float32)
        rng = np.random.default_rng(seed)
        pick = rng.choice(len(label_arr), size=min(sample, len(label_arr)), replace=False)
        queries = mat[pick]
        k = min(10, len(label_arr))
        scores, found = ix.dense.search(queries, k)
        rep.sampled = len(pick)
        # Own top hit, or tied with it (duplicate texts have identical vectors).
        own = (queries * mat[pick]).sum(1)
        rep.self_hits = int(((found[:, 0] == label_arr[pick]) | (scores[:, 0] <= own + 1e-5)).sum())
        if rep.self_hits < rep.sampled:
            rep.problem(f"{rep.sampled - rep.self_hits} of {rep.sampled} sampled documents are not their own top hit")
        if m.dense_config.kind != "flat":
            exact = np.argsort(-(queries @ mat.T), axis=1)[:, :k]
            truth = label_arr[exact]
            rep.recall_at_10 = float(np.mean([len(set(f) & set(t)) / k for f, t in zip(found.tolist(), truth.tolist())]))
    rep.seconds = round(time.perf_counter() - t0, 3)
    return rep


def scan_documents(batches, m, rep: VerifyReport, norm_tolerance: float = NORM_TOLERANCE) -> tuple[list, list]:
    """Each document's content hash, and its vector's dimension, finiteness and norm, reported
    into `rep`; (labels, vectors) of the documents with a usable vector. Both backends' verify."""
    labels, vectors = [], []
    for batch in batches:
        for label, ext_id, text, chash, dense, _sparse in batch:
            if content_hash(text) != chash:
                rep.problem(f"document {ext_id!r}: text does not match its content hash")
            if dense is None:
                continue
            if dense.shape != (m.dimension,):
                rep.problem(f"document {ext_id!r}: vector has {dense.shape[0]} dimensions, manifest says {m.dimension}")
                continue
            norm = float(np.linalg.norm(dense)) if np.isfinite(dense).all() else float("nan")
            if not np.isfinite(norm) or norm == 0.0:
                rep.problem(f"document {ext_id!r}: vector is zero or not finite")
            elif m.normalize and abs(norm - 1.0) > norm_tolerance:
                rep.problem(f"document {ext_id!r}: vector norm {norm:.5f}, manifest says normalized")
            labels.append(label)
            vectors.append(dense)
    return labels, vectors
