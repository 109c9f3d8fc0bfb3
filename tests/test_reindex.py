"""`embedserve reindex`: a real index of 150 Wikipedia summaries built with all-MiniLM-L6-v2 is
migrated to multilingual-e5-small — writes made meanwhile carried over, the gate, the atomic
swap, a retired old version refusing writes, rollback, the ledger — and the migration killed
with SIGKILL at 10 %, 50 % and 99 % resumes to the same result, embedding each document about once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from embedserve.embedders import ModelEmbedder
from index.docstore import Document
from index.embedder import DocumentVectors
from index.errors import ConflictError, DescribedError, RetiredError
from index.ops import search_text, upsert_documents
from index.store import IndexStore
from migrations import ledger
from migrations.errors import GateFailed, MigrationError
from migrations.lock import migration_lock
from migrations.ray_engine import RayEngine, shards
from migrations.reindex import CHECKPOINT, reindex, rollback, writes_since_swap

from helpers import build_wiki_index, copy_index, reindex_cli, wiki_docs

N_DOCS = 150


def _wiki_docs(n: int = N_DOCS) -> list[Document]:
    return wiki_docs(n)


@pytest.fixture(scope="module")
def built(tmp_path_factory, minilm_model):
    """A MiniLM index of the 150 documents (copied per test that changes it)."""
    root = tmp_path_factory.mktemp("src")
    store = IndexStore(root)
    emb = ModelEmbedder(minilm_model)
    with store.create("wiki", emb.identity) as ix:
        upsert_documents(ix, _wiki_docs(), emb)
    return root


_copy = copy_index


def _vectors(store: IndexStore) -> dict:
    """id -> (dense, sparse) of the live version."""
    with store.open("wiki") as ix:
        return {r[1]: (r[4], r[5]) for batch in ix.docs.iter_docs() for r in batch}


def _metadata(ix, doc_id: str) -> dict:
    return json.loads(ix.docs.hashes([doc_id])[doc_id][1])


@pytest.fixture(scope="module")
def in_process(built, tmp_path_factory, e5_model):
    """The vectors of an uninterrupted in-process reindex to e5 (the reference for the kill and
    Ray tests)."""
    ref = _copy(built, tmp_path_factory.mktemp("ref"))
    reindex(ref, "wiki", ModelEmbedder(e5_model), batch_docs=20, sample=50)
    return _vectors(ref)


def test_reindex_swap_rollback_and_ledger(built, tmp_path, minilm_model, e5_model):
    store = _copy(built, tmp_path)
    old, new = ModelEmbedder(minilm_model), ModelEmbedder(e5_model)
    live = store.open("wiki", old.identity)
    calls = []

    def write_meanwhile(n):                      # the live version keeps taking writes
        calls.append(n)
        if len(calls) == 1:
            first = _wiki_docs()[0]              # copied already: only its metadata changes now
            upsert_documents(live, [Document(first.id, first.text, {"n": 0, "edited": "during"})], old)
            upsert_documents(live, [Document("added-later", "The Danube flows through Vienna and Budapest.", {})], old)
            upsert_documents(live, [Document(_wiki_docs()[3].id, "A replaced text about glaciers in Norway.", {})], old)
            live.delete([_wiki_docs()[5].id])

    entry = reindex(store, "wiki", new, batch_docs=64, sample=50, old_embedder=old, on_batch=write_meanwhile)
    assert entry["swapped"] and store.current("wiki") == "v2" and entry["parent"] == "v1"
    assert entry["gate"]["ok"] and entry["gate"]["self_hit_rate"] >= 0.99 and entry["documents"] == N_DOCS
    assert entry["gate"]["top10_overlap"] is not None
    with pytest.raises(RetiredError):            # a writer still on the old version is turned away
        upsert_documents(live, [Document("too-late", "written after the swap", {})], old)
    live.close(snapshot=False)

    with store.open("wiki") as ix:
        assert ix.manifest.model == "multilingual-e5-small" and ix.counts()["documents"] == N_DOCS
        assert search_text(ix, new, "Which river flows through Vienna?", top_k=1)[0].id == "added-later"
        assert search_text(ix, new, "glaciers in Norway", top_k=1)[0].id == _wiki_docs()[3].id
        assert _wiki_docs()[5].id not in ix.docs.ids()
        assert _metadata(ix, _wiki_docs()[0].id) == {"n": 0, "edited": "during"}   # metadata too
        with pytest.raises(ConflictError):       # the old model can no longer search the live version
            search_text(ix, old, "anything")
        # writes on the new live version after the swap: a rollback must not lose them
        upsert_documents(ix, [Document("after-swap", "Lake Baikal in Siberia is the deepest lake on Earth.", {}),
                              Document(_wiki_docs()[1].id, _wiki_docs()[1].text, {"edited": "after"})], new)
        ix.delete([_wiki_docs()[2].id])
        n_live = ix.counts()["documents"]

    assert writes_since_swap(store, "wiki") == {"written": 2, "texts": 1, "deleted": 1, "model": "all-MiniLM-L6-v2",
                                                "sparse_model": None, "prompts": {"query": "", "passage": ""}}
    with pytest.raises(MigrationError, match="re-embeds them with 'all-MiniLM-L6-v2'") as exc:
        rollback(store, "wiki")                  # a new text needs the old model: refused, nothing moved
    assert exc.value.code == "rollback_needs_model" and store.current("wiki") == "v2"
    with store.open("wiki", version="v1") as v1, pytest.raises(RetiredError):
        upsert_documents(v1, [Document("stray", "a stray writer on the old version", {})], old)

    back = rollback(store, "wiki", old)
    assert store.current("wiki") == "v1" and back["kind"] == "rollback" and back["carried"] == 3
    with store.open("wiki") as ix:
        assert ix.manifest.model == "all-MiniLM-L6-v2" and ix.counts()["documents"] == n_live
        assert search_text(ix, old, "Which river flows through Vienna?", top_k=1)[0].id == "added-later"
        assert search_text(ix, old, "the deepest lake in Siberia", top_k=1)[0].id == "after-swap"
        assert _metadata(ix, _wiki_docs()[1].id) == {"edited": "after"}
        assert _wiki_docs()[2].id not in ix.docs.ids()
    with store.open("wiki", version="v2") as v2, pytest.raises(RetiredError):
        upsert_documents(v2, [Document("stray", "a stray writer on the rolled-back version", {})], new)
    kinds = [e["kind"] for e in ledger.history(store.index_dir("wiki"))]
    assert kinds == ["reindex", "rollback"]


class _Random:
    """An embedder that writes random unit vectors: what a broken model would produce."""

    def __init__(self, real):
        self.real, self.identity = real, real.identity
        self.rng = np.random.default_rng(0)

    def embed_documents(self, texts):
        v = self.rng.normal(size=(len(texts), self.identity.dimension)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        return DocumentVectors(list(v), self.real.lexical_terms(texts))

    def embed_query(self, text, mode):
        return self.real.embed_query(text, mode)


def test_gate_refuses_corrupt_vectors_and_the_live_version_keeps_serving(built, tmp_path, minilm_model, e5_model):
    store = _copy(built, tmp_path)
    with pytest.raises(GateFailed) as exc:
        reindex(store, "wiki", _Random(ModelEmbedder(e5_model)), batch_docs=128, sample=50)
    assert "self_hit" in exc.value.message and not exc.value.report.ok
    assert store.current("wiki") == "v1"
    with store.open("wiki") as ix:
        assert search_text(ix, ModelEmbedder(minilm_model), "glacier", top_k=3)
    assert ledger.history(store.index_dir("wiki")) == []


def test_a_second_migration_of_the_same_index_is_refused(built, tmp_path, e5_model):
    store = _copy(built, tmp_path)
    with migration_lock(store.index_dir("wiki"), "wiki"):
        with pytest.raises(MigrationError, match=r"already running \(pid \d+ since"):
            reindex(store, "wiki", ModelEmbedder(e5_model))


_run_cli = reindex_cli


def test_killed_at_10_50_99_percent_resumes_to_the_same_result(built, tmp_path, in_process):
    store = _copy(built, tmp_path)
    with store.open("wiki") as ix:
        top_label = int(ix.docs.live_labels().max())
    kills = 0
    for frac in (0.10, 0.50, 0.99):
        proc = _run_cli(store.root)
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            ck = store.root / "wiki" / "v2" / CHECKPOINT
            try:
                if json.loads(ck.read_text())["copied_upto"] >= frac * top_label:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        assert proc.poll() is None, proc.stdout.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        assert store.current("wiki") == "v1"
    proc = _run_cli(store.root)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert store.current("wiki") == "v2"

    va = _vectors(store)
    assert va.keys() == in_process.keys() and len(va) == N_DOCS
    assert max(float(np.abs(va[k][0] - in_process[k][0]).max()) for k in va) <= 1e-6
    with store.open("wiki") as a:
        writes = a.docs.seq()                    # one write (one embedding) per document written
    assert N_DOCS <= writes <= N_DOCS + 20 * kills, writes


def test_ray_engine_equals_the_in_process_reindex(built, tmp_path, in_process):
    """`--engine ray` on a local Ray (2 CPUs, 2 actors): Ray Data reads the shards, the actor pool
    embeds, the results come back in write order; same ids and vectors as in process."""
    pytest.importorskip("ray.data", reason="the ray extra: pip install 'embedserve[ray]' (CI installs it)")
    store = _copy(built, tmp_path)
    proc = _run_cli(store.root, "--engine", "ray", "--batch-docs", "128")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    entry = json.loads(out[out.rindex("\n{") + 1:])
    assert entry["engine"] == "ray" and entry["embedded"] == N_DOCS and entry["gate"]["ok"], entry
    assert store.current("wiki") == "v2"
    got = _vectors(store)
    assert got.keys() == in_process.keys() and len(got) == N_DOCS
    assert max(float(np.abs(got[k][0] - in_process[k][0]).max()) for k in got) <= 1e-5
    assert all(np.array_equal(got[k][1][0], in_process[k][1][0]) and np.allclose(got[k][1][1], in_process[k][1][1])
               for k in got)                     # the lexical terms, too


def test_shards_cover_the_labels_in_order():
    labels = np.array([3, 4, 9, 10, 11, 20, 21], dtype=np.int64)
    assert shards(labels, 2, 3) == [(2, 9), (9, 20), (20, 21)]
    assert shards(labels[:0], 5, 3) == []


def test_ray_missing_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)          # as if the extra were not installed
    with pytest.raises(MigrationError, match=r"pip install 'embedserve\[ray\]'"):
        RayEngine(lambda: None, ())


@pytest.mark.server
def test_swap_under_load_every_answer_from_one_model_version_pair(tmp_path, e5_model):
    """A server serving both models answers searches from 4 clients through the migration: all
    200, each from (old model, old version) or (new model, new version), the new pair at the end."""
    import threading

    import httpx

    from embedserve.client import Client
    from helpers import spawn_server

    root = tmp_path / "ix"
    srv = spawn_server("--model", "all-MiniLM-L6-v2", "--model", "multilingual-e5-small", "--dtype", "float32",
                       "--generate-model", "none", "--index-dir", str(root), "--log-level", "warning", timeout=120)
    base = srv.base
    try:
        with Client(base) as c:
            assert [m["id"] for m in c.models()["data"]] == ["all-MiniLM-L6-v2", "multilingual-e5-small"]
            c.index("live").create(model="all-MiniLM-L6-v2")
            docs = _wiki_docs(100)
            c.ingest("live", [{"id": d.id, "text": d.text} for d in docs])
        seen, stop = [], threading.Event()

        def search(k):
            with httpx.Client(base_url=base, timeout=60) as h:
                while not stop.is_set():
                    r = h.post("/v1/search", json={"index": "live", "query": docs[k * 7].text[:80], "top_k": 3})
                    seen.append((r.status_code, r.json().get("model"), r.json().get("version")))
                    time.sleep(0.05)         # steady load that leaves the in-process reindex some CPU
        threads = [threading.Thread(target=search, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        entry = reindex(IndexStore(root), "live", ModelEmbedder(e5_model), batch_docs=40, sample=50)
        after = len(seen)
        time.sleep(1.5)
        stop.set()
        for t in threads:
            t.join(60)
        assert entry["swapped"]
        assert {s for s, _, _ in seen} == {200}, [x for x in seen if x[0] != 200][:3]
        pairs = {(m, v) for _, m, v in seen}
        assert pairs == {("all-MiniLM-L6-v2", "v1"), ("multilingual-e5-small", "v2")}, pairs
        tail = [(m, v) for _, m, v in seen[after + 8:]]      # requests in flight at the swap finish first
        assert tail and set(tail) == {("multilingual-e5-small", "v2")}, [(i, x) for i, x in enumerate(seen[after:]) if x[1] != "multilingual-e5-small"][:10]
        reload = httpx.post(base + "/v1/indexes/live/reload").json()
        assert reload["version"] == "v2" and reload["model"] == "multilingual-e5-small"
        # nothing written since the swap: the rollback is a move of CURRENT, and the server answers
        # from the old pair again
        t0 = time.perf_counter()
        back = rollback(IndexStore(root), "live")
        assert time.perf_counter() - t0 < 1.0 and back["carried"] == 0
        r = httpx.post(base + "/v1/search", json={"index": "live", "query": docs[0].text[:80], "top_k": 3}).json()
        assert (r["model"], r["version"]) == ("all-MiniLM-L6-v2", "v1") and r["data"][0]["id"] == docs[0].id
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def small(tmp_path_factory, minilm_model):
    """A MiniLM index of 40 of the documents, for the checks that need no full corpus."""
    return build_wiki_index(tmp_path_factory.mktemp("small"), minilm_model, 40)


class _Zero(_Random):
    """An embedder whose dense vectors are all zeros (a model whose pooling lost everything)."""

    def embed_documents(self, texts):
        out = super().embed_documents(texts)
        return DocumentVectors([np.zeros_like(v) for v in out.dense], out.sparse)


def test_zero_vectors_are_refused_and_the_live_version_keeps_serving(small, tmp_path, minilm_model, e5_model):
    store = _copy(small, tmp_path)
    with pytest.raises(DescribedError, match="norm 0.000000|all zeros"):
        reindex(store, "wiki", _Zero(ModelEmbedder(e5_model)), batch_docs=16, sample=40)
    assert store.current("wiki") == "v1" and ledger.history(store.index_dir("wiki")) == []
    with store.open("wiki") as ix:
        assert search_text(ix, ModelEmbedder(minilm_model), "glacier", top_k=3)


def test_the_gate_counts_nan_and_zero_vectors_a_version_holds(small, tmp_path, e5_model):
    """Vectors damaged on disk after they were written (the write path refuses both): the gate
    reads every stored vector, names what is wrong and how many, and nothing is swapped."""
    import sqlite3

    store = _copy(small, tmp_path)
    e5 = ModelEmbedder(e5_model)
    dry = reindex(store, "wiki", e5, batch_docs=16, sample=40, dry_run=True)
    assert dry["gate"]["ok"] and not dry["swapped"] and store.current("wiki") == "v1"
    db = sqlite3.connect(store.version_dir("wiki", "v2") / "docs.sqlite")
    ids = [r[0] for r in db.execute("SELECT id FROM docs ORDER BY id LIMIT 3")]
    dim = e5.identity.dimension
    db.execute("UPDATE docs SET dense = ? WHERE id = ?", (np.zeros(dim, "<f4").tobytes(), ids[0]))
    db.execute("UPDATE docs SET dense = ? WHERE id = ?", (np.full(dim, np.nan, "<f4").tobytes(), ids[1]))
    db.execute("UPDATE docs SET dense = ? WHERE id = ?", (np.ones(dim - 1, "<f4").tobytes(), ids[2]))
    db.commit()
    db.close()
    with pytest.raises(GateFailed) as exc:       # the rerun resumes the unfinished v2 and gates it again
        reindex(store, "wiki", e5, batch_docs=16, sample=40)
    detail = exc.value.report.checks["vectors"]
    assert not detail["ok"] and detail["detail"] == "bad vectors: nan 1, zero 1, dimension 1", detail
    assert "v1 stays live" in exc.value.message
    assert store.current("wiki") == "v1" and ledger.history(store.index_dir("wiki")) == []


def test_cli_errors_name_what_to_change(small, tmp_path):
    """An index that does not exist, an unknown model and a missing --to-model each end the
    command with one line that says what is wrong (no traceback), before any model loads."""
    root = _copy(small, tmp_path).root

    def run(*args):
        p = subprocess.run([sys.executable, "-m", "embedserve.cli", "reindex", "--index-dir", str(root), *args],
                           capture_output=True, text=True, timeout=120)
        return p.returncode, p.stderr
    rc, err = run("--index", "nope", "--to-model", "multilingual-e5-small")
    assert rc != 0 and "nope" in err and "Traceback" not in err, err
    rc, err = run("--index", "wiki", "--to-model", "no-such-model")
    assert rc != 0 and "no-such-model" in err and "Traceback" not in err, err
    rc, err = run("--index", "wiki")
    assert rc == 2 and "--to-model or --prompt is required" in err, err
    rc, err = run("--index", "wiki", "--rollback")
    assert rc != 0 and "Traceback" not in err and "roll" in err.lower(), err
    assert IndexStore(root).current("wiki") == "v1"


def test_the_gates_batched_queries_equal_one_query_at_a_time(e5_model):
    """The overlap check embeds its sample queries in token-budget batches (`embed_queries`):
    the vectors equal `embed_query`'s one at a time (query prompt, truncation past the limit)."""
    emb = ModelEmbedder(e5_model)
    texts = ["Which river flows through Vienna?", "长江流经上海。", _wiki_docs(3)[2].text, "word " * 900]
    batched = emb.embed_queries(texts)
    assert len(batched) == len(texts)
    for text, v in zip(texts, batched):
        one = emb.embed_query(text, "dense")[0]
        assert v.shape == one.shape == (384,) and float(np.abs(v - one).max()) <= 1e-5
