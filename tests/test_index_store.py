"""Index semantics and durability on small vectors: upsert no-ops and replacements, deletes
from every part, snapshots and replay, stray temp files, a corrupt snapshot, a second process
writing, HNSW tombstones, versions and the CURRENT pointer, metadata filters; the postings
against a brute-force scorer; BGE-M3 lexical weights and FlagEmbedding's hybrid weighting."""

from __future__ import annotations

import logging
import math
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from index.docstore import Document
from embedserve.embedders import ModelEmbedder
from index.errors import ValidationError
from index.manifest import DenseConfig, ModelIdentity
from index.search import Query
from index.sparse import B, K1, SparseIndex
from index.store import IndexStore
from index.verify import verify_index

from helpers import unit_identity, unit_terms as terms, unit_vector

DIM = 16
IDENT = unit_identity(DIM)


def vec(seed: int) -> np.ndarray:
    return unit_vector(seed, DIM)


def put(ix, seeds, texts=None, meta=None):
    docs = [Document(f"d{s}", texts[i] if texts else f"text {s}", (meta or {}).get(s, {"s": s}))
            for i, s in enumerate(seeds)]
    return ix.upsert(docs, [vec(s) for s in seeds], [terms(s) for s in seeds], IDENT)


@pytest.fixture
def store(tmp_path):
    return IndexStore(tmp_path)


def top(ix, v, k=1, **kw):
    return [h.id for h in ix.search(Query(dense=v, top_k=k, **kw), IDENT)]


def test_upsert_same_content_is_a_noop_new_content_replaces(store):
    with store.create("t", IDENT) as ix:
        put(ix, range(5))
        seq = ix.applied
        c = put(ix, [1], meta={1: {"s": 1}})
        assert c.outcomes == {"d1": "unchanged"} and ix.applied == seq
        c = put(ix, [1], meta={1: {"s": "changed"}})
        # a write of its own (a reindex running meanwhile carries it by this number), vectors untouched
        assert c.outcomes == {"d1": "metadata"} and ix.applied == seq + 1 and not c.added and not c.removed
        assert [(q, d.id, d.metadata) for q, d in ix.docs.documents_after(seq)] == [(seq + 1, "d1", {"s": "changed"})]
        assert ix.search(Query(dense=vec(1), top_k=1), IDENT)[0].metadata == {"s": "changed"}
        assert ix.pending([Document("d1", "text 1"), Document("d1", "new"), Document("zz", "x")]) == [False, True, True]
        # New text with new vectors: the old vector is gone from FAISS and the postings.
        c = ix.upsert([Document("d1", "new text")], [vec(101)], [terms(101)], IDENT)
        assert c.outcomes == {"d1": "replaced"}
        assert ix.counts() == {"documents": 5, "dense": 5, "sparse": 5}
        assert top(ix, vec(101)) == ["d1"]
        for h in ix.search(Query(dense=vec(1), top_k=5), IDENT):
            if h.id == "d1":                     # scored by its new vector, not the old one
                assert h.score == pytest.approx(float(vec(101) @ vec(1)), abs=1e-5)


def test_a_doc_store_from_before_wseq_gets_it(store):
    """Doc stores written before the write-sequence column: reopening adds it (= each row's label)."""
    import sqlite3

    from index.docstore import DB_NAME, DocStore
    with store.create("t", IDENT) as ix:
        put(ix, range(4))
        path = ix.path / DB_NAME
    conn = sqlite3.connect(path)
    conn.executescript("DROP INDEX docs_wseq; ALTER TABLE docs DROP COLUMN wseq;")
    conn.close()
    docs = DocStore(path)
    try:
        assert [(q, d.id) for q, d in docs.documents_after(0)] == [(1, "d0"), (2, "d1"), (3, "d2"), (4, "d3")]
        assert list(docs.writes_after(2)) == [3, 4]
    finally:
        docs.close()


def test_delete_removes_from_every_part(store):
    with store.create("t", IDENT) as ix:
        put(ix, range(6))
        c = ix.delete(["d2", "nope", "d2"], IDENT)
        assert c.outcomes == {"d2": "deleted", "nope": "missing"}
        assert ix.counts() == {"documents": 5, "dense": 5, "sparse": 5}
        assert "d2" not in top(ix, vec(2), k=10)
        assert "d2" not in [h.id for h in ix.search(Query(sparse=terms(2), mode="sparse", top_k=10), IDENT)]
        assert ix.search(Query(dense=vec(2), top_k=10, filter={"s": 2}), IDENT) == []


