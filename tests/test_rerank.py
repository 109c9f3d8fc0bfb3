"""Reranking over HTTP, in process (TestClient, lifespan included), on tiny fixtures: every
request shape (Jina/Cohere v1, TEI, Cohere v2, vLLM's score), top_n / return_documents /
raw_scores, documents cut and counted, a long query refused, 1,000 documents spread over
batches and returned in order, BGE-M3 reranking equal to FlagEmbedding, rerank inside
/v1/search, overload as 429, and every user mistake a 4xx naming what to change."""

import json
import shutil
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from helpers import BERT_3LABEL_DIR, BERT_RERANKER_DIR, BGE_M3_DIR, XLMR_RERANKER_DIR

from embedserve.config import ServerConfig
from embedserve.engine.compute import COMPUTE_LOCK
from embedserve.models.cross_encoder import CrossEncoderModel
from embedserve.models.embedding_model import EmbeddingModel
from embedserve.serve import build_app

QUERY = "what is the capital of France"
DOCS = ["Paris is the capital and largest city of France.", "北京是中华人民共和国的首都。",
        "The quick brown fox jumps over the lazy dog.", "La tour Eiffel est à Paris.", "x"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    dense_only = tmp_path_factory.mktemp("dense") / "tiny-dense"
    shutil.copytree(BGE_M3_DIR, dense_only, ignore=shutil.ignore_patterns("*.pt", "*.json.ref"))
    return {"bert": CrossEncoderModel(BERT_RERANKER_DIR, name="tiny-bert-reranker", dtype="float32"),
            "xlmr": CrossEncoderModel(XLMR_RERANKER_DIR, name="tiny-xlmr-reranker", dtype="float32"),
            "m3": EmbeddingModel(BGE_M3_DIR, name="tiny-bge-m3", dtype="float32"),
            "dense": EmbeddingModel(dense_only, name="tiny-dense", dtype="float32"),
            "nli": CrossEncoderModel(BERT_3LABEL_DIR, name="tiny-nli", dtype="float32")}


@pytest.fixture(scope="module")
def client(models, tmp_path_factory):
    cfg = ServerConfig.of(model="tiny-bert-reranker", generate_model="none", max_batch_tokens=256,
                          max_client_batch_size=1200, index_dir=str(tmp_path_factory.mktemp("ix")))
    app = build_app(cfg, model=[models[k] for k in ("dense", "bert", "xlmr", "m3", "nli")])
    with TestClient(app) as c:
        yield c


def _err(resp, status, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_v1_rerank_jina_cohere_shape_sorted_with_top_n_and_documents(client, models):
    ref = models["bert"].score_pairs(QUERY, DOCS, raw=False)
    body = client.post("/v1/rerank", json={"model": "tiny-bert-reranker", "query": QUERY, "documents": DOCS,
                                            "top_n": 3, "return_documents": True}).json()
    assert set(body) == {"id", "model", "results", "usage", "meta"} and body["model"] == "tiny-bert-reranker"
    order = sorted(range(len(DOCS)), key=lambda i: -ref[i])[:3]
    assert [r["index"] for r in body["results"]] == order
    for r in body["results"]:
        assert r["document"] == {"text": DOCS[r["index"]]}
        assert r["relevance_score"] == pytest.approx(ref[r["index"]], abs=1e-6)
        assert 0 < r["relevance_score"] < 1                      # the sigmoid of the logit
    pairs = models["bert"].pairs(QUERY, DOCS)
    assert body["usage"] == {"prompt_tokens": pairs.num_tokens, "total_tokens": pairs.num_tokens}
    plain = client.post("/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS]}).json()
    assert len(plain["results"]) == len(DOCS) and all("document" not in r for r in plain["results"])
    assert [r["index"] for r in plain["results"]][:3] == order    # default reranker: the first served


def test_raw_scores_are_the_logits(client, models):
    raw = models["bert"].score_pairs(QUERY, DOCS, raw=True)
    body = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "raw_scores": True}).json()
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], raw, atol=1e-6)


