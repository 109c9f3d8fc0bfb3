"""The unmodified `cohere` SDK (v1 `Client` against /v1/rerank, `ClientV2` against /v2/rerank;
only `base_url` and the key set) and embedserve's own client against the real server on its
default models: the default embedder and the default reranker side by side, so one process
answers every stage of a RAG pipeline (retrieve, rerank, generate)."""

import cohere
import httpx
import numpy as np
import pytest

from embedserve.client import Client

RERANKER = "ms-marco-MiniLM-L-12-v2"
QUERY = "How many people live in Berlin?"
DOCS = ["Berlin has a population of 3,850,809 registered inhabitants in an area of 891.82 square kilometers.",
        "Berlin is well known for its museums.",
        "The Danube is the second-longest river in Europe.",
        "柏林是德国首都，人口约三百八十万。",
        "New York City is famous for the Metropolitan Museum of Art."]


@pytest.fixture(scope="module")
def reference(server):
    """Our own scores of DOCS, from the raw endpoint."""
    body = httpx.post(server + "/v1/rerank", timeout=60, json={"query": QUERY, "documents": DOCS}).json()
    return {r["index"]: r["relevance_score"] for r in body["results"]}


def test_default_models_serve_every_stage(server):
    rows = {m["id"]: m for m in httpx.get(server + "/v1/models").json()["data"]}
    assert rows["multilingual-e5-small"]["task"] == "embed"
    assert rows[RERANKER]["task"] == "rerank" and rows[RERANKER]["rerank"] == ["cross-encoder"]
    assert any(m["task"] == "generate" for m in rows.values())


def test_cohere_v1_client_rerank(server, reference):
    co = cohere.Client(base_url=server, api_key="unused", timeout=60)
    res = co.rerank(model=RERANKER, query=QUERY, documents=DOCS, top_n=3, return_documents=True)
    assert [r.index for r in res.results] == sorted(reference, key=lambda i: -reference[i])[:3]
    assert res.results[0].index == 0                     # the population sentence
    for r in res.results:
        assert r.relevance_score == pytest.approx(reference[r.index], abs=1e-6)
        assert r.document.text == DOCS[r.index]
    dicts = co.rerank(model=RERANKER, query=QUERY, documents=[{"text": d} for d in DOCS])
    assert [r.index for r in dicts.results] == sorted(reference, key=lambda i: -reference[i])


def test_cohere_v2_client_rerank(server, reference):
    co = cohere.ClientV2(base_url=server, api_key="unused", timeout=60)
    res = co.rerank(model=RERANKER, query=QUERY, documents=DOCS, top_n=2)
    assert [r.index for r in res.results] == sorted(reference, key=lambda i: -reference[i])[:2]
    assert res.results[0].relevance_score == pytest.approx(reference[res.results[0].index], abs=1e-6)
    cut = co.rerank(model=RERANKER, query=QUERY, documents=DOCS, max_tokens_per_doc=4)
    assert {r.index for r in cut.results} == set(range(len(DOCS)))


def test_cohere_sdk_sees_our_errors(server):
    co = cohere.Client(base_url=server, api_key="unused", timeout=60)
    with pytest.raises(cohere.core.api_error.ApiError) as exc:
        co.rerank(model="multilingual-e5-small", query=QUERY, documents=DOCS)
    assert exc.value.status_code == 400 and RERANKER in str(exc.value.body)


def test_client_rerank_and_search_with_rerank(server, reference):
    with Client(server) as c:
        got = c.rerank(QUERY, DOCS, top_n=2, return_documents=True)
        assert [r["index"] for r in got] == sorted(reference, key=lambda i: -reference[i])[:2]
        assert got[0]["document"] == {"text": DOCS[got[0]["index"]]}
        many = [f"{d} ({i})" for i in range(300) for d in DOCS[:1]] + DOCS
        ranked = c.rerank(QUERY, many)
        assert len(ranked) == len(many) and sorted(r["index"] for r in ranked) == list(range(len(many)))
        ix = c.index("rerank-sdk")
        ix.create(exist_ok=True)
        ix.upsert([{"id": str(i), "text": d} for i, d in enumerate(DOCS)])
        hits = ix.search(QUERY, top_k=2, rerank=True)
        assert [h["id"] for h in hits] == [str(i) for i in sorted(reference, key=lambda i: -reference[i])[:2]]
        assert all(h["scores"]["rerank"] == pytest.approx(reference[int(h["id"])], abs=1e-6) for h in hits)
        assert np.isfinite([h["scores"]["retrieval"] for h in hits]).all()
        ix.drop()


def test_client_tokenize_prompts_and_left_truncation(server):
    with Client(server) as c:
        tok = c.tokenize("Paris 巴黎", model="multilingual-e5-small", input_type="query")
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
        e = c.embed(["Paris"], prompt_name="query")
        q = c.embed(["Paris"], input_type="query")
        np.testing.assert_allclose(e.dense, q.dense, atol=1e-6)
        long = "Paris is lovely in spring. " * 120 + "量子计算机很冷。" * 120
        left = c.embed([long], truncate=True, truncation_direction="left")
        right = c.embed([long], truncate=True)
        assert left.truncated == right.truncated == [0]
        zh = c.embed(["量子计算机很冷。" * 60]).dense[0]
        assert float(left.dense[0] @ zh) > float(right.dense[0] @ zh) + 0.1   # the end (Chinese) kept
