"""The verification gate a new version must pass before it goes live (all printed and stored):
live document counts equal, every vector finite, non-zero, of the manifest's dimension and
norm, each sampled document its own top hit by its own text, and — for the operator — the
top-10 overlap between the old and the new version on sample queries."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from index.core import NORM_TOLERANCE, Index
from index.search import Query

MIN_SELF_HIT = 0.99


@dataclass(slots=True)
class GateReport:
    ok: bool = True
    checks: dict[str, dict] = field(default_factory=dict)
    sampled: int = 0
    documents: int = 0
    self_hit_rate: float | None = None
    top10_overlap: float | None = None

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks[name] = {"ok": bool(ok), "detail": detail}
        self.ok = self.ok and bool(ok)

    def failures(self) -> list[str]:
        return [f"{name}: {c['detail']}" for name, c in self.checks.items() if not c["ok"]]

    def to_dict(self) -> dict:
        return asdict(self)


def run_gate(old: Index, new: Index, embedder, *, sample: int = 1000, old_embedder=None,
             min_self_hit: float = MIN_SELF_HIT, seed: int = 0, settled_seq: int | None = None) -> GateReport:
    """Check `new` (built by `embedder`) against the live `old`; `old_embedder`, when given,
    embeds the overlap queries for the old version. `settled_seq`: the live version's sequence
    number when the last copy pass began (`copy_passes`): writes after it may still be missing."""
    rep = GateReport()
    n_old, n_new = old.docs.counts()["documents"], new.docs.counts()["documents"]
    rep.documents = n_new
    rep.check("counts", *_counts(old, new, n_old, n_new, settled_seq))
    _check_vectors(new, rep)
    labels = new.docs.live_labels()
    if not len(labels):
        return rep
    rng = np.random.default_rng(seed)
    pick = rng.choice(labels, size=min(sample, len(labels)), replace=False).tolist()
    docs = new.docs.fetch(pick)
    ids = [docs[lab][0] for lab in pick if lab in docs]
    texts = [docs[lab][1] for lab in pick if lab in docs]
    rep.sampled = len(ids)
    vectors = embedder.embed_documents(texts).dense
    hits = sum(_top_ids(new, v, 1, embedder.identity)[:1] == [i] for v, i in zip(vectors, ids))
    rep.self_hit_rate = hits / max(len(ids), 1)
    rep.check("self_hit", rep.self_hit_rate >= min_self_hit,
              f"{hits} of {len(ids)} sampled documents are their own top hit by their own text "
              f"({rep.self_hit_rate:.4f}; the gate is {min_self_hit})")
    if old_embedder is not None:
        rep.top10_overlap = _overlap(old, new, old_embedder, embedder, texts[:100])
    return rep


def _counts(old: Index, new: Index, n_old: int, n_new: int, settled_seq: int | None) -> tuple[bool, str]:
    """Equal counts, or — while the live version takes writes — every document missing from
    `new` written to the live one after the last pass began, and documents only in `new`
    possible only if the live version changed since (a deletion): a catch-up pass after the gate
    copies them, and the swap checks the counts exactly under the writers' lock (`counts_at_swap`)."""
    dense = new.counts()["dense"]
    detail = f"live {n_old} documents, new {n_new} (dense vectors {dense})"
    if dense != n_new:
        return False, detail
    if n_old == n_new or settled_seq is None:
        return n_old == n_new, detail
    old_ids, new_ids = old.docs.ids(), new.docs.ids()
    missing, extra = old_ids - new_ids, new_ids - old_ids
    # every live document written since, whatever the writes (updates count too): at most the live count
    later = {d.id for _, d in old.docs.documents_after(settled_seq, len(old_ids) + 1024)} if missing else set()
    ok = missing <= later and (not extra or old.docs.seq() > settled_seq)
    if ok:
        detail += (f"; {len(missing)} added and {len(extra)} deleted on the live version during the last pass, "
                   "copied before the swap, which checks the counts again under the writers' lock")
    return ok, detail


def _check_vectors(new: Index, rep: GateReport) -> None:
    m = new.manifest
    bad: dict[str, int] = {"nan": 0, "zero": 0, "dimension": 0, "norm": 0, "missing": 0}
    for batch in new.docs.iter_docs():
        for _label, _id, _text, _hash, dense, _sparse in batch:
            if dense is None:
                bad["missing"] += 1
            elif dense.shape != (m.dimension,):
                bad["dimension"] += 1
            elif not np.isfinite(dense).all():
                bad["nan"] += 1
            elif not np.any(dense):
                bad["zero"] += 1
            elif m.normalize and abs(float(np.linalg.norm(dense)) - 1.0) > NORM_TOLERANCE:
                bad["norm"] += 1
    rep.check("vectors", not any(bad.values()),
              "all finite, non-zero, of dimension %d%s" % (m.dimension, ", unit norm" if m.normalize else "")
              if not any(bad.values()) else "bad vectors: " + ", ".join(f"{k} {v}" for k, v in bad.items() if v))


def _top_ids(ix: Index, vector, k: int, identity) -> list[str]:
    return [h.id for h in ix.search(Query(dense=np.asarray(vector, np.float32), top_k=k, mode="dense"), identity)]


def _overlap(old: Index, new: Index, old_embedder, new_embedder, queries: list[str]) -> float:
    """Mean |top10(old) ∩ top10(new)| / 10 over `queries`, each embedded by its version's model."""
    scores = []
    for qa, qb in zip(_query_vectors(old_embedder, queries), _query_vectors(new_embedder, queries)):
        a = _top_ids(old, qa, 10, old_embedder.identity)
        b = _top_ids(new, qb, 10, new_embedder.identity)
        scores.append(len(set(a) & set(b)) / max(min(10, len(a)), 1))
    return float(np.mean(scores)) if scores else 1.0


def _query_vectors(embedder, queries: list[str]) -> list:
    """Dense query vectors, in batches where the embedder can (`embed_queries`), else one by one."""
    batched = getattr(embedder, "embed_queries", None)
    if batched is not None:
        return batched(queries)
    return [embedder.embed_query(q, "dense")[0] for q in queries]
