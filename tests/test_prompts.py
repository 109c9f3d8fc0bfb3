"""Named prompts: a model's own (sentence-transformers' `config_sentence_transformers.json`
`prompts` or embedserve_model.json), chosen per request by `prompt_name` (TEI) or `input_type`
(query / passage), with a default; an index records the prompts it applies and applies them
itself (a search naming a prompt the index lacks is a 409 naming both); changing an index's
prompts with the same weights is a migration (`reindex --prompt`), gated, swapped and in the
ledger."""

import json
import shutil

import numpy as np
import pytest
from fastapi.testclient import TestClient

from helpers import BGE_M3_DIR, wiki_docs

from embedserve.cli import main
from embedserve.config import ServerConfig
from embedserve.models.embedding_model import EmbeddingModel
from embedserve.serve import build_app
from index.store import IndexStore

PROMPTS = {"query": "query: ", "passage": "passage: ", "classification": "Classify the topic: "}


@pytest.fixture(scope="module")
def prompted(tmp_path_factory):
    """tiny-bge-m3 with sentence-transformers' prompts (and a default)."""
    d = tmp_path_factory.mktemp("models") / "tiny-prompted"
    shutil.copytree(BGE_M3_DIR, d)
    (d / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS,
                                                                     "default_prompt_name": "classification"}))
    return EmbeddingModel(d, name="tiny-prompted", dtype="float32")


@pytest.fixture(scope="module")
def client(prompted, tmp_path_factory):
    cfg = ServerConfig.of(model="tiny-prompted", generate_model="none", index_dir=str(tmp_path_factory.mktemp("ix")))
    with TestClient(build_app(cfg, model=prompted)) as c:
        yield c


def _dense(model, text: str) -> np.ndarray:
    return model.embed(model.tokenize([text]), {"dense"})[0][0].dense


def test_models_prompts_read_and_listed(client, prompted):
    assert prompted.prefixes == PROMPTS and prompted.default_prompt_name == "classification"
    row = client.get("/v1/models").json()["data"][0]
    assert row["prompts"] == PROMPTS


def test_prompt_name_input_type_and_the_default(client, prompted):
    def emb(**kw):
        return np.array(client.post("/v1/embeddings", json={"input": "Paris", **kw}).json()["data"][0]["embedding"])
    np.testing.assert_allclose(emb(prompt_name="classification"), _dense(prompted, "Classify the topic: Paris"), atol=1e-5)
    np.testing.assert_allclose(emb(input_type="query"), _dense(prompted, "query: Paris"), atol=1e-5)
    np.testing.assert_allclose(emb(prompt_name="passage", input_type="passage"), _dense(prompted, "passage: Paris"),
                               atol=1e-5)
    np.testing.assert_allclose(emb(), _dense(prompted, "Classify the topic: Paris"), atol=1e-5)   # the model's default
    r = client.post("/v1/embeddings", json={"input": "Paris", "prompt_name": "summarize"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt_name" and "'classification'" in err["message"]
    r = client.post("/v1/embeddings", json={"input": "Paris", "prompt_name": "query", "input_type": "passage"})
    assert r.status_code == 400 and "disagree" in r.json()["error"]["message"]
    r = client.post("/v1/embeddings", json={"input": [5, 6], "prompt_name": "query"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_name"
    assert client.post("/v1/embeddings", json={"input": [5, 6]}).status_code == 200   # no default prompt on token ids


def test_default_prompt_name_flag(prompted, tmp_path):
    cfg = ServerConfig.of(model="tiny-prompted", generate_model="none", default_prompt_name="query",
                          index_dir=str(tmp_path))
    with TestClient(build_app(cfg, model=prompted)) as c:
        got = c.post("/v1/embeddings", json={"input": "Paris"}).json()["data"][0]["embedding"]
        np.testing.assert_allclose(got, _dense(prompted, "query: Paris"), atol=1e-5)


def test_the_index_records_and_applies_its_prompts(client, prompted):
    assert client.post("/v1/indexes", json={"name": "p"}).status_code == 201
    docs = [{"id": str(i), "text": t} for i, t in enumerate(["Paris is in France.", "Berlin is in Germany."])]
    assert client.post("/v1/indexes/p/documents", json={"documents": docs}).status_code == 200
    m = IndexStore(client.app.state.embedserve.indexes.root).manifest("p")
    assert m.prompts == PROMPTS and m.query_prefix == "query: "
    hit = client.post("/v1/search", json={"index": "p", "query": "France", "top_k": 2}).json()["data"]
    d0 = _dense(prompted, "passage: Paris is in France.")
    scores = {h["id"]: h["score"] for h in hit}
    assert scores["0"] == pytest.approx(float(d0 @ _dense(prompted, "query: France")), abs=1e-5)
    named = client.post("/v1/search", json={"index": "p", "query": "France", "prompt_name": "classification"}).json()
    score = {h["id"]: h["score"] for h in named["data"]}["0"]
    assert score == pytest.approx(float(d0 @ _dense(prompted, "Classify the topic: France")), abs=1e-5)
    r = client.post("/v1/search", json={"index": "p", "query": "France", "prompt_name": "summarize"})
    err = r.json()["error"]
    assert r.status_code == 409 and "'summarize'" in err["message"] and "'classification'" in err["message"]


def test_prompt_migration_reindexes_swaps_and_is_in_the_ledger(minilm_model, tmp_path, capsys):
    root = str(tmp_path / "ix")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"id": d.id, "text": d.text}) for d in wiki_docs(60)) + "\n")
    flags = ["--index-dir", root, "--dtype", "float32"]
    assert main(["index", "create", "kb", "--model", "all-MiniLM-L6-v2", *flags]) == 0
    assert main(["index", "add", "kb", str(docs), *flags]) == 0
    store = IndexStore(root)
    before = store.current("kb")
    instruction = "Represent this sentence for searching relevant passages: "
    assert main(["reindex", "--index", "kb", "--prompt", f"query={instruction}", "--sample", "30", *flags]) == 0
    m = store.manifest("kb")
    assert store.current("kb") != before and m.model == "all-MiniLM-L6-v2" and m.query_prefix == instruction
    capsys.readouterr()
    assert main(["index", "history", "kb", "--index-dir", root]) == 0
    entry = [e for e in json.loads(capsys.readouterr().out) if e["kind"] == "reindex"][-1]
    assert entry["prompts_changed"] == {"query": {"from": "", "to": instruction}}
    # the server serves the migrated index with the same model, applying the index's prompt
    cfg = ServerConfig.of(model="all-MiniLM-L6-v2", generate_model="none", index_dir=root)
    with TestClient(build_app(cfg, model=minilm_model)) as c:
        hit = c.post("/v1/search", json={"index": "kb", "query": "a city", "top_k": 1}).json()
        assert hit["model"] == "all-MiniLM-L6-v2", hit
        doc = next(d for d in wiki_docs(60) if d.id == hit["data"][0]["id"])
        want = float(_dense(minilm_model, doc.text) @ _dense(minilm_model, instruction + "a city"))
        assert hit["data"][0]["score"] == pytest.approx(want, abs=1e-4)
    # the same prompts again: nothing to migrate
    assert main(["reindex", "--index", "kb", "--prompt", f"query={instruction}", *flags]) == 1
    assert "nothing to reindex" in capsys.readouterr().err
    assert main(["reindex", "--index", "kb", "--prompt", "no-equals-sign", *flags]) == 1
