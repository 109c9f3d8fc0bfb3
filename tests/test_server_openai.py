"""The real server (uvicorn on a free port, the default bundled model) used through the
unmodified `openai` SDK and concurrent raw HTTP clients."""

import asyncio
import base64
import time

import httpx
import numpy as np
import openai
import pytest

from helpers import TEXTS_EN_ZH_FR

pytestmark = pytest.mark.slow
MODEL = "multilingual-e5-small"


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def _ref(e5_model, texts):
    outs, _ = e5_model.embed(e5_model.tokenize(texts), {"dense"})
    return np.stack([o.dense for o in outs])


def test_sdk_one_string(sdk, e5_model):
    r = sdk.embeddings.create(model=MODEL, input="北京是中华人民共和国的首都。")
    assert r.model == MODEL and len(r.data) == 1 and r.data[0].index == 0
    np.testing.assert_allclose(r.data[0].embedding, _ref(e5_model, ["北京是中华人民共和国的首都。"])[0], atol=1e-5)
    assert r.usage.prompt_tokens == r.usage.total_tokens > 0


def test_sdk_list_float_and_base64(sdk, e5_model):
    ref = _ref(e5_model, TEXTS_EN_ZH_FR)
    f = sdk.embeddings.create(model=MODEL, input=TEXTS_EN_ZH_FR, encoding_format="float")
    # Left unset, the SDK asks for base64 itself and decodes it to floats.
    d = sdk.embeddings.create(model=MODEL, input=TEXTS_EN_ZH_FR)
    for resp in (f, d):
        assert [x.index for x in resp.data] == list(range(len(TEXTS_EN_ZH_FR)))
        np.testing.assert_allclose(np.array([x.embedding for x in resp.data]), ref, atol=1e-5)
    # Asked explicitly, the SDK hands back the base64 strings: little-endian float32.
    b = sdk.embeddings.create(model=MODEL, input=TEXTS_EN_ZH_FR, encoding_format="base64")
    got = np.stack([np.frombuffer(base64.b64decode(x.embedding), dtype="<f4") for x in b.data])
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_sdk_errors_raise_typed_exceptions(sdk):
    with pytest.raises(openai.NotFoundError):
        sdk.embeddings.create(model="text-embedding-3-small", input="x")
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.embeddings.create(model=MODEL, input="")
    assert "empty" in str(exc.value)
    with pytest.raises(openai.BadRequestError):
        sdk.embeddings.create(model=MODEL, input="x", dimensions=64)


def test_sdk_extensions_through_extra_body(sdk, e5_model):
    q = sdk.embeddings.create(model=MODEL, input="how much protein per day",
                              extra_body={"input_type": "query"})
    ref = _ref(e5_model, ["query: how much protein per day"])[0]
    np.testing.assert_allclose(q.data[0].embedding, ref, atol=1e-5)


def test_64_concurrent_requests_of_mixed_sizes_get_their_own_vectors(server, e5_model):
    rng = np.random.default_rng(0)
    pool = TEXTS_EN_ZH_FR + [f"document number {i} " * int(rng.integers(1, 60)) for i in range(40)]
    requests = [[pool[int(j)] for j in rng.integers(0, len(pool), size=int(rng.integers(1, 12)))]
                for _ in range(64)]
    ref = {t: v for t, v in zip(pool, _ref(e5_model, pool))}

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=120) as c:
            return await asyncio.gather(*[c.post("/v1/embeddings", json={"input": texts, "model": MODEL})
                                          for texts in requests])

    responses = asyncio.run(run())
    for texts, resp in zip(requests, responses):
        assert resp.status_code == 200, resp.text
        data = resp.json()["data"]
        assert [d["index"] for d in data] == list(range(len(texts)))
        for t, d in zip(texts, data):
            assert float(np.dot(d["embedding"], ref[t])) >= 0.9999
    metrics = httpx.get(server + "/metrics").text
    batches = [l for l in metrics.splitlines() if l.startswith("embedserve_embed_batch_size_inputs_count")]
    n_batches = float(batches[0].split()[-1])
    assert n_batches < sum(map(len, requests)), "concurrent inputs should share batches"


def test_client_that_goes_away_has_its_inputs_dropped(server):
    """Requests whose clients time out are dropped from the queue, not embedded."""
    def dropped():
        for line in httpx.get(server + "/metrics").text.splitlines():
            if line.startswith("embedserve_embed_dropped_inputs_total"):
                return float(line.split()[-1])
        return 0.0

    before = dropped()
    texts = [f"a fairly long passage number {i} " * 20 for i in range(120)]

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=0.3) as c:
            return await asyncio.gather(*[c.post("/v1/embeddings", json={"input": texts}) for _ in range(3)],
                                        return_exceptions=True)

    results = asyncio.run(run())
    assert all(isinstance(r, httpx.TimeoutException) for r in results)
    deadline = time.time() + 60
    while time.time() < deadline and dropped() <= before:
        time.sleep(0.2)
    assert dropped() > before
    # and the server is still serving
    assert httpx.post(server + "/v1/embeddings", json={"input": "still here"}, timeout=60).status_code == 200


GEN = "SmolLM2-135M-Instruct"


def _metric(server, name):
    for line in httpx.get(server + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def test_sdk_streams_a_chat_completion(sdk):
    stream = sdk.chat.completions.create(
        model=GEN, messages=[{"role": "system", "content": "Answer in one short sentence."},
                             {"role": "user", "content": "What is the capital of France?"}],
        max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    text = "".join(parts)
    assert "Paris" in text
    assert finish in ("stop", "length") and usage.completion_tokens > 0
    again = sdk.chat.completions.create(
        model=GEN, messages=[{"role": "system", "content": "Answer in one short sentence."},
                             {"role": "user", "content": "What is the capital of France?"}],
        max_tokens=40, temperature=0)
    assert again.choices[0].message.content == text
    assert again.usage.prompt_tokens_details.cached_tokens > 0, "the repeated prompt should hit the prefix cache"


def test_client_leaving_mid_stream_frees_its_blocks(server):
    with httpx.stream("POST", server + "/v1/completions", timeout=60,
                      json={"model": GEN, "prompt": "Write a very long story about a dragon.", "max_tokens": 1500,
                            "ignore_eos": True, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break                                   # hang up mid-stream
    deadline = time.time() + 30
    while time.time() < deadline and _metric(server, "embedserve_gen_kv_cache_usage") != 0.0:
        time.sleep(0.2)
    assert _metric(server, "embedserve_gen_kv_cache_usage") == 0.0
    assert _metric(server, "embedserve_gen_requests_running") == 0.0
