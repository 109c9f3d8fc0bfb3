"""The HTTP API in-process (FastAPI TestClient, lifespan included): OpenAI's response shape,
every user error as a clear 4xx in OpenAI's envelope, auth, readiness, overload, metrics."""

import base64
import json
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from embedserve.serve import build_app
from embedserve.config import ServerConfig
from embedserve.errors import ConfigError

NAME = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def client(minilm_model):
    app = build_app(ServerConfig.of(model=NAME, max_client_batch_size=16, max_body_bytes=100_000),
                     model=minilm_model)
    with TestClient(app) as c:
        yield c


def _err(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_float_response_has_openai_shape_and_matches_engine(client, minilm_model):
    texts = ["hello world", "北京是中国的首都", "Le chat dort."]
    r = client.post("/v1/embeddings", json={"input": texts, "model": NAME})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and body["model"] == NAME
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in body["data"])
    ids = minilm_model.tokenize(texts)
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    ref, _ = minilm_model.embed(ids, {"dense"})
    for d, o in zip(body["data"], ref):
        np.testing.assert_allclose(d["embedding"], o.dense, atol=1e-6)


def test_base64_is_little_endian_float32(client):
    f = client.post("/v1/embeddings", json={"input": "hello", "model": NAME}).json()
    b = client.post("/v1/embeddings", json={"input": "hello", "model": NAME, "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, f["data"][0]["embedding"], atol=0)


def test_token_id_inputs_equal_text_inputs(client, minilm_model):
    ids = minilm_model.tokenize(["hello world"])[0][1:-1]    # content ids, no specials
    a = client.post("/v1/embeddings", json={"input": ids}).json()
    b = client.post("/v1/embeddings", json={"input": [ids, ids]}).json()
    t = client.post("/v1/embeddings", json={"input": "hello world"}).json()
    np.testing.assert_allclose(a["data"][0]["embedding"], t["data"][0]["embedding"], atol=1e-6)
    assert len(b["data"]) == 2


def test_truncate_true_cuts_and_says_so(client):
    long = "word " * 700
    e = _err(client.post("/v1/embeddings", json={"input": ["ok", long]}), 400)
    assert "input 1 has 702 tokens" in e["message"] and "512" in e["message"] and "truncate" in e["message"]
    r = client.post("/v1/embeddings", json={"input": ["ok", long], "truncate": True})
    assert r.status_code == 200
    assert r.json()["usage"]["truncated_inputs"] == [1]
    assert r.json()["usage"]["prompt_tokens"] == 3 + 512


def test_dimensions(client):
    assert client.post("/v1/embeddings", json={"input": "x", "dimensions": 384}).status_code == 200
    e = _err(client.post("/v1/embeddings", json={"input": "x", "dimensions": 128}), 400)
    assert e["param"] == "dimensions" and "384" in e["message"]


@pytest.mark.parametrize("payload,param,needle", [
    ({"input": ""}, "input", "empty string"),
    ({"input": ["a", "  "]}, "input", "input 1 is an empty string"),
    ({"input": []}, "input", "empty list"),
    ({"input": [[]]}, "input", "input 0 is an empty token list"),
    ({"input": [1, "a"]}, "input", "mixes types"),
    ({"input": [[1, 2.5]]}, "input", "integer token ids"),
    ({"input": [[5, 30522]]}, "input", "token id 30522"),
    ({"input": [-1]}, "input", "token id -1"),
    ({"input": {"a": 1}}, "input", "not dict"),
    ({"input": None}, "input", "not NoneType"),
    ({"input": ["x"] * 17}, "input", "limit (--max-client-batch-size) is 16"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "x", "dimensions": "12"}, "dimensions", "integer"),
    ({"input": "x", "truncate": "yes"}, "truncate", "boolean"),
    ({"input": "x", "input_type": "document"}, "input_type", "query"),
    ({"input": "x", "embedding_types": ["sparse"]}, "embedding_types", "no sparse head"),
    ({"input": "x", "embedding_types": ["colbert"]}, "embedding_types", "no colbert head"),
    ({"input": "x", "embedding_types": ["bm25"]}, "embedding_types.0", "dense"),
    ({}, "input", "required"),
    ({"input": "\ud800"}, "input", "unpaired UTF-16 surrogate"),
    ({"input": [1.5]}, "input", "input 0 is a float"),
    ({"input": [True]}, "input", "input 0 is a bool"),
    ({"input": "x", "embedding_types": []}, "embedding_types", "at least 1"),
    ({"input": "x", "user": "u" * 300}, "user", "at most 256"),
])
def test_bad_inputs_are_400_with_a_useful_message(client, payload, param, needle):
    # json.dumps escapes non-ASCII (a lone surrogate too) the way a hostile client would send it
    e = _err(client.post("/v1/embeddings", content=json.dumps(payload).encode()), 400)
    assert e["param"] == param
    assert needle in e["message"]
    assert e["type"] == "invalid_request_error"


def test_malformed_json_and_non_objects_are_400(client):
    for raw in (b"{bad", b"[1,2]", b"\xff\xfe", b""):
        e = _err(client.post("/v1/embeddings", content=raw), 400)
        assert "JSON" in e["message"]


def test_form_encoded_json_body_still_parses(client):
    r = client.post("/v1/embeddings", content=b'{"input":"x"}',
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200


def test_unknown_model_is_404(client):
    e = _err(client.post("/v1/embeddings", json={"input": "x", "model": "text-embedding-3-large"}), 404)
    assert e["code"] == "model_not_found" and NAME in e["message"]


def test_unknown_route_is_404_in_envelope(client):
    _err(client.get("/v1/nothing"), 404)
    _err(client.get("/v1/embeddings"), 405)


def test_body_over_limit_is_413_with_or_without_content_length(client):
    big = {"input": "a " * 60_000}
    e = _err(client.post("/v1/embeddings", json=big), 413)
    assert "100000" in e["message"]

    def chunks():
        for _ in range(30):
            yield b"x" * 10_000
    _err(client.post("/v1/embeddings", content=chunks()), 413)


def test_models_health_ready_metrics(client):
    m = client.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == NAME and m["data"][0]["dimensions"] == 384
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200
    client.post("/v1/embeddings", json={"input": ["a b c", "d"]})
    text = client.get("/metrics").text
    for name in ("embedserve_embed_requests_running", "embedserve_embed_requests_waiting",
                 "embedserve_embed_batch_size_inputs_bucket", "embedserve_embed_batch_size_tokens_bucket",
                 "embedserve_embed_padding_efficiency", "embedserve_embed_queue_time_seconds_bucket",
                 "embedserve_request_latency_seconds_bucket", "embedserve_prompt_tokens_total",
                 'embedserve_errors_total{type="invalid_request_error"}'):
        assert name in text, name


def test_api_key_required_everywhere_but_health_and_ready(minilm_model):
    app = build_app(ServerConfig.of(model=NAME, api_key="s3cret"), model=minilm_model)
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/ready").status_code == 200
        for method, path in (("post", "/v1/embeddings"), ("get", "/v1/models"), ("get", "/metrics")):
            e = _err(getattr(c, method)(path, json={"input": "x"}) if method == "post" else c.get(path), 401)
            assert e["type"] == "authentication_error"
        _err(c.post("/v1/embeddings", json={"input": "x"}, headers={"Authorization": "Bearer wrong"}), 401)
        ok = c.post("/v1/embeddings", json={"input": "x"}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def test_ready_is_503_until_model_loaded(minilm_model):
    gate = threading.Event()

    def loader():
        gate.wait(10)
        return minilm_model

    app = build_app(ServerConfig.of(model=NAME), loader=loader)
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        r = c.get("/ready")
        assert r.status_code == 503 and "Retry-After" in r.headers
        e = _err(c.post("/v1/embeddings", json={"input": "x"}), 503)
        assert "loading" in e["message"]
        gate.set()
        for _ in range(200):
            if c.get("/ready").status_code == 200:
                break
            time.sleep(0.05)
        assert c.get("/ready").status_code == 200
        assert c.post("/v1/embeddings", json={"input": "x"}).status_code == 200


def test_overload_is_429_with_retry_after(minilm_model, monkeypatch):
    app = build_app(ServerConfig.of(model=NAME, max_concurrent_requests=1), model=minilm_model)
    real_embed = minilm_model.embed
    started = threading.Event()

    def slow_embed(batch, want):
        started.set()
        time.sleep(0.5)
        return real_embed(batch, want)

    with TestClient(app) as c:
        monkeypatch.setattr(minilm_model, "embed", slow_embed)
        t = threading.Thread(target=lambda: c.post("/v1/embeddings", json={"input": "slow"}))
        t.start()
        assert started.wait(5)
        r = c.post("/v1/embeddings", json={"input": "x"})
        t.join()
        e = _err(r, 429)
        assert int(r.headers["Retry-After"]) >= 1 and "max-concurrent-requests" in e["message"]


def test_impossible_settings_fail_at_start_up(minilm_model):
    with pytest.raises(ConfigError, match="--max-batch-tokens"):
        ServerConfig.of(max_batch_tokens=256).embed.input_limit(512)
    with pytest.raises(ConfigError, match="--max-queued-tokens"):
        ServerConfig.of(max_batch_tokens=1024, max_queued_tokens=512)
    with pytest.raises(ConfigError, match="--max-input-length 600"):
        ServerConfig.of(max_input_length=600).embed.input_limit(512)


def test_embeddings_are_answered_without_fastapis_router(minilm_model, monkeypatch):
    """POST /v1/embeddings goes straight to its endpoint (api.direct): FastAPI's route handling is
    never entered, while every other route still is, and the guard, the metrics and /openapi.json
    see the route as before."""
    from fastapi.routing import APIRoute
    entered = []
    real_handle = APIRoute.handle

    async def spy(self, scope, receive, send):
        entered.append(self.path)
        return await real_handle(self, scope, receive, send)

    monkeypatch.setattr(APIRoute, "handle", spy)
    app = build_app(ServerConfig.of(model=NAME), model=minilm_model)
    with TestClient(app) as c:
        r = c.post("/v1/embeddings", json={"input": ["hello", "世界"], "model": NAME})
        assert r.status_code == 200 and len(r.json()["data"]) == 2
        _err(c.post("/v1/embeddings", json={"input": []}), 400)
        assert entered == []
        assert c.get("/v1/models").status_code == 200 and entered == ["/v1/models"]
        _err(c.get("/v1/embeddings"), 405)                       # other methods: FastAPI's answer
        metrics = c.get("/metrics").text
        assert 'embedserve_requests_total{route="/v1/embeddings",status="200"} 1.0' in metrics
        assert 'embedserve_requests_total{route="/v1/embeddings",status="400"} 1.0' in metrics
        assert "/v1/embeddings" in c.get("/openapi.json").json()["paths"]


def test_a_crash_in_a_direct_route_is_a_logged_500_in_the_envelope(minilm_model, monkeypatch, caplog):
    app = build_app(ServerConfig.of(model=NAME), model=minilm_model)
    with TestClient(app) as c:
        engine = app.state.embedserve.embedders[NAME]

        def broken(*a, **k):
            raise RuntimeError("tokenizer exploded")
        monkeypatch.setattr(engine, "tokenize", broken)
        with caplog.at_level("ERROR", logger="embedserve.api.app"):
            e = _err(c.post("/v1/embeddings", json={"input": "x"}), 500)
        assert e["message"] == "internal error; see the server log" and "exploded" not in e["message"]
        assert "unhandled error on POST /v1/embeddings" in caplog.text and "tokenizer exploded" in caplog.text
        assert 'embedserve_errors_total{type="server_error"} 1.0' in c.get("/metrics").text
