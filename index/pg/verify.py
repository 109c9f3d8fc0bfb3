"""`embedserve index verify` of a PostgreSQL version: counts, content hashes, every vector's
dimension and norm, sampled documents their own top hit through the version's own search
(HNSW when it has one), and recall@10 of that search against an exact one computed here."""

from __future__ import annotations

import time

import numpy as np

from ..core import NORM_TOLERANCE
from ..search import Query
from ..verify import VerifyReport, scan_documents


def verify(ix, sample: int = 200, seed: int = 0) -> VerifyReport:
    t0 = time.perf_counter()
    m = ix.manifest
    rep = VerifyReport(m.index, m.version)
    db = ix.docs.counts()
    rep.counts = {"documents": db["documents"], "dense": db["dense"], "sparse": db["sparse"]}
    if not db["documents"] == db["dense"] == db["sparse"]:
        rep.problem(f"counts disagree: {rep.counts}")
    # halfvec (past 2,000 dimensions) keeps ~3 significant digits: norms within 4e-3
    labels, vectors = scan_documents(ix.docs.iter_docs(), m, rep, norm_tolerance=NORM_TOLERANCE * 4)
    if labels:
        mat = np.stack(vectors).astype(np.float32)
        label_arr = np.array(labels, dtype=np.int64)
        rng = np.random.default_rng(seed)
        pick = rng.choice(len(labels), size=min(sample, len(labels)), replace=False)
        k = min(10, len(labels))
        identity = m.identity
        found = [[h.label for h in ix.search(Query(dense=mat[i], top_k=k), identity)] for i in pick]
        rep.sampled = len(pick)
        own = (mat[pick] * mat[pick]).sum(1)
        top = {lab: j for j, lab in enumerate(labels)}
        rep.self_hits = int(sum(1 for row, i, o in zip(found, pick, own)
                                if row and (row[0] == label_arr[i] or float(mat[top[row[0]]] @ mat[i]) >= o - 1e-3)))
        if rep.self_hits < rep.sampled:
            rep.problem(f"{rep.sampled - rep.self_hits} of {rep.sampled} sampled documents are not their own top hit")
        if m.dense_config.kind != "flat":
            exact = np.argsort(-(mat[pick] @ mat.T), axis=1)[:, :k]
            truth = label_arr[exact]
            rep.recall_at_10 = float(np.mean([len(set(f) & set(t.tolist())) / k for f, t in zip(found, truth)]))
    rep.seconds = round(time.perf_counter() - t0, 3)
    return rep
