"""An index that pairs two models: dense vectors from all-MiniLM-L6-v2, the sparse side from
splade-tiny (SPLADE), through the server. The manifest names both (model and fingerprint each)
and guards both on every write and search; the sparse postings hold SPLADE's weights; hybrid
search fuses the two by rank. On the Wikipedia summaries of the retrieval tests (250 held-out
sentences as queries), recall@10 of dense alone, SPLADE alone and hybrid is measured through
the HTTP API and printed.

Measured (fp32): dense MiniLM 0.968, SPLADE (splade-tiny) 0.924, hybrid (RRF) 0.944; BM25 over
MiniLM's word pieces, the sparse side without SPLADE, 0.828. So SPLADE is a far better sparse
side than BM25 (+0.096), but hybrid is *not* >= dense here, and the test says so instead of
asserting it: MiniLM is near the ceiling on these queries (8 misses of 250) and splade-tiny, a
2-layer 128-wide model, is weaker on every query set tried (keyword queries made from the
same sentences: dense 0.780, SPLADE 0.652, hybrid 0.772), so fusion trades dense hits for
few rescues. No weighting tried beat dense (weighted sums with the sparse side scaled by its
best score: 0.936-0.960; min-max scaled: 0.956-0.964). The test asserts what holds: SPLADE
beats BM25 by a margin, and hybrid beats the sparse side and stays within 0.03 of dense."""

import dataclasses

import numpy as np
import pytest
from fastapi.testclient import TestClient

from helpers import wiki_corpus

from embedserve.config import ServerConfig
from embedserve.models.cross_encoder import load_model
from embedserve.models.registry import resolve_model
from embedserve.serve import build_app
from index.errors import ConflictError
from index.store import IndexStore


@pytest.fixture(scope="module")
def client(minilm_model, tmp_path_factory):
    name, path = resolve_model("splade-tiny")
    splade = load_model(path, name=name, dtype="float32")
    cfg = ServerConfig.of(model="all-MiniLM-L6-v2", generate_model="none", max_client_batch_size=256,
                          index_dir=str(tmp_path_factory.mktemp("pair")))
    app = build_app(cfg, model=[minilm_model, splade])
    with TestClient(app) as c:
        yield c, splade


@pytest.fixture(scope="module")
def corpus(client):
    c, _ = client
    docs = wiki_corpus(250)
    assert c.post("/v1/indexes", json={"name": "pair", "model": "all-MiniLM-L6-v2",
                                       "sparse_model": "splade-tiny"}).status_code == 201
    body = [{"id": title, "text": text} for title, text, _ in docs]
    for i in range(0, len(body), 125):
        r = c.post("/v1/indexes/pair/documents", json={"documents": body[i:i + 125]})
        assert r.status_code == 200, r.text
    return docs


def _recall(c, docs, mode: str, k: int = 10) -> float:
    hits = 0
    for title, _, query in docs:
        r = c.post("/v1/search", json={"index": "pair", "query": query, "top_k": k, "mode": mode}).json()
        hits += title in [h["id"] for h in r["data"]]
    return hits / len(docs)


def test_manifest_names_and_guards_both_models(client, corpus, minilm_model):
    c, splade = client
    info = c.get("/v1/indexes/pair").json()
    assert info["compatible"] and info["counts"]["sparse"] == len(corpus)
    m = IndexStore(c.app.state.embedserve.indexes.root).manifest("pair")
    assert (m.model, m.sparse_model, m.sparse) == ("all-MiniLM-L6-v2", "splade-tiny", "lexical_weights")
    assert m.fingerprint == minilm_model.spec.fingerprint and m.sparse_fingerprint == splade.spec.fingerprint
    # vectors of another sparse model, or none paired, are refused field by field
    for field, value in (("sparse_model", None), ("sparse_fingerprint", "0" * 64)):
        with pytest.raises(ConflictError, match=f"{field} mismatch"):
            m.check(dataclasses.replace(m.identity, **{field: value}), "write")
    hit = c.post("/v1/search", json={"index": "pair", "query": corpus[0][2], "mode": "hybrid"}).json()
    assert hit["model"] == "all-MiniLM-L6-v2" and hit["sparse_model"] == "splade-tiny"
    # the sparse score is SPLADE's dot product (query weights · document weights), not BM25
    q, _ = splade.embed(splade.tokenize([corpus[0][2]]), {"sparse"})
    top = hit["data"][0]
    doc = next(d for d in corpus if d[0] == top["id"])
    dv, _ = splade.embed([splade.truncate(splade.tokenize([doc[1]])[0])], {"sparse"})
    _, qi, di = np.intersect1d(q[0].sparse[0], dv[0].sparse[0], return_indices=True)
    assert top["scores"]["sparse"] == pytest.approx(float(q[0].sparse[1][qi] @ dv[0].sparse[1][di]), rel=1e-4)


def test_a_server_without_the_sparse_model_refuses_the_pair(client, corpus, minilm_model, tmp_path):
    c, _ = client
    root = c.app.state.embedserve.indexes.root
    app = build_app(ServerConfig.of(model="all-MiniLM-L6-v2", generate_model="none", index_dir=str(root)),
                    model=minilm_model)
    with TestClient(app) as other:
        r = other.post("/v1/search", json={"index": "pair", "query": "x"})
        assert r.status_code == 409 and "splade-tiny" in r.json()["error"]["message"]


