"""`embedserve.client` against the real server (the session's `server` fixture): same vectors as
the server's own answer, large inputs split and reassembled in order, retries only where a
retry can help, idempotent resumable ingestion, and an import that loads no model runtime."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import numpy as np
import pytest

from embedserve.client import (AsyncClient, BadRequestError, Client, ConflictError, RateLimitError,
                               RetryPolicy)
from embedserve.client import sync as client_sync
from index.manifest import DenseConfig, ModelIdentity
from index.store import IndexStore

from helpers import TEXTS_EN_ZH_FR

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(server):
    with Client(server, max_concurrency=2) as c:
        yield c


def test_import_loads_no_model_runtime():
    code = ("import sys, embedserve.client; heavy = [m for m in ('torch', 'transformers', 'faiss', 'tokenizers', "
            "'fastapi', 'sentence_transformers', 'index', 'embedserve.engine') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_embeddings_equal_the_servers_own_answer(client, server):
    direct = httpx.post(server + "/v1/embeddings", json={"input": TEXTS_EN_ZH_FR, "input_type": "query"},
                        timeout=60).json()
    got = client.embed(TEXTS_EN_ZH_FR, input_type="query")
    np.testing.assert_array_equal(got.dense, np.array([d["embedding"] for d in direct["data"]], dtype=np.float32))
    assert got.prompt_tokens == direct["usage"]["prompt_tokens"] and got.model == direct["model"]


def test_ten_thousand_texts_are_split_and_come_back_in_order(client, server):
    texts = [f"item {i}" for i in range(10_000)]
    assert 10_000 > client.limits().max_client_batch_size          # it must split
    got = client.embed(texts)
    assert got.dense.shape[0] == 10_000
    pick = [0, 1, 2047, 2048, 4321, 9999]
    direct = httpx.post(server + "/v1/embeddings", json={"input": [texts[i] for i in pick]}, timeout=60).json()
    np.testing.assert_allclose(got.dense[pick], np.array([d["embedding"] for d in direct["data"]]), atol=1e-6)


def test_async_client_gives_the_same_vectors(client, server):
    async def run():
        async with AsyncClient(server) as ac:
            return await ac.embed(TEXTS_EN_ZH_FR)
    np.testing.assert_array_equal(asyncio.run(run()).dense, client.embed(TEXTS_EN_ZH_FR).dense)


def _stub(statuses: list[tuple[int, dict]], calls: list):
    """A transport answering with `statuses` in turn (then 200s), for the retry sequence only."""
    body = {"object": "list", "model": "m", "usage": {"prompt_tokens": 3, "total_tokens": 3},
            "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}]}

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": []})
        if statuses:
            status, headers = statuses.pop(0)
            return httpx.Response(status, headers=headers,
                                  json={"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                                                  "code": "overloaded"}})
        return httpx.Response(200, json=body)
    return httpx.MockTransport(handle)


def test_429_then_200_is_retried_with_backoff_honouring_retry_after(monkeypatch):
    slept, calls = [], []
    monkeypatch.setattr(client_sync.time, "sleep", slept.append)
    c = Client("http://stub", transport=_stub([(429, {"Retry-After": "2"}), (503, {}), (429, {})], calls),
               retry=RetryPolicy(max_retries=5, base_delay=0.1))
    got = c.embed("x")
    assert calls.count("/v1/embeddings") == 4 and got.dense.tolist() == [[pytest.approx(0.6), pytest.approx(0.8)]]
    assert slept[0] >= 2 and all(0 <= s <= 30 for s in slept) and len(slept) == 3
    slept.clear()
    c = Client("http://stub", transport=_stub([(429, {})] * 10, calls), retry=RetryPolicy(max_retries=2, base_delay=0.01))
    with pytest.raises(RateLimitError) as exc:
        c.embed("x")
    assert exc.value.code == "overloaded" and len(slept) == 2


def test_400_raises_at_once_with_the_servers_message(server):
    sent = []

    class Counting(httpx.HTTPTransport):
        def handle_request(self, request):
            sent.append(request.url.path)
            return super().handle_request(request)

    with Client(server, transport=Counting()) as c:
        with pytest.raises(BadRequestError) as exc:
            c.embed(["ok", ""])
    assert sent.count("/v1/embeddings") == 1
    assert exc.value.status == 400 and "input 1 is an empty string" in exc.value.message and exc.value.param == "input"


def test_interrupted_ingest_resumes_and_every_document_is_there_once(client):
    docs = [{"id": f"doc-{i}", "text": f"Document {i} talks about topic {i % 7} in a few words."} for i in range(230)]
    seen = []

    def stop_after_two(summary):
        seen.append(summary.next_offset)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as exc:
        client.ingest("resume", docs, max_docs=50, on_batch=stop_after_two)
    assert exc.value.next_offset == 100
    rest = client.ingest("resume", docs, start=exc.value.next_offset, max_docs=50)
    assert rest.sent == 130 and rest.added == 130 and rest.next_offset == 230 and not rest.failed
    assert client.index("resume").info()["live_counts"]["documents"] == 230
    again = client.ingest("resume", docs, max_docs=100)           # idempotent by id: nothing duplicated
    assert again.unchanged == 230 and again.added == 0
    assert client.index("resume").info()["live_counts"]["documents"] == 230
    hits = client.index("resume").search("Document 17", top_k=3)
    assert hits and hits[0]["id"].startswith("doc-")


def test_ingest_records_a_refused_batch_and_goes_on(client):
    docs = [{"id": "a", "text": "fine"}, {"id": "b", "text": "   "}, {"id": "c", "text": "also fine"}]
    summary = client.ingest("partial", docs, max_docs=1)
    assert summary.sent == 3 and summary.added == 2
    assert summary.failed == [{"offset": 1, "ids": ["b"], "reason": summary.failed[0]["reason"]}]
    assert "text" in summary.failed[0]["reason"]


def test_ingest_checks_the_manifest_before_sending(client, server_index_dir):
    other = ModelIdentity(model="some-other-model", fingerprint="0" * 64, dimension=8, normalize=True,
                          pooling="mean", query_prefix="", passage_prefix="", has_sparse=False)
    IndexStore(server_index_dir).create("foreign", other, DenseConfig()).close()
    with pytest.raises(ConflictError) as exc:
        client.ingest("foreign", [{"id": "x", "text": "never sent"}])
    assert "some-other-model" in exc.value.message
    assert client.index("foreign").info()["live_counts"]["documents"] == 0


def test_chat_and_streaming(client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat(msgs, max_tokens=12, temperature=0)["choices"][0]["message"]["content"]
    streamed = "".join(client.chat_stream(msgs, max_tokens=12, temperature=0))
    assert whole and streamed == whole


def test_cli_index_add_goes_through_the_client(client, server, tmp_path, capsys):
    from embedserve.cli import main
    path = tmp_path / "docs.jsonl"
    path.write_text('{"id": "x1", "text": "The Danube flows through Vienna."}\n'
                    '{"id": "x2", "text": "长江流经上海。", "metadata": {"lang": "zh"}}\n', encoding="utf-8")
    assert main(["index", "add", "via-cli", str(path), "--server", server]) == 0
    out = capsys.readouterr().out
    assert '"added": 2' in out and '"next_offset": 2' in out
    assert client.index("via-cli").search("Shanghai river", top_k=1)[0]["id"] == "x2"
