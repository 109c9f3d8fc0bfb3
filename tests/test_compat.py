"""The ecosystem's own clients, unmodified, against the real server, using only the public
`base_url` and `api_key`: the openai SDK (sync and async) and LangChain's OpenAI classes."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest

from helpers import TEXTS_EN_ZH_FR

pytestmark = pytest.mark.slow
EMBED, CHAT = "multilingual-e5-small", "SmolLM2-135M-Instruct"


def _direct(server, texts):
    import httpx
    body = httpx.post(server + "/v1/embeddings", json={"input": texts}, timeout=60).json()
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32)


def test_async_sdk_embeddings_float_and_base64_and_chat_stream(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
        f = await client.embeddings.create(model=EMBED, input=TEXTS_EN_ZH_FR, encoding_format="float")
        b = await client.embeddings.create(model=EMBED, input=TEXTS_EN_ZH_FR, encoding_format="base64")
        stream = await client.chat.completions.create(
            model=CHAT, stream=True, max_tokens=12, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.close()
        return f, b, text

    f, b, text = asyncio.run(run())
    ref = _direct(server, TEXTS_EN_ZH_FR)
    np.testing.assert_allclose(np.array([d.embedding for d in f.data]), ref, atol=1e-6)
    got = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in b.data])
    np.testing.assert_allclose(got, ref, atol=1e-6)
    assert text.strip()


def test_langchain_embeddings_and_streaming_chat(server):
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    # check_embedding_ctx_length=False: otherwise LangChain tokenizes with tiktoken and sends
    # token ids of OpenAI's vocabulary, which this server would embed as its own model's ids.
    emb = OpenAIEmbeddings(model=EMBED, base_url=server + "/v1", api_key="unused",
                           check_embedding_ctx_length=False)
    docs = emb.embed_documents(TEXTS_EN_ZH_FR)
    np.testing.assert_allclose(np.array(docs), _direct(server, TEXTS_EN_ZH_FR), atol=1e-5)
    q = emb.embed_query("北京是中华人民共和国的首都。")
    assert len(q) == 384 and abs(np.linalg.norm(q) - 1) < 1e-4
    chat = ChatOpenAI(model=CHAT, base_url=server + "/v1", api_key="unused", temperature=0, max_tokens=12)
    parts = [chunk.content for chunk in chat.stream("What is the capital of France?")]
    assert len(parts) > 1 and "".join(parts).strip()
