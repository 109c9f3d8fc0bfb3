"""The index routes in-process (FastAPI TestClient, lifespan included): create / list / info /
upsert / delete / search, OpenAI-style error envelopes, 400 for names leaving the root, 409 for
an index made by another model, and documents that survive a restart — on both backends (local
files, and a real PostgreSQL + pgvector with `index_url`) where the behaviour is the backend's."""

from __future__ import annotations

import dataclasses
import os

import pytest
from fastapi.testclient import TestClient

from embedserve.serve import build_app
from embedserve.config import ServerConfig
from index.backend import open_store
from index.manifest import ModelIdentity
from index.store import IndexStore

DOCS = [
    {"id": "paris", "text": "Paris is the capital and largest city of France.", "metadata": {"lang": "en", "n": 1}},
    {"id": "berlin", "text": "Berlin is the capital of Germany and its largest city.", "metadata": {"lang": "en", "n": 2}},
    {"id": "chat", "text": "Le chat dort sur le canapé depuis ce matin.", "metadata": {"lang": "fr", "n": 3}},
    {"id": "faiss", "text": "FAISS is a library for efficient similarity search of dense vectors.", "metadata": {}},
]


@pytest.fixture
def root(tmp_path):
    return tmp_path / "indexes"


@pytest.fixture(params=["local", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request, root) -> dict:
    """Where the indexes go: the config fields of each backend."""
    if request.param == "local":
        return {"index_dir": str(root)}
    return {"index_dir": str(root), "index_url": request.getfixturevalue("pg_url")}


def raw_store(backend: dict):
    """The backend's store, opened beside the server (another process would do the same)."""
    return open_store(backend.get("index_url"), backend["index_dir"])


@pytest.fixture
def client(backend, minilm_model):
    with TestClient(build_app(ServerConfig.of(**backend), model=minilm_model)) as c:
        yield c


@pytest.fixture
def local_client(root, minilm_model):
    with TestClient(build_app(ServerConfig.of(index_dir=str(root)), model=minilm_model)) as c:
        yield c


def _err(resp, status, code=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    if code:
        assert body["error"]["code"] == code, body
    return body["error"]


def _create_and_fill(client, name="kb"):
    r = client.post("/v1/indexes", json={"name": name})
    assert r.status_code == 201, r.text
    r = client.post(f"/v1/indexes/{name}/documents", json={"documents": DOCS})
    assert r.status_code == 200, r.text
    return r.json()


def test_create_upsert_search_delete(client, minilm_model):
    created = client.post("/v1/indexes", json={"name": "kb"}).json()
    assert created["name"] == "kb" and created["model"] == "all-MiniLM-L6-v2"
    assert created["dimension"] == 384 and created["metric"] == "ip" and created["normalize"] is True
    assert created["sparse"] == "bm25" and created["fingerprint"] == minilm_model.spec.fingerprint
    _err(client.post("/v1/indexes", json={"name": "kb"}), 409, "index_exists")

    up = client.post("/v1/indexes/kb/documents", json={"documents": DOCS}).json()
    assert up["added"] == 4 and up["truncated"] == []
    again = client.post("/v1/indexes/kb/documents", json={"documents": DOCS}).json()
    assert again["added"] == 0 and again["unchanged"] == 4 and again["sequence"] == up["sequence"]
    changed = [dict(DOCS[0], text="Paris is the capital of France, on the Seine."), dict(DOCS[1], metadata={"x": 1})]
    r = client.post("/v1/indexes/kb/documents", json={"documents": changed}).json()
    assert (r["replaced"], r["metadata"]) == (1, 1)

    for mode in ("dense", "sparse", "hybrid"):
        r = client.post("/v1/search", json={"index": "kb", "query": "What is the capital of Germany?",
                                            "mode": mode, "top_k": 2})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert data[0]["id"] == "berlin", (mode, data)
        assert data[0]["text"] == DOCS[1]["text"] and data[0]["metadata"] == {"x": 1}
        assert set(data[0]["scores"]) == ({"dense", "sparse"} if mode == "hybrid" else {mode})
    r = client.post("/v1/search", json={"index": "kb", "query": "capital city", "filter": {"lang": "fr"}}).json()
    assert [d["id"] for d in r["data"]] == ["chat"]
    r = client.post("/v1/search", json={"index": "kb", "query": "capital", "mode": "hybrid", "fusion": "weighted",
                                        "weights": {"dense": 1, "sparse": 0}, "top_k": 4}).json()
    assert [d["score"] for d in r["data"]] == pytest.approx([d["scores"]["dense"] for d in r["data"]])

    info = client.get("/v1/indexes/kb").json()
    assert info["live_counts"] == info["counts"] == {"documents": 4, "dense": 4, "sparse": 4}
    assert info["compatible"] is True
    listed = client.get("/v1/indexes").json()["data"]
    assert [x["name"] for x in listed] == ["kb"]

    r = client.request("DELETE", "/v1/indexes/kb/documents", json={"ids": ["chat", "nope"]}).json()
    assert r["deleted"] == 1 and r["missing"] == ["nope"]
    r = client.post("/v1/search", json={"index": "kb", "query": "chat canapé", "top_k": 10}).json()
    assert "chat" not in [d["id"] for d in r["data"]]

    assert client.delete("/v1/indexes/kb").json()["deleted"] is True
    _err(client.get("/v1/indexes/kb"), 404, "index_not_found")
    _err(client.post("/v1/search", json={"index": "kb", "query": "x"}), 404, "index_not_found")


def test_long_documents_are_truncated_not_refused(client):
    client.post("/v1/indexes", json={"name": "long"})
    long_text = "The history of the city spans many centuries of trade and war. " * 200
    r = client.post("/v1/indexes/long/documents", json={"documents": [{"id": "long", "text": long_text}]})
    assert r.status_code == 200, r.text
    assert r.json()["truncated"] == ["long"]
    hits = client.post("/v1/search", json={"index": "long", "query": "history of the city"}).json()["data"]
    assert hits[0]["id"] == "long" and hits[0]["text"] == long_text


@pytest.mark.parametrize("name", ["..", "../evil", "/etc/passwd", "a/b", ".hidden", "", "x" * 65, 7])
def test_names_leaving_the_root_are_400(client, tmp_path, name):
    e = _err(client.post("/v1/indexes", json={"name": name}), 400, "invalid_index_name")
    assert e["param"] == "name"
    _err(client.post("/v1/search", json={"index": name, "query": "x"}), 400)
    assert [p.name for p in tmp_path.iterdir()] in ([], ["indexes"])      # nothing written outside the root


@pytest.mark.parametrize("path", ["/v1/indexes/%2E%2E", "/v1/indexes/..%2F..%2Fetc", "/v1/indexes/.x/documents"])
def test_encoded_traversal_in_the_url_is_refused(client, path):
    r = client.get(path) if not path.endswith("documents") else client.post(path, json={"documents": DOCS})
    assert r.status_code in (400, 404), r.text        # 404: the router never matched it at all
    assert r.status_code == 404 or r.json()["error"]["code"] == "invalid_index_name"


def test_link_leaving_the_root_is_400(local_client, root, tmp_path, minilm_model):
    client = local_client
    IndexStore(tmp_path / "elsewhere").create("secret", ModelIdentity.from_spec(minilm_model.spec)).close()
    root.mkdir(parents=True, exist_ok=True)
    os.symlink(tmp_path / "elsewhere" / "secret", root / "escape")
    _err(client.get("/v1/indexes/escape"), 400, "path_outside_root")
    _err(client.post("/v1/search", json={"index": "escape", "query": "x"}), 400, "path_outside_root")


@pytest.mark.parametrize("field,change", [("fingerprint", {"fingerprint": "0" * 64}), ("dimension", {"dimension": 768}),
                                          ("model", {"model": "multilingual-e5-small"})])
def test_index_of_another_model_is_409(client, backend, minilm_model, field, change):
    other = dataclasses.replace(ModelIdentity.from_spec(minilm_model.spec), **change)
    raw_store(backend).create("foreign", other).close()
    e = _err(client.post("/v1/search", json={"index": "foreign", "query": "hello"}), 409, "manifest_mismatch")
    assert e["param"] == field and repr(change[field]) in e["message"]
    _err(client.post("/v1/indexes/foreign/documents", json={"documents": DOCS}), 409, "manifest_mismatch")
    info = client.get("/v1/indexes/foreign").json()        # inspecting it is fine
    assert info["compatible"] is False and field in info["mismatch"]
    assert client.get("/v1/indexes").json()["data"][0]["compatible"] is False


@pytest.mark.parametrize("body", [
    {"index": "kb", "query": "x", "top_k": 0}, {"index": "kb", "query": "x", "mode": "colbert"},
    {"index": "kb", "query": ""}, {"index": "kb", "query": "x", "weights": {"dense": -1}},
    {"index": "kb", "query": "x", "filter": {"a": {"$gt": 1}}}, {"index": "kb", "query": "x", "fusion": "max"},
    {"index": "kb", "query": "x", "model": "other"}, {"index": "kb"},
])
def test_bad_search_requests_are_4xx(client, body):
    _create_and_fill(client)
    r = client.post("/v1/search", json=body)
    assert r.status_code == (404 if body.get("model") else 400), r.text
    _err(r, r.status_code)


@pytest.mark.parametrize("documents", [[], [{"id": "a", "text": ""}], [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}],
                                       [{"id": "", "text": "x"}], [{"id": "a", "text": "x", "metadata": [1]}],
                                       [{"text": "no id"}]])
def test_bad_documents_are_400(client, documents):
    client.post("/v1/indexes", json={"name": "kb"})
    _err(client.post("/v1/indexes/kb/documents", json={"documents": documents}), 400)
    assert client.get("/v1/indexes/kb").json()["live_counts"]["documents"] == 0


def test_documents_survive_a_restart(backend, minilm_model):
    app = build_app(ServerConfig.of(**backend), model=minilm_model)
    with TestClient(app) as c:
        _create_and_fill(c)
    with TestClient(build_app(ServerConfig.of(**backend), model=minilm_model)) as c:
        hits = c.post("/v1/search", json={"index": "kb", "query": "vector similarity search library"}).json()["data"]
        assert hits[0]["id"] == "faiss"
    store = raw_store(backend)
    assert store.counts("kb", store.current("kb")) == {"documents": 4, "dense": 4, "sparse": 4}
    if store.backend == "local":
        m = IndexStore(backend["index_dir"]).manifest("kb")      # the shutdown snapshot holds every write
        assert m.counts == {"documents": 4, "dense": 4, "sparse": 4} and m.files


def test_chinese_and_english_documents_round_trip(client):
    """Text is stored and returned exactly (jsonb and text columns on PostgreSQL, SQLite locally),
    and the lexical side works on Chinese: BM25 over the tokenizer's pieces, not on whitespace."""
    docs = [{"id": "京", "text": "北京是中华人民共和国的首都，也是全国的政治和文化中心。", "metadata": {"语言": "中文"}},
            {"id": "沪", "text": "上海是中国最大的城市和经济中心，位于长江入海口。", "metadata": {"语言": "中文"}},
            {"id": "paris", "text": "Paris is the capital and largest city of France.", "metadata": {"语言": "英文"}}]
    assert client.post("/v1/indexes", json={"name": "zh"}).status_code == 201
    assert client.post("/v1/indexes/zh/documents", json={"documents": docs}).json()["added"] == 3
    r = client.post("/v1/search", json={"index": "zh", "query": "首都北京", "mode": "sparse", "top_k": 3}).json()
    assert r["data"][0]["id"] == "京" and r["data"][0]["text"] == docs[0]["text"]
    assert r["data"][0]["metadata"] == {"语言": "中文"}
    r = client.post("/v1/search", json={"index": "zh", "query": "长江 上海", "mode": "hybrid", "top_k": 3,
                                        "filter": {"语言": "中文"}}).json()
    assert r["data"][0]["id"] == "沪" and {h["id"] for h in r["data"]} <= {"京", "沪"}
