"""`AsyncClient`: the same API as `Client` for asyncio code (same retries and splitting)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import httpx

from . import _core
from ._core import Embeddings, Limits, RetryPolicy
from .errors import ConflictError, error_from_response


class AsyncClient:
    """Async twin of `embedserve.client.Client`."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 120.0,
                 retry: RetryPolicy | None = None, max_concurrency: int = 4,
                 transport: httpx.AsyncBaseTransport | None = None):
        url, headers = _core.resolve(base_url, api_key)
        self.retry = retry or RetryPolicy()
        self.max_concurrency = max(1, max_concurrency)
        self._http = httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, transport=transport)
        self._limits: Limits | None = None

    async def request(self, method: str, path: str, json: dict | None = None) -> dict:
        attempt = 0
        while True:
            try:
                r = await self._http.request(method, path, json=json)
                if r.status_code < 400:
                    return r.json()
                error = error_from_response(r.status_code, r.content, r.headers)
            except httpx.TransportError as exc:          # timeouts included
                error = _core.transport_error(method, path, exc)
            attempt += 1
            wait = self.retry.delay(attempt, error)
            if wait is None:
                raise error
            await asyncio.sleep(wait)

    async def limits(self) -> Limits:
        if self._limits is None:
            self._limits = Limits.from_models(await self.models())
        return self._limits

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    async def health(self) -> dict:
        return await self.request("GET", "/health")

    async def ready(self) -> bool:
        try:
            return (await self._http.get("/ready")).status_code == 200
        except httpx.HTTPError:
            return False

    async def models(self) -> dict:
        return await self.request("GET", "/v1/models")

    async def embed(self, texts: str | list[str], *, model: str | None = None, input_type: str | None = None,
                    embedding_types: list[str] | None = None, truncate: bool = False,
                    prompt_name: str | None = None, truncation_direction: str | None = None) -> Embeddings:
        texts = [texts] if isinstance(texts, str) else list(texts)
        ranges = _core.split(texts, await self.limits(), size_of=_core.json_size)
        gate = asyncio.Semaphore(self.max_concurrency)

        async def send(rng):
            async with gate:
                body = _core.embed_body(texts[rng[0]:rng[1]], model, input_type, embedding_types, truncate,
                                        {"prompt_name": prompt_name, "truncation_direction": truncation_direction})
                return rng[0], await self.request("POST", "/v1/embeddings", body)

        parts = await asyncio.gather(*(send(r) for r in ranges))
        return _core.parse_embeddings(list(parts), len(texts))

    async def rerank(self, query: str, documents: list, *, model: str | None = None, top_n: int | None = None,
                     return_documents: bool = False, raw_scores: bool = False, **extra) -> list[dict]:
        """`Client.rerank`, awaited (the slices sent concurrently)."""
        documents = list(documents)
        ranges = _core.split(documents, await self.limits(), size_of=_core.json_size)
        gate = asyncio.Semaphore(self.max_concurrency)

        async def send(rng):
            async with gate:
                body = _core.rerank_body(query, documents[rng[0]:rng[1]], model, raw_scores, extra)
                return rng[0], await self.request("POST", "/v1/rerank", body)

        parts = await asyncio.gather(*(send(r) for r in ranges))
        return _core.merge_rerank(list(parts), documents, top_n, return_documents)

    async def tokenize(self, text: str, *, model: str | None = None, **fields) -> dict:
        return await self.request("POST", "/tokenize", {"prompt": text, "model": model, **fields})

    def index(self, name: str) -> "AsyncIndex":
        return AsyncIndex(self, name)

    async def chat(self, messages: list[dict], *, model: str | None = None, **params) -> dict:
        return await self.request("POST", "/v1/chat/completions", {"messages": messages, "model": model, **params})

    async def chat_stream(self, messages: list[dict], *, model: str | None = None, **params) -> AsyncIterator[str]:
        body = {"messages": messages, "model": model, "stream": True, **params}
        async with self._http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code >= 400:
                await r.aread()
                raise error_from_response(r.status_code, r.content, r.headers)
            async for line in r.aiter_lines():
                for event in _core.sse_events([line]):
                    for choice in event.get("choices", []):
                        text = choice.get("delta", {}).get("content")
                        if text:
                            yield text


class AsyncIndex:
    """One named index on the server (async)."""

    def __init__(self, client: AsyncClient, name: str):
        self.client, self.name = client, name

    async def create(self, *, dense: str = "flat", model: str | None = None, exist_ok: bool = False,
                     sparse_model: str | None = None) -> dict:
        try:
            return await self.client.request("POST", "/v1/indexes", {"name": self.name, "dense": dense, "model": model,
                                                           "sparse_model": sparse_model})
        except ConflictError as exc:
            if exist_ok and exc.code == "index_exists":
                return await self.info()
            raise

    async def info(self) -> dict:
        return await self.client.request("GET", f"/v1/indexes/{self.name}")

    async def upsert(self, documents: list) -> dict:
        docs = [_core.document_dict(d) for d in documents]
        return await self.client.request("POST", f"/v1/indexes/{self.name}/documents", {"documents": docs})

    async def delete(self, ids: list[str]) -> dict:
        return await self.client.request("DELETE", f"/v1/indexes/{self.name}/documents", {"ids": list(ids)})

    async def search(self, query: str, *, top_k: int = 10, mode: str = "dense", filters: dict | None = None,
                     fusion: str | None = None, rerank: bool | str | dict | None = None,
                     prompt_name: str | None = None) -> list[dict]:
        body = _core.search_body(self.name, query, top_k, mode, filters, fusion, rerank, prompt_name)
        return (await self.client.request("POST", "/v1/search", body))["data"]
