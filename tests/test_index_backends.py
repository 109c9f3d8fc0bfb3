"""The index's behaviour on both backends — local files and a real PostgreSQL + pgvector —
through the one interface every caller uses (`index.backend.open_store`): upsert no-ops,
metadata-only writes and replacements with their write sequence, deletes from every part,
metadata filters, the manifest refusing another model on open / write / search, versions,
a second store (another replica) seeing every acknowledged write at once, FlagEmbedding's
weighted hybrid on lexical weights, BM25 without a sparse head (the same scores on both), vectors past 2,000
dimensions, `verify`; and on PostgreSQL alone: a retired version refuses writes, the database
gone is a retryable BackendUnavailableError and coming back needs nothing, identifiers that
would break SQL are names like any other, and psycopg is not imported without a URL."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import numpy as np
import pytest

from index.backend import open_store
from index.docstore import Document
from index.errors import BackendUnavailableError, ConflictError, NotFoundError, RetiredError, ValidationError
from index.manifest import DenseConfig, ModelIdentity
from index.search import Query
from index.verify import verify_index

from helpers import unit_identity, unit_terms as terms, unit_vector

DIM = 16
IDENT = unit_identity(DIM)


def vec(seed: int, dim: int = DIM) -> np.ndarray:
    return unit_vector(seed, dim)


def put(ix, seeds, meta=None, ident=IDENT):
    docs = [Document(f"d{s}", f"text {s}", (meta or {}).get(s, {"s": s})) for s in seeds]
    return ix.upsert(docs, [vec(s, ident.dimension) for s in seeds], [terms(s) for s in seeds], ident)


def top(ix, v, k=1, ident=IDENT, **kw):
    return [h.id for h in ix.search(Query(dense=v, top_k=k, **kw), ident)]


@pytest.fixture(params=["local", pytest.param("postgres", marks=pytest.mark.postgres)])
def where(request, tmp_path) -> tuple[str | None, str]:
    """(index URL or None, index root) of each backend."""
    if request.param == "local":
        return None, str(tmp_path / "ix")
    return request.getfixturevalue("pg_url"), str(tmp_path / "ix")


@pytest.fixture
def store(where):
    return open_store(*where)


def test_upsert_noop_metadata_and_replacement_with_write_sequence(store):
    ix = store.create("t", IDENT)
    c = put(ix, range(5))
    assert c.seq == 5 and set(c.outcomes.values()) == {"added"}
    c = put(ix, [1])
    assert c.outcomes == {"d1": "unchanged"} and c.seq == 5
    c = put(ix, [1], meta={1: {"s": "changed"}})
    assert c.outcomes == {"d1": "metadata"} and c.seq == 6
    assert [(q, d.id, d.metadata) for q, d in ix.docs.documents_after(5)] == [(6, "d1", {"s": "changed"})]
    assert ix.search(Query(dense=vec(1), top_k=1), IDENT)[0].metadata == {"s": "changed"}
    assert ix.pending([Document("d1", "text 1"), Document("d1", "new"), Document("zz", "x")]) == [False, True, True]
    c = ix.upsert([Document("d1", "new text")], [vec(101)], [terms(101)], IDENT)
    assert c.outcomes == {"d1": "replaced"} and c.seq == 7
    assert ix.counts() == {"documents": 5, "dense": 5, "sparse": 5}
    assert top(ix, vec(101)) == ["d1"]
    hit = next(h for h in ix.search(Query(dense=vec(1), top_k=5), IDENT) if h.id == "d1")
    assert hit.score == pytest.approx(float(vec(101) @ vec(1)), abs=1e-5)      # its new vector, not the old
    assert ix.docs.seq() == 7 and list(ix.docs.writes_after(5)) == [7]      # d1's last write
    ix.close()


def test_delete_removes_from_every_part(store):
    ix = store.create("t", IDENT)
    put(ix, range(6))
    c = ix.delete(["d2", "nope", "d2"], IDENT)
    assert c.outcomes == {"d2": "deleted", "nope": "missing"}
    assert ix.counts() == {"documents": 5, "dense": 5, "sparse": 5}
    assert "d2" not in top(ix, vec(2), k=10)
    assert "d2" not in [h.id for h in ix.search(Query(sparse=terms(2), mode="sparse", top_k=10), IDENT)]
    assert ix.search(Query(dense=vec(2), top_k=10, filter={"s": 2}), IDENT) == []
    assert ix.docs.ids() == {f"d{i}" for i in range(6)} - {"d2"}
    ix.close()


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_metadata_filter(store, kind):
    ix = store.create("t", IDENT, DenseConfig(kind=kind, hnsw_m=8, ef_construction=40, ef_search=16))
    meta = {i: {"lang": ["en", "fr", "de"][i % 3], "n": i, "ok": i % 2 == 0} for i in range(9)}
    meta[8] = {"lang": None}
    put(ix, range(9), meta=meta)
    ids = lambda flt: sorted(h.id for h in ix.search(Query(dense=vec(0), top_k=20, filter=flt), IDENT))  # noqa: E731
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
    ix.close()


def test_the_manifest_refuses_another_model_everywhere(store):
    store.create("t", IDENT).close()
    other = dataclasses.replace(IDENT, fingerprint="x" * 64)
    with pytest.raises(ConflictError, match="fingerprint mismatch"):
        store.open("t", other)
    ix = store.open("t")
    for call in (lambda: put(ix, [1], ident=other), lambda: ix.search(Query(dense=vec(1)), other),
                 lambda: ix.delete(["d1"], other)):
        with pytest.raises(ConflictError) as e:
            call()
        assert e.value.code == "manifest_mismatch"
    with pytest.raises(ConflictError, match="dimension mismatch"):
        ix.upsert([Document("a", "x")], [vec(1, 8)], [terms(1)], IDENT)
    with pytest.raises(ConflictError, match="normalization mismatch"):
        ix.upsert([Document("a", "x")], [vec(1) * 2], [terms(1)], IDENT)
    with pytest.raises(ValidationError, match="NaN"):
        ix.upsert([Document("a", "x")], [np.full(DIM, np.nan, np.float32)], [terms(1)], IDENT)
    assert ix.counts()["documents"] == 0
    ix.close()


def test_versions_live_pointer_and_delete(store):
    store.create("t", IDENT).close()
    other = ModelIdentity(model="unit-2", fingerprint="v" * 64, dimension=8, normalize=True, pooling="cls",
                          query_prefix="", passage_prefix="", has_sparse=False)
    assert store.add_version("t", other) == "v2"
    assert store.current("t") == "v1" and store.versions("t") == ["v1", "v2"] and store.live("t")[0] == "v1"
    ix2 = store.open("t", other, version="v2")
    assert ix2.version == "v2" and ix2.manifest.sparse == "bm25" and ix2.manifest.dimension == 8
    with pytest.raises(ConflictError, match="already exists"):
        store.create("t", IDENT)
    store.delete("t")
    assert store.names() == []
    with pytest.raises(NotFoundError):
        store.current("t")
    with pytest.raises(NotFoundError):
        store.delete("t")


def test_a_second_store_sees_every_acknowledged_write_at_once(store, where):
    a = store.create("t", IDENT)
    b = open_store(*where).open("t", IDENT)          # another process, or another replica
    put(a, range(3))
    assert top(b, vec(1)) == ["d1"]
    put(a, range(3, 12))
    a.delete(["d1", "d5"], IDENT)
    hits = top(b, vec(1), k=20)
    assert "d1" not in hits and "d5" not in hits and len(hits) == 10
    assert b.counts() == {"documents": 10, "dense": 10, "sparse": 10}
    a.close()
    b.close()


def test_weighted_hybrid_is_flagembeddings_formula_on_lexical_weights(store):
    ix = store.create("t", IDENT)
    put(ix, range(12))
    q_d, q_s = vec(3), terms(3)
    hits = ix.search(Query(dense=q_d, sparse=q_s, mode="hybrid", fusion="weighted", top_k=5), IDENT)
    assert hits[0].id == "d3"
    for h in hits:
        i = int(h.id[1:])
        d = dict(zip(*[x.tolist() for x in terms(i)]))
        lexical = sum(w * d.get(t, 0.0) for t, w in zip(q_s[0].tolist(), q_s[1].tolist()))
        assert h.scores["sparse"] == pytest.approx(lexical, rel=1e-5, abs=1e-6)
        assert h.scores["dense"] == pytest.approx(float(vec(i) @ q_d), abs=1e-5)
        assert h.score == pytest.approx((0.4 * h.scores["dense"] + 0.2 * h.scores["sparse"]) / 0.6, abs=1e-5)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    rrf = ix.search(Query(dense=q_d, sparse=q_s, mode="hybrid", fusion="rrf", top_k=5), IDENT)
    assert rrf[0].id == "d3"
    ix.close()


def test_lexical_search_without_a_sparse_head(store):
    """No sparse head: BM25 over the tokenizer's term counts. A document holding more of the
    query's terms ranks higher, and one holding none is not a sparse hit."""
    ident = dataclasses.replace(IDENT, has_sparse=False, fingerprint="b" * 64)
    ix = store.create("t", ident)
    docs = {"both": ([5, 9], [2.0, 1.0]), "one": ([5, 11], [1.0, 1.0]), "none": ([1, 2], [1.0, 3.0])}
    ix.upsert([Document(k, f"text {k}") for k in docs], [vec(i) for i in range(3)],
              [(np.array(t, np.int64), np.array(w, np.float32)) for t, w in docs.values()], ident)
    q = (np.array([5, 9], np.int64), np.array([1.0, 1.0], np.float32))
    assert [h.id for h in ix.search(Query(sparse=q, mode="sparse", top_k=10), ident)] == ["both", "one"]
    hyb = ix.search(Query(dense=vec(2), sparse=q, mode="hybrid", top_k=3), ident)       # RRF by default
    assert {h.id for h in hyb} == {"both", "one", "none"}
    ix.close()