def test_tei_shape_on_rerank(client, models):
    ref = models["xlmr"].score_pairs(QUERY, DOCS, raw=True)
    r = client.post("/rerank", json={"model": "tiny-xlmr-reranker", "query": QUERY, "texts": DOCS,
                                     "raw_scores": True, "return_text": True})
    assert r.status_code == 200
    body = r.json()
    assert isinstance(body, list) and [x["index"] for x in body] == sorted(range(len(DOCS)), key=lambda i: -ref[i])
    for x in body:
        assert set(x) == {"index", "score", "text"} and x["text"] == DOCS[x["index"]]
        assert x["score"] == pytest.approx(ref[x["index"]], abs=1e-6)
    # TEI refuses an over-long text unless truncate=true
    long = ["word " * 300]
    _err(client.post("/rerank", json={"query": QUERY, "texts": long}), 400, "texts")
    assert client.post("/rerank", json={"query": QUERY, "texts": long, "truncate": True}).status_code == 200


def test_v2_rerank_cohere_shape_and_max_tokens_per_doc(client, models):
    model = models["bert"]
    body = client.post("/v2/rerank", json={"model": "tiny-bert-reranker", "query": QUERY, "documents": DOCS,
                                            "max_tokens_per_doc": 3}).json()
    cut = model.pairs(QUERY, DOCS, max_doc_tokens=3)
    outs, _ = model.embed(cut.inputs, {"score"}, cut.segments)
    want = [model.relevance(o.score) for o in outs]
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, atol=1e-6)
    assert body["usage"]["truncated_documents"] == cut.truncated and body["usage"]["truncated_tokens"] == cut.cut_tokens
    assert body["meta"]["api_version"]["version"] == "2"


def test_score_vllm_shape_one_to_many_and_pairwise(client, models):
    ref = models["bert"].score_pairs(QUERY, DOCS)
    one = client.post("/v1/score", json={"model": "tiny-bert-reranker", "text_1": QUERY, "text_2": DOCS}).json()
    assert one["object"] == "list" and [d["index"] for d in one["data"]] == list(range(len(DOCS)))
    np.testing.assert_allclose([d["score"] for d in one["data"]], 1 / (1 + np.exp(-ref)), atol=1e-6)
    queries = [QUERY, "Beijing", QUERY]
    pw = client.post("/score", json={"text_1": queries, "text_2": DOCS[:3]}).json()
    want = [models["bert"].score_pairs(q, [d], raw=False)[0] for q, d in zip(queries, DOCS[:3])]
    np.testing.assert_allclose([d["score"] for d in pw["data"]], want, atol=1e-6)
    _err(client.post("/v1/score", json={"text_1": ["a", "b"], "text_2": DOCS}), 400, "text_1")


def test_long_document_cut_and_counted_long_query_refused(client, models):
    model = models["bert"]
    long_doc = "Paris " * 400
    body = client.post("/v1/rerank", json={"query": QUERY, "documents": ["short", long_doc]}).json()
    p = model.pairs(QUERY, ["short", long_doc])
    assert body["usage"]["truncated_documents"] == [1] and body["usage"]["truncated_tokens"] == p.cut_tokens > 0
    assert body["usage"]["total_tokens"] == p.num_tokens
    err = _err(client.post("/v1/rerank", json={"query": "capital " * 200, "documents": DOCS}), 400, "query")
    assert err["code"] == "context_length_exceeded" and "tokens" in err["message"]


def test_a_thousand_documents_spread_over_batches_in_order(client, models):
    docs = [f"document number {i} about {'Paris' if i % 7 == 0 else 'dogs'} " * (1 + i % 5) for i in range(1000)]
    before = _metric(client, "embedserve_embed_batch_size_inputs_count")
    pairs_before = _metric(client, "embedserve_rerank_pairs_total")
    body = client.post("/v1/rerank", json={"query": QUERY, "documents": docs, "raw_scores": True}).json()
    assert len(body["results"]) == 1000
    batches = _metric(client, "embedserve_embed_batch_size_inputs_count") - before
    assert batches >= 10                                       # 256-token batches: the pairs spread
    assert _metric(client, "embedserve_rerank_pairs_total") - pairs_before == 1000
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    ref = models["bert"].score_pairs(QUERY, docs, raw=True)
    np.testing.assert_allclose([got[i] for i in range(1000)], ref, atol=1e-5)
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)


