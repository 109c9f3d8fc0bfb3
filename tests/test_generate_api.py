"""/v1/completions and /v1/chat/completions in-process: OpenAI shapes, SSE framing, sampling
controls, errors, and abort freeing blocks."""

import json
import time

import pytest
from fastapi.testclient import TestClient

from embedserve.serve import build_app
from embedserve.engine.generator import Generator
from embedserve.config import ServerConfig
from embedserve.engine.sequence import SamplingParams

from helpers import make_decode_engine

GEN = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def gen_client(smollm2, minilm_model):
    eng = make_decode_engine(smollm2, num_blocks=256, max_model_len=1024)
    gen = Generator(name=GEN, engine=eng, tokenizer=smollm2[1])
    app = build_app(ServerConfig.of(model="all-MiniLM-L6-v2"), model=minilm_model, generator=gen)
    with TestClient(app) as c:
        yield c, eng


def _err(r, status):
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_chat_completion_shape_and_usage(gen_client):
    c, _ = gen_client
    r = c.post("/v1/chat/completions", json={"model": GEN, "messages": [{"role": "user", "content": "Say hi."}],
                                             "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["object"] == "chat.completion" and b["id"].startswith("chatcmpl-") and b["model"] == GEN
    ch = b["choices"][0]
    assert ch["message"]["role"] == "assistant" and isinstance(ch["message"]["content"], str)
    assert ch["finish_reason"] in ("stop", "length")
    u = b["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["completion_tokens"] <= 8
    assert "cached_tokens" in u["prompt_tokens_details"]


def test_completion_stream_is_sse_ending_with_done(gen_client):
    c, _ = gen_client
    with c.stream("POST", "/v1/completions", json={"model": GEN, "prompt": "Once upon a time", "max_tokens": 12,
                                                   "temperature": 0, "stream": True, "ignore_eos": True,
                                                   "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [l for l in r.iter_lines() if l]
    assert all(l.startswith("data: ") for l in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(l[6:]) for l in lines[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(ch["choices"][0]["text"] for ch in chunks[:-1])
    full = c.post("/v1/completions", json={"model": GEN, "prompt": "Once upon a time", "max_tokens": 12,
                                           "temperature": 0, "ignore_eos": True}).json()
    assert text == full["choices"][0]["text"], "streamed text must equal the non-streamed text"


def test_stop_string_cuts_output(gen_client):
    c, _ = gen_client
    base = c.post("/v1/completions", json={"prompt": "1, 2, 3, 4, 5,", "max_tokens": 12, "temperature": 0}).json()
    text = base["choices"][0]["text"]
    assert "7" in text
    cut = c.post("/v1/completions", json={"prompt": "1, 2, 3, 4, 5,", "max_tokens": 12, "temperature": 0,
                                          "stop": ["7"]}).json()
    assert cut["choices"][0]["text"] == text[:text.index("7")]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_seed_reproducible_and_temperature_varies(gen_client):
    c, _ = gen_client
    body = {"prompt": "My favourite colour is", "max_tokens": 10, "temperature": 1.0, "top_p": 0.95,
            "top_k": 50, "ignore_eos": True}
    a = c.post("/v1/completions", json={**body, "seed": 7}).json()["choices"][0]["text"]
    b = c.post("/v1/completions", json={**body, "seed": 7}).json()["choices"][0]["text"]
    assert a == b
    others = {c.post("/v1/completions", json={**body, "seed": s}).json()["choices"][0]["text"] for s in range(1, 6)}
    assert len(others) > 1


@pytest.mark.parametrize("path,payload,status,needle", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "1024"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n > 1"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": [1, 999999]}, 400, "999999"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/chat/completions", {"messages": []}, 400, "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "image_url"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
])
def test_generation_errors(gen_client, path, payload, status, needle):
    c, _ = gen_client
    e = _err(c.post(path, json=payload), status)
    assert needle in e["message"]


def test_prompt_over_max_model_len_names_both_numbers(gen_client):
    c, _ = gen_client
    e = _err(c.post("/v1/completions", json={"prompt": "word " * 1000, "max_tokens": 100}), 400)
    assert "1100" in e["message"] or "> --max-model-len 1024" in e["message"]


def test_abort_frees_blocks(gen_client):
    c, eng = gen_client
    events = []
    sid = eng.add(c.app.state.embedserve.generator.tokenizer("Tell me a long story").input_ids,
                  SamplingParams(temperature=0, max_tokens=500, ignore_eos=True), events.append)
    deadline = time.time() + 30
    while not events and time.time() < deadline:
        time.sleep(0.05)
    eng.abort(sid)
    while eng.bm.num_free_blocks != eng.bm.num_blocks and time.time() < deadline:
        time.sleep(0.05)
    assert eng.bm.num_free_blocks == eng.bm.num_blocks
    assert not any(ev.finish_reason for ev in events)


def test_generation_overload_is_429_with_retry_after(gen_client):
    c, eng = gen_client
    saved = eng._num_active
    eng._num_active = 4 * eng.config.max_num_seqs          # as if that many were in flight
    try:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        e = _err(r, 429)
        assert int(r.headers["Retry-After"]) >= 1 and "--max-num-seqs" in e["message"]
    finally:
        eng._num_active = saved
    assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