def test_vectors_past_2000_dimensions_and_an_hnsw_index(store):
    ident = dataclasses.replace(IDENT, dimension=2100, fingerprint="h" * 64)
    ix = store.create("big", ident, DenseConfig(kind="hnsw", hnsw_m=8, ef_construction=40, ef_search=40))
    seeds = range(60)
    ix.upsert([Document(f"d{s}", f"text {s}") for s in seeds], [vec(s, 2100) for s in seeds],
              [terms(s) for s in seeds], ident)
    for s in (0, 17, 59):
        hit = ix.search(Query(dense=vec(s, 2100), top_k=1), ident)[0]
        assert hit.id == f"d{s}" and hit.score == pytest.approx(1.0, abs=2e-3)     # halfvec on PostgreSQL
    report = verify_index(ix)
    assert report.ok, report.problems
    assert report.self_hits == report.sampled == 60 and report.recall_at_10 >= 0.95
    ix.close()


# ----------------------------------------------------------------- PostgreSQL only

@pytest.mark.postgres
def test_a_retired_version_refuses_writes_and_the_swap_is_one_transaction(pg_url):
    from migrations.pg_reindex import _move_live
    store = open_store(pg_url)
    v1 = store.create("t", IDENT)
    put(v1, range(3))
    other = dataclasses.replace(IDENT, fingerprint="w" * 64)
    store.add_version("t", other)
    v2 = store.open("t", other, version="v2")
    put(v2, range(3), ident=other)
    entry = {"kind": "reindex", "index": "t", "parent": "v1", "version": "v2", "status": "applied"}
    with pytest.raises(RuntimeError):                 # an error before the commit: nothing moved, nothing recorded
        with store.db.transaction() as cur:
            _move_live(store, cur, "t", "v1", v1.id, "v2", v2.id, entry)
            raise RuntimeError("killed before the commit")
    assert store.current("t") == "v1" and store.history("t") == []
    put(v1, [7])                                       # still the live one: takes writes
    with store.db.transaction() as cur:
        _move_live(store, cur, "t", "v1", v1.id, "v2", v2.id, entry)
    assert store.current("t") == "v2" and store.history("t") == [entry]
    with pytest.raises(RetiredError) as e:
        put(v1, [8])
    assert e.value.retry_after >= 1 and "replaced by v2" in e.value.message
    assert top(store.open("t"), vec(1), ident=other) == ["d1"]