def test_replay_after_unsnapshotted_writes_and_stray_temp_files(store, caplog):
    with store.create("t", IDENT, snapshot_min_ops=10_000) as ix:
        put(ix, range(8))
        ix.snapshot()
        put(ix, range(8, 12))
        ix.delete(["d0"], IDENT)
        ix.close(snapshot=False)               # as if killed: the last writes live only in SQLite
    vdir = store.version_dir("t", "v1")
    (vdir / ".tmp-dense-000000000099.faiss-abc").write_bytes(b"half a file")
    (store.root / ".tmp-t2-xyz").mkdir()
    os.utime(store.root / ".tmp-t2-xyz", (0, 0))              # a leftover from long ago
    (store.root / ".tmp-t3-fresh").mkdir()                     # maybe another process's, right now
    caplog.set_level(logging.WARNING)
    store2 = IndexStore(store.root)
    with store2.open("t", IDENT) as ix:
        assert not [r for r in caplog.records if "rebuilding" in r.getMessage()]
        assert ix.counts() == {"documents": 11, "dense": 11, "sparse": 11}
        assert top(ix, vec(10)) == ["d10"] and "d0" not in top(ix, vec(0), k=11)
    assert not list(vdir.glob(".tmp-*"))
    assert [p.name for p in store.root.glob(".tmp-*")] == [".tmp-t3-fresh"]
    assert store2.names() == ["t"]
    m = store2.manifest("t")
    assert m.applied_seq == 13 and m.counts == {"documents": 11, "dense": 11, "sparse": 11}
    assert sorted(p.name for p in vdir.glob("dense-*")) == ["dense-000000000013.faiss"]


def test_corrupt_snapshot_is_rebuilt_from_sqlite(store, caplog):
    with store.create("t", IDENT) as ix:
        put(ix, range(10))
    m = store.manifest("t")
    path = store.version_dir("t", "v1") / m.files["dense"]["file"]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with store.open("t", IDENT) as ix:
        assert any("checksum" in r.getMessage() for r in caplog.records)
        assert ix.counts()["dense"] == 10 and top(ix, vec(3)) == ["d3"]
        report = verify_index(ix)
        assert not report.ok and "checksum" in report.problems[0]   # the file on disk is still bad...
    with store.open("t", IDENT) as ix:                               # ...until the next snapshot
        put(ix, [77])
        ix.snapshot()
        assert verify_index(ix).ok


def test_a_second_process_sees_writes_and_deletes(store):
    a = store.create("t", IDENT, snapshot_min_ops=4)
    b = IndexStore(store.root).open("t", IDENT)
    put(a, range(3))
    assert top(b, vec(1)) == ["d1"]
    put(a, range(3, 12))                 # a snapshots (every 4 ops) and prunes its removals log
    a.delete(["d1", "d5"], IDENT)
    a.snapshot()
    hits = top(b, vec(1), k=20)
    assert "d1" not in hits and "d5" not in hits and len(hits) == 10
    assert b.counts() == {"documents": 10, "dense": 10, "sparse": 10}
    a.close()
    b.close()


def test_hnsw_tombstones_are_never_returned_and_compact_away(store):
    cfg = DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=40, ef_search=32)
    with store.create("h", IDENT, cfg) as ix:
        put(ix, range(30))
        ix.delete([f"d{i}" for i in range(10)], IDENT)
        ix.upsert([Document("d10", "changed")], [vec(500)], [terms(500)], IDENT)
        assert len(ix.dense.stale) == 11 and ix.dense.live == 20
        for i in range(11):
            assert not set(top(ix, vec(i), k=20)) & {f"d{j}" for j in range(10)}
        assert top(ix, vec(500)) == ["d10"]
        ix.snapshot()
    with store.open("h", IDENT) as ix:      # stale entries are recomputed from SQLite on open
        assert len(ix.dense.stale) == 11 and ix.counts()["dense"] == 20
        ix.rebuild()
        assert len(ix.dense.stale) == 0 and ix.dense.index.ntotal == 20
        assert verify_index(ix).ok


def test_versions_and_current_pointer(store):
    store.create("t", IDENT).close()
    other = ModelIdentity(model="unit-2", fingerprint="v" * 64, dimension=8, normalize=True, pooling="cls",
                          query_prefix="", passage_prefix="", has_sparse=False)
    v2 = store.add_version("t", other)
    assert v2 == "v2" and store.current("t") == "v1" and store.versions("t") == ["v1", "v2"]
    store.set_current("t", v2)
    assert (store.index_dir("t") / "CURRENT").read_text() == "v2\n"
    with store.open("t", other) as ix:
        assert ix.version == "v2" and ix.manifest.sparse == "bm25"
    with store.open("t", IDENT, version="v1") as ix:
        assert ix.version == "v1"
    store.delete("t")
    assert store.names() == [] and not store.index_dir("t").exists()