def test_recall_dense_splade_and_hybrid_through_the_server(client, corpus):
    c, _ = client
    dense, sparse, hybrid = (_recall(c, corpus, mode) for mode in ("dense", "sparse", "hybrid"))
    # the same documents with BM25 as the sparse side (MiniLM alone)
    assert c.post("/v1/indexes", json={"name": "bm25", "model": "all-MiniLM-L6-v2"}).status_code == 201
    body = [{"id": title, "text": text} for title, text, _ in corpus]
    for i in range(0, len(body), 125):
        assert c.post("/v1/indexes/bm25/documents", json={"documents": body[i:i + 125]}).status_code == 200
    bm25 = sum(t in [h["id"] for h in c.post("/v1/search", json={"index": "bm25", "query": q, "top_k": 10,
                                                                  "mode": "sparse"}).json()["data"]]
               for t, _, q in corpus) / len(corpus)
    print(f"\nrecall@10 on {len(corpus)} held-out sentences: dense (MiniLM) {dense:.3f}, "
          f"SPLADE (splade-tiny) {sparse:.3f}, hybrid (RRF) {hybrid:.3f}; BM25 {bm25:.3f}")
    assert sparse >= bm25 + 0.05, (sparse, bm25)             # a trained sparse encoder beats BM25
    assert hybrid > sparse and hybrid >= dense - 0.03, (dense, sparse, hybrid)


def test_bad_pairs_are_400(client):
    c, _ = client
    r = c.post("/v1/indexes", json={"name": "p2", "model": "all-MiniLM-L6-v2", "sparse_model": "all-MiniLM-L6-v2"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sparse_model"
    r = c.post("/v1/indexes", json={"name": "p3", "model": "splade-tiny"})
    assert r.status_code == 400 and "sparse vectors only" in r.json()["error"]["message"]
    r = c.post("/v1/indexes", json={"name": "p4", "sparse_model": "nope"})
    assert r.status_code == 404


def test_cli_pair_index_and_a_reindex_that_keeps_the_sparse_model(tmp_path, capsys):
    """`index create --sparse-model`, `index add`, `index search --mode hybrid`, then `reindex
    --to-model` to another dense model: the new version keeps the pairing (same SPLADE model)."""
    import json

    from embedserve.cli import main
    root = str(tmp_path / "ix")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"id": t, "text": x}) for t, x, _ in wiki_corpus(40)) + "\n")
    flags = ["--index-dir", root]
    assert main(["index", "create", "kb", "--model", "all-MiniLM-L6-v2", "--sparse-model", "splade-tiny",
                 "--dtype", "float32", *flags]) == 0
    assert main(["index", "add", "kb", str(docs), "--dtype", "float32", *flags]) == 0
    title, _, query = wiki_corpus(40)[3]
    capsys.readouterr()
    assert main(["index", "search", "kb", query, "--mode", "hybrid", "--json", "--dtype", "float32", *flags]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert title in [h["id"] for h in hits]
    assert main(["reindex", "--index", "kb", "--to-model", "multilingual-e5-small", "--dtype", "float32",
                 "--sample", "20", *flags]) == 0
    m = IndexStore(root).manifest("kb")
    assert (m.model, m.sparse_model, m.counts["sparse"]) == ("multilingual-e5-small", "splade-tiny", 40)
    assert main(["index", "create", "bad", "--model", "splade-tiny", *flags]) == 1
    assert "sparse vectors only" in capsys.readouterr().err


def test_pair_index_and_prompts_on_postgres(client, corpus, minilm_model, pg_url):
    """The same pair index in PostgreSQL + pgvector answers as the local one (SPLADE's weights as
    a sparsevec), and its manifest row records the pair and the prompts."""
    c, splade = client
    cfg = ServerConfig.of(model="all-MiniLM-L6-v2", generate_model="none", index_url=pg_url)
    with TestClient(build_app(cfg, model=[minilm_model, splade])) as pg:
        assert pg.post("/v1/indexes", json={"name": "pair", "model": "all-MiniLM-L6-v2",
                                            "sparse_model": "splade-tiny"}).status_code == 201
        body = [{"id": title, "text": text} for title, text, _ in corpus[:60]]
        assert pg.post("/v1/indexes/pair/documents", json={"documents": body}).status_code == 200
        m = pg.app.state.embedserve.indexes.store.manifest("pair")
        assert (m.sparse_model, m.sparse_fingerprint) == ("splade-tiny", splade.spec.fingerprint)
        assert m.prompts == {"query": "", "passage": ""}
        for title, _, query in corpus[:5]:
            got = pg.post("/v1/search", json={"index": "pair", "query": query, "mode": "sparse", "top_k": 3}).json()
            assert got["sparse_model"] == "splade-tiny" and got["data"], got
            top = got["data"][0]
            q, _ = splade.embed(splade.tokenize([query]), {"sparse"})
            doc = next(b["text"] for b in body if b["id"] == top["id"])
            dv, _ = splade.embed([splade.truncate(splade.tokenize([doc])[0])], {"sparse"})
            _, qi, di = np.intersect1d(q[0].sparse[0], dv[0].sparse[0], return_indices=True)
            assert top["score"] == pytest.approx(float(q[0].sparse[1][qi] @ dv[0].sparse[1][di]), rel=1e-4)