@pytest.mark.postgres
def test_the_database_gone_is_retryable_and_coming_back_needs_nothing(pg_server, pg_url):
    store = open_store(pg_url)
    ix = store.create("t", IDENT)
    put(ix, range(5))
    pg_server.kill()
    t0 = time.monotonic()
    for call in (lambda: top(ix, vec(1)), lambda: put(ix, [9]), lambda: store.current("t")):
        with pytest.raises(BackendUnavailableError) as e:
            call()
        assert e.value.retry_after >= 1 and e.value.code == "index_backend_unavailable"
    assert time.monotonic() - t0 < 15                 # each refusal within the pool's wait, never a hang
    pg_server.start()
    t0 = time.monotonic()
    while True:
        try:
            assert top(ix, vec(1)) == ["d1"]
            break
        except BackendUnavailableError:
            assert time.monotonic() - t0 < 5, "not back within 5 s of the database's return"
            time.sleep(0.1)
    assert ix.counts()["documents"] == 5               # every acknowledged write survived the kill


@pytest.mark.postgres
def test_names_that_would_break_sql_are_refused_or_plain_names(pg_url):
    store = open_store(pg_url)
    for bad in ('x"; DROP TABLE t; --', "a b", "../x", ""):
        with pytest.raises(ValidationError):
            store.create(bad, IDENT)
    ix = store.create("bobby.tables-1", IDENT)
    put(ix, [1])
    assert store.names() == ["bobby.tables-1"] and top(ix, vec(1)) == ["d1"]
    # a metadata filter is parameters, never SQL
    assert ix.search(Query(dense=vec(1), filter={"s') OR TRUE --": 1}), IDENT) == []