def _metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_bgem3_reranks_with_its_own_vectors_equal_to_flagembedding(client):
    """The default-length run of FlagEmbedding's compute_score, through /v1/rerank."""
    ref = json.loads((BGE_M3_DIR / "flagembedding_compute_score.json").read_text())
    texts = ref["texts"]
    for run in ref["runs"]:
        if run["lengths_passed"]:
            continue
        weights = run["weights_for_different_modes"]
        for method in ("colbert", "dense", "sparse", "sparse+dense", "colbert+sparse+dense"):
            for k, (q, p) in enumerate(ref["pair_indices"]):
                if p != ref["pair_indices"][0][1]:
                    continue
                body = {"model": "tiny-bge-m3", "query": texts[q], "documents": [texts[p]], "scoring": method}
                if weights:
                    body["weights"] = weights
                got = client.post("/v1/rerank", json=body).json()["results"][0]["relevance_score"]
                assert got == pytest.approx(run["scores"][method][k], abs=1e-5), (method, k)


def test_wrong_model_for_the_task_names_the_ones_that_can(client):
    err = _err(client.post("/v1/rerank", json={"model": "tiny-dense", "query": QUERY, "documents": DOCS}), 400, "model")
    assert "cannot rerank" in err["message"] and "'tiny-bert-reranker'" in err["message"] and "'tiny-bge-m3'" in err["message"]
    err = _err(client.post("/v1/embeddings", json={"model": "tiny-bert-reranker", "input": "hi"}), 400, "model")
    assert "reranker" in err["message"] and "'tiny-dense'" in err["message"]
    assert client.post("/v1/embeddings", json={"input": "hi"}).json()["model"] == "tiny-dense"
    _err(client.post("/v1/rerank", json={"model": "nope", "query": QUERY, "documents": DOCS}), 404, "model")
    err = _err(client.post("/v1/rerank", json={"model": "tiny-nli", "query": QUERY, "documents": DOCS}), 400, "model")
    assert "relevant_label" in err["message"]
    _err(client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "scoring": "colbert"}), 400, "scoring")
    _err(client.post("/v1/rerank", json={"model": "tiny-bge-m3", "query": QUERY, "documents": DOCS,
                                         "weights": [1, -1, 1]}), 400, "weights")


@pytest.mark.parametrize("body, param", [
    ({"query": QUERY}, "documents"),
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": "one string"}, "documents"),
    ({"query": QUERY, "documents": [1, 2]}, "documents"),
    ({"query": QUERY, "documents": [{"title": "no text"}]}, "documents"),
    ({"query": QUERY, "documents": [{"text": 5}]}, "documents"),
    ({"query": "   ", "documents": DOCS}, "query"),
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "top_n": "3"}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "max_tokens_per_doc": 0}, "max_tokens_per_doc"),
    ({"query": QUERY, "documents": DOCS, "max_chunks_per_doc": 2}, "max_chunks_per_doc"),
    ({"query": QUERY, "documents": DOCS, "return_documents": "yes"}, "return_documents"),
    ({"query": QUERY, "documents": DOCS, "unknown": 1}, "unknown"),
    ({"query": QUERY, "documents": ["d"] * 1201}, "documents"),
])
def test_bad_rerank_requests_are_400_naming_the_field(client, body, param):
    err = _err(client.post("/v1/rerank", json=body), 400)
    assert param in (err["param"] or "") or param in err["message"], err


def test_rank_fields_and_surrogates(client, models):
    docs = [{"title": "Paris", "body": "capital of France", "id": 7}]
    body = client.post("/v1/rerank", json={"query": QUERY, "documents": docs, "rank_fields": ["title", "body"],
                                            "return_documents": True}).json()
    assert body["results"][0]["document"] == docs[0]
    want = models["bert"].score_pairs(QUERY, ["title: Paris\nbody: capital of France"], raw=False)[0]
    assert body["results"][0]["relevance_score"] == pytest.approx(want, abs=1e-6)
    raw = b'{"query": "q", "documents": ["bad \\ud800 text"]}'
    _err(client.post("/v1/rerank", content=raw, headers={"content-type": "application/json"}), 400, "documents")
    raw = b'{"query": "\\udfff", "texts": ["fine"]}'
    _err(client.post("/rerank", content=raw, headers={"content-type": "application/json"}), 400, "query")


