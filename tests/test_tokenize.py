"""POST /tokenize and /detokenize (vLLM's shape, TEI's per-token offsets on request) for every
served model: ids equal the model's own `tokenizers` / transformers output, a chat goes through
the decoder's chat template, and back again; `truncation_direction: left` on /v1/embeddings
keeps the last tokens (checked on token ids) and `usage` counts what was cut."""

import pytest
from fastapi.testclient import TestClient

from helpers import BERT_RERANKER_DIR, BGE_M3_DIR, make_decode_engine

from embedserve.config import ServerConfig
from embedserve.engine.generator import Generator
from embedserve.models.cross_encoder import CrossEncoderModel
from embedserve.models.embedding_model import EmbeddingModel
from embedserve.serve import build_app

TEXT = "Paris is the capital of France. 巴黎是法国的首都。"


@pytest.fixture(scope="module")
def parts(smollm2, tmp_path_factory):
    m3 = EmbeddingModel(BGE_M3_DIR, name="tiny-bge-m3", dtype="float32")
    rr = CrossEncoderModel(BERT_RERANKER_DIR, name="tiny-bert-reranker", dtype="float32")
    gen = Generator(name="SmolLM2-135M-Instruct", engine=make_decode_engine(smollm2, num_blocks=32, max_model_len=256),
                    tokenizer=smollm2[1])
    cfg = ServerConfig.of(model="tiny-bge-m3", index_dir=str(tmp_path_factory.mktemp("ix")))
    app = build_app(cfg, model=[m3, rr], generator=gen)
    with TestClient(app) as c:
        yield c, m3, rr, gen


def test_tokenize_equals_the_models_tokenizer_for_every_model(parts):
    c, m3, rr, gen = parts
    body = c.post("/tokenize", json={"prompt": TEXT}).json()
    assert body["model"] == "tiny-bge-m3" and body["tokens"] == m3.tokenizer.encode(TEXT).ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == m3.max_input_length
    plain = c.post("/tokenize", json={"model": "tiny-bert-reranker", "prompt": TEXT, "add_special_tokens": False}).json()
    assert plain["tokens"] == rr.tokenizer.encode(TEXT, add_special_tokens=False).ids
    g = c.post("/tokenize", json={"model": gen.name, "prompt": TEXT}).json()
    assert g["tokens"] == gen.encode_prompt(TEXT) and g["max_model_len"] == 256


def test_chat_messages_use_the_chat_template(parts):
    c, _, _, gen = parts
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好，Paris?"}]
    body = c.post("/tokenize", json={"messages": messages}).json()          # a chat: the decoder by default
    assert body["model"] == gen.name and body["tokens"] == gen.encode_chat(messages)
    err = c.post("/tokenize", json={"model": "tiny-bge-m3", "messages": messages}).json()["error"]
    assert err["param"] == "messages"


def test_offsets_and_token_strings(parts):
    c, m3, _, gen = parts
    for model in ("tiny-bge-m3", gen.name):
        body = c.post("/tokenize", json={"model": model, "prompt": TEXT, "return_offsets": True,
                                         "return_token_strs": True}).json()
        assert len(body["offsets"]) == len(body["token_strs"]) == body["count"]
        for tok in body["offsets"]:
            if tok["special"]:
                assert tok["start"] is None
            else:
                assert tok["text"] == TEXT[tok["start"]:tok["stop"]]
        words = [t for t in body["offsets"] if not t["special"]]
        assert any(t["text"] == "Paris" for t in words) and words[-1]["stop"] == len(TEXT)
    first = c.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
    assert first["token_strs"] == m3.tokenizer.encode(TEXT).tokens


def test_input_type_adds_the_embedders_prefix(tmp_path):
    import json
    import shutil
    d = tmp_path / "prefixed"
    shutil.copytree(BGE_M3_DIR, d)
    (d / "embedserve_model.json").write_text(json.dumps({"pooling": "cls", "normalize": True,
                                                         "query_prefix": "query: ", "passage_prefix": "passage: "}))
    m = EmbeddingModel(d, name="prefixed", dtype="float32")
    app = build_app(ServerConfig.of(model="prefixed", generate_model="none", index_dir=str(tmp_path / "ix")), model=m)
    with TestClient(app) as c:
        body = c.post("/tokenize", json={"prompt": "Paris", "input_type": "query"}).json()
        assert body["tokens"] == m.tokenize(["Paris"], "query")[0]
        emb = c.post("/v1/embeddings", json={"input": "Paris", "input_type": "query"}).json()
        assert emb["usage"]["prompt_tokens"] == body["count"]


def test_detokenize_round_trips_and_refuses_unknown_ids(parts):
    c, m3, _, gen = parts
    for model, tok in (("tiny-bge-m3", None), (gen.name, None)):
        ids = c.post("/tokenize", json={"model": model, "prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
        back = c.post("/detokenize", json={"model": model, "tokens": ids}).json()
        assert back["model"] == model and back["prompt"].replace(" ", "") == TEXT.replace(" ", "")
    ids = c.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
    kept = c.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    skipped = c.post("/detokenize", json={"tokens": ids, "skip_special_tokens": True}).json()["prompt"]
    assert "<s>" in kept and "<s>" not in skipped
    err = c.post("/detokenize", json={"tokens": [0, 10**7]}).json()["error"]
    assert err["param"] == "tokens" and "10000000" in err["message"]


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ({"prompt": "a", "model": "nope"}, "model"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "a", "input_type": "document"}, "input_type"),
    ({"model": "SmolLM2-135M-Instruct", "prompt": "a", "input_type": "query"}, "input_type"),
])
def test_bad_tokenize_requests(parts, body, param):
    r = parts[0].post("/tokenize", json=body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert param in (err["param"] or "") or param in err["message"]


def test_truncation_direction_left_keeps_the_last_tokens(parts):
    c, m3, _, _ = parts
    text = " ".join(f"w{i}" for i in range(400))
    ids = m3.tokenize([text])[0]
    limit = m3.max_input_length
    for direction, want in (("right", ids[:limit - 1] + ids[-1:]), ("left", ids[:1] + ids[-(limit - 1):])):
        r = c.post("/v1/embeddings", json={"input": text, "truncate": True, "truncation_direction": direction,
                                           "embedding_types": ["sparse"]}).json()
        assert r["usage"]["prompt_tokens"] == limit and r["usage"]["truncated_tokens"] == len(ids) - limit
        assert len(want) == limit
        kept = set(r["data"][0]["sparse_embedding"]["indices"])
        content = set(want) - m3.special_ids
        assert kept <= content                              # lexical weights only of the kept tokens
        ref, _ = m3.embed([want], {"dense"})
        got = c.post("/v1/embeddings", json={"input": text, "truncate": True,
                                             "truncation_direction": direction}).json()["data"][0]["embedding"]
        assert max(abs(a - b) for a, b in zip(got, ref[0].dense)) < 1e-5
    assert m3.truncate(ids, limit, "left") == ids[:1] + ids[-(limit - 1):]
    r = c.post("/v1/embeddings", json={"input": text, "truncate": True, "truncation_direction": "middle"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_direction"