def test_psycopg_is_not_imported_without_a_postgres_url(tmp_path):
    code = ("import sys; from index.backend import open_store; from embedserve.serve import build_app; "
            f"open_store(None, {str(tmp_path)!r}).create; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('psycopg', 'psycopg_pool', 'pgvector')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.postgres
def test_bm25_on_postgres_scores_what_the_local_postings_score(pg_url, tmp_path):
    """Without a sparse head both backends rank by the same Okapi BM25 (N, df and the average
    length kept exact through adds, replacements and deletes): same scores, same order."""
    ident = dataclasses.replace(IDENT, has_sparse=False, fingerprint="m" * 64)
    rng = np.random.default_rng(3)

    def counts(seed):
        r = np.random.default_rng(seed)
        ids = np.unique(r.integers(0, 30, r.integers(3, 12))).astype(np.int64)
        return ids, np.ceil(r.random(len(ids)) * 4).astype(np.float32)
    sides = [open_store(None, tmp_path / "ix").create("b", ident), open_store(pg_url).create("b", ident)]
    for ix in sides:
        ix.upsert([Document(f"d{i}", f"t{i}") for i in range(40)], [vec(i) for i in range(40)],
                  [counts(i) for i in range(40)], ident)
        ix.upsert([Document(f"d{i}", f"changed {i}") for i in range(5)], [vec(100 + i) for i in range(5)],
                  [counts(100 + i) for i in range(5)], ident)
        ix.delete([f"d{i}" for i in range(5, 12)], ident)
    for _ in range(5):
        q = (np.unique(rng.integers(0, 30, 4)).astype(np.int64), None)
        q = (q[0], np.ones(len(q[0]), np.float32))
        local, pg = ([(h.id, h.score) for h in ix.search(Query(sparse=q, mode="sparse", top_k=50), ident)]
                     for ix in sides)
        assert [i for i, _ in local] == [i for i, _ in pg] and local
        assert [s for _, s in pg] == pytest.approx([s for _, s in local], rel=1e-4)
        hyb = [[(h.id, h.score) for h in ix.search(Query(dense=vec(7), sparse=q, mode="hybrid", fusion="weighted",
                                                        top_k=10), ident)] for ix in sides]
        assert [i for i, _ in hyb[0]] == [i for i, _ in hyb[1]]


@pytest.mark.postgres
def test_a_read_only_database_serves_searches_and_refuses_writes_clearly(pg_url):
    """A server pointed at a read-only standby (imitated: the database's default transactions
    read-only) searches, and says where writes go instead of failing."""
    import psycopg
    ix = open_store(pg_url).create("t", IDENT)
    put(ix, range(4))
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE {pg_url.rsplit('/', 1)[1]} SET default_transaction_read_only = on")
    standby = open_store(pg_url)
    ro = standby.open("t", IDENT)
    assert top(ro, vec(2)) == ["d2"] and standby.names() == ["t"]
    with pytest.raises(BackendUnavailableError) as e:
        put(ro, [9])
    assert e.value.code == "index_read_only" and "primary" in e.value.message


@pytest.mark.postgres
def test_every_connection_busy_is_a_429_kind_not_an_outage(pg_url):
    from index.errors import BackendBusyError
    store = open_store(pg_url, pool_size=1)
    ix = store.create("t", IDENT)
    put(ix, range(3))
    with store.db.session():                          # the pool's one connection, held
        with pytest.raises(BackendBusyError) as e:
            top(ix, vec(1))
    assert e.value.code == "index_backend_busy" and "--index-pool-size" in e.value.message
    assert top(ix, vec(1)) == ["d1"]


def test_a_nul_character_is_a_clear_refusal_or_stored(store):
    """SQLite stores U+0000; PostgreSQL cannot (text and jsonb): a 400-kind error naming it, and
    nothing written. In a filter it matches nothing on either backend, never a 500."""
    ix = store.create("t", IDENT)
    docs = [Document("a", "before\x00after"), Document("b", "ok", {"k\x00": "v"}), Document("c", "ok", {"k": ["\x00"]})]
    for d in docs:
        if store.backend == "postgres":
            with pytest.raises(ValidationError, match="NUL"):
                ix.upsert([d], [vec(1)], [terms(1)], IDENT)
        else:
            ix.upsert([d], [vec(1)], [terms(1)], IDENT)
    assert ix.counts()["documents"] == (0 if store.backend == "postgres" else 3)
    put(ix, [5])
    with pytest.raises(ValidationError, match="NUL"):
        ix.search(Query(dense=vec(5), top_k=3, filter={"k\x00": "v"}), IDENT)
    if store.backend == "postgres":
        with pytest.raises(ValidationError, match="refused a value"):
            ix.search(Query(dense=vec(5), top_k=3, filter={"k": "v\x00"}), IDENT)
    else:
        assert ix.search(Query(dense=vec(5), top_k=3, filter={"k": "v\x00"}), IDENT) == []