def test_models_list_each_task(client):
    rows = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert rows["tiny-bert-reranker"]["task"] == "rerank" and rows["tiny-bert-reranker"]["rerank"] == ["cross-encoder"]
    assert "dimensions" not in rows["tiny-bert-reranker"] and rows["tiny-bert-reranker"]["limits"]["max_input_length"] == 64
    assert rows["tiny-dense"]["task"] == "embed" and "rerank" not in rows["tiny-dense"]
    assert rows["tiny-bge-m3"]["rerank"] == ["colbert", "dense", "sparse", "sparse+dense", "colbert+sparse+dense"]


def test_rerank_inside_search(client, models):
    assert client.post("/v1/indexes", json={"name": "rr", "model": "tiny-dense"}).status_code == 201
    docs = [{"id": f"d{i}", "text": t} for i, t in enumerate(DOCS)]
    assert client.post("/v1/indexes/rr/documents", json={"documents": docs}).status_code == 200
    plain = client.post("/v1/search", json={"index": "rr", "query": QUERY, "top_k": 5}).json()
    body = client.post("/v1/search", json={"index": "rr", "query": QUERY, "top_k": 2,
                                           "rerank": {"model": "tiny-bert-reranker", "candidates": 5}}).json()
    assert body["rerank_model"] == "tiny-bert-reranker" and body["model"] == "tiny-dense"
    ref = dict(zip([d["id"] for d in docs], models["bert"].score_pairs(QUERY, DOCS, raw=False)))
    best = sorted(ref, key=lambda k: -ref[k])[:2]
    assert [h["id"] for h in body["data"]] == best
    retrieval = {h["id"]: h["score"] for h in plain["data"]}
    for h in body["data"]:
        assert h["score"] == h["scores"]["rerank"] == pytest.approx(ref[h["id"]], abs=1e-6)
        assert h["scores"]["retrieval"] == pytest.approx(retrieval[h["id"]], abs=1e-6)
    # the default reranker and candidates (max(top_k, 30): every document here)
    default = client.post("/v1/search", json={"index": "rr", "query": QUERY, "top_k": 1, "rerank": {}}).json()
    assert [h["id"] for h in default["data"]] == best[:1] and default["rerank_model"] == "tiny-bert-reranker"
    _err(client.post("/v1/search", json={"index": "rr", "query": QUERY, "top_k": 5, "rerank": {"candidates": 2}}),
         400, "rerank.candidates")
    _err(client.post("/v1/search", json={"index": "rr", "query": QUERY, "rerank": {"model": "tiny-dense"}}), 400, "model")
    _err(client.post("/v1/search", json={"index": "rr", "query": QUERY, "rerank": {"top": 1}}), 400)


def test_overload_is_429_with_retry_after(models, tmp_path):
    cfg = ServerConfig.of(model="tiny-bert-reranker", generate_model="none", max_concurrent_requests=1,
                          index_dir=str(tmp_path))
    app = build_app(cfg, model=[models["bert"]])
    with TestClient(app) as c:
        first = {}
        with COMPUTE_LOCK:                          # the engine cannot run: the first request waits in it
            t = threading.Thread(target=lambda: first.update(r=c.post("/v1/rerank", json={"query": QUERY,
                                                                                          "documents": DOCS})))
            t.start()
            for _ in range(200):
                if c.get("/metrics").text.count("embedserve_embed_requests_running 1.0"):
                    break
                threading.Event().wait(0.02)
            r = c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
        t.join(10)
        err = _err(r, 429)
        assert float(r.headers["Retry-After"]) > 0 and "max-concurrent-requests" in err["message"]
        assert first["r"].status_code == 200