def test_metadata_filter(store):
    with store.create("t", IDENT) as ix:
        meta = {i: {"lang": ["en", "fr", "de"][i % 3], "n": i, "ok": i % 2 == 0} for i in range(9)}
        meta[8] = {"lang": None}
        put(ix, range(9), meta=meta)
        ids = lambda flt: sorted(h.id for h in ix.search(Query(dense=vec(0), top_k=20, filter=flt), IDENT))
        assert ids({"lang": "fr"}) == ["d1", "d4", "d7"]
        assert ids({"lang": ["fr", "de"], "ok": True}) == ["d2", "d4"]
        assert ids({"lang": None}) == ["d8"]
        assert ids({"n": 3}) == ["d3"]
        assert ids({"lang": "xx"}) == []
        hyb = ix.search(Query(dense=vec(1), sparse=terms(1), mode="hybrid", top_k=20, filter={"lang": "fr"}), IDENT)
        assert sorted(h.id for h in hyb) == ["d1", "d4", "d7"]
        for bad in ({'a"b': 1}, {"a": {"$gt": 1}}, {"a": []}):
            with pytest.raises(ValidationError):
                ix.search(Query(dense=vec(0), filter=bad), IDENT)


def _brute(kind, rows, q_ids, q_w):
    """Reference scorer: Σ w_q·w_d, or textbook Okapi BM25 (k1=1.2, b=0.75)."""
    n = len(rows)
    avgdl = sum(float(w.sum()) for _, w in rows.values()) / max(n, 1)
    out = {}
    for lab, (ids, w) in rows.items():
        d = dict(zip(ids.tolist(), w.tolist()))
        s = 0.0
        for t, qw in zip(q_ids.tolist(), q_w.tolist()):
            if t not in d:
                continue
            if kind == "lexical_weights":
                s += qw * d[t]
            else:
                df = sum(t in set(r[0].tolist()) for r in rows.values())
                idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                tf, dl = d[t], float(w.sum())
                s += qw * idf * tf * (K1 + 1) / (tf + K1 * (1 - B + B * dl / avgdl))
        if s > 0:
            out[lab] = s
    return out


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["lexical_weights", "bm25"]),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 30), st.integers(0, 10**6)), min_size=1, max_size=80))
def test_postings_match_a_brute_force_scorer(kind, ops):
    sp = SparseIndex(kind)
    rows = {}
    for i, (add, label, seed) in enumerate(ops):
        if add:
            ids, w = terms(seed)
            w = np.ceil(w * 3) if kind == "bm25" else w
            sp.add(label, ids, w)
            rows[label] = (ids, w.astype(np.float32))
        else:
            sp.remove(label)
            rows.pop(label, None)
        if i % 17 == 16:
            sp.rebuild()                      # mix the main postings, the delta and the removals
    q_ids, q_w = terms(12345)
    labels, scores = sp.scores(q_ids, q_w)
    got = dict(zip(labels.tolist(), scores.tolist()))
    want = _brute(kind, rows, q_ids, q_w)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4)


def test_bgem3_lexical_weights_and_flagembedding_weighting(store, bgem3_model):
    """On a model with a sparse head: sparse score = Σ w_q·w_d of the model's own lexical
    weights; weighted hybrid = (0.4·dense + 0.2·sparse) / 0.6, FlagEmbedding's formula."""
    texts = ["The quick brown fox jumps over the lazy dog.", "北京是中华人民共和国的首都。",
             "La tour Eiffel est une tour de fer puddlé.", "How much protein should a female eat per day?"]
    ident = ModelIdentity.from_spec(bgem3_model.spec)
    assert ident.lexical == "lexical_weights"
    emb = ModelEmbedder(bgem3_model)
    v = emb.embed_documents(texts)
    dense, sparse = v.dense, v.sparse
    with store.create("m3", ident) as ix:
        ix.upsert([Document(str(i), t) for i, t in enumerate(texts)], dense, sparse, ident)
        q_dense, q_sparse = emb.embed_query("fox and dog", "hybrid")
        hits = ix.search(Query(dense=q_dense, sparse=q_sparse, mode="hybrid", fusion="weighted", top_k=4), ident)
        assert len(hits) == 4
        for h in hits:
            i = int(h.id)
            d = dict(zip(sparse[i][0].tolist(), sparse[i][1].tolist()))
            lexical = sum(w * d.get(t, 0.0) for t, w in zip(q_sparse[0].tolist(), q_sparse[1].tolist()))
            assert h.scores["sparse"] == pytest.approx(lexical, rel=1e-5, abs=1e-7)
            assert h.scores["dense"] == pytest.approx(float(dense[i] @ q_dense), abs=1e-5)
            assert h.score == pytest.approx((0.4 * h.scores["dense"] + 0.2 * h.scores["sparse"]) / 0.6, abs=1e-5)
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
