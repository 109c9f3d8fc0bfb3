"""`Client`: the embedserve API for scripts and ingestion jobs (httpx, no model runtime)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import httpx

from . import _core
from ._core import Embeddings, Limits, RetryPolicy
from .errors import error_from_response


class Client:
    """Talks to one embedserve server. Retries 429/503/connection errors with backoff (honouring
    `Retry-After`), never other 4xx; splits large inputs under the server's limits."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 120.0,
                 retry: RetryPolicy | None = None, max_concurrency: int = 4,
                 transport: httpx.BaseTransport | None = None):
        url, headers = _core.resolve(base_url, api_key)
        self.retry = retry or RetryPolicy()
        self.max_concurrency = max(1, max_concurrency)
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout, transport=transport)
        self._limits: Limits | None = None

    # ---------------------------------------------------------------- plumbing
    def request(self, method: str, path: str, json: dict | None = None) -> dict:
        """One API call with retries; the parsed JSON body, or a typed error."""
        attempt = 0
        while True:
            try:
                r = self._http.request(method, path, json=json)
                if r.status_code < 400:
                    return r.json()
                error = error_from_response(r.status_code, r.content, r.headers)
            except httpx.TransportError as exc:          # timeouts included
                error = _core.transport_error(method, path, exc)
            attempt += 1
            wait = self.retry.delay(attempt, error)
            if wait is None:
                raise error
            time.sleep(wait)

    def limits(self) -> Limits:
        """The server's limits (read once from GET /v1/models)."""
        if self._limits is None:
            self._limits = Limits.from_models(self.models())
        return self._limits

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- API
    def health(self) -> dict:
        return self.request("GET", "/health")

    def ready(self) -> bool:
        """True once the server's models are loaded (503 while loading is not an error here)."""
        try:
            return self._http.get("/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def models(self) -> dict:
        return self.request("GET", "/v1/models")

    def embed(self, texts: str | list[str], *, model: str | None = None, input_type: str | None = None,
              embedding_types: list[str] | None = None, truncate: bool = False,
              prompt_name: str | None = None, truncation_direction: str | None = None) -> Embeddings:
        """Embed `texts`, split into several requests under the server's limits (sent with bounded
        concurrency) and reassembled in order."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        ranges = _core.split(texts, self.limits(), size_of=_core.json_size)

        def send(rng):
            body = _core.embed_body(texts[rng[0]:rng[1]], model, input_type, embedding_types, truncate,
                                    {"prompt_name": prompt_name, "truncation_direction": truncation_direction})
            return rng[0], self.request("POST", "/v1/embeddings", body)

        return _core.parse_embeddings(self._send_all(send, ranges), len(texts))

    def rerank(self, query: str, documents: list, *, model: str | None = None, top_n: int | None = None,
               return_documents: bool = False, raw_scores: bool = False, **extra) -> list[dict]:
        """`documents` (strings or `{"text": ...}` objects) ranked against `query`, best first:
        `[{index, relevance_score, document?}]`. Split into several requests under the server's
        limits (each pair scores on its own, so the split changes no score) and merged."""
        documents = list(documents)
        ranges = _core.split(documents, self.limits(), size_of=_core.json_size)

        def send(rng):
            body = _core.rerank_body(query, documents[rng[0]:rng[1]], model, raw_scores, extra)
            return rng[0], self.request("POST", "/v1/rerank", body)

        return _core.merge_rerank(self._send_all(send, ranges), documents, top_n, return_documents)

    def _send_all(self, send, ranges: list[tuple[int, int]]) -> list:
        """`send` over every range, with bounded concurrency when there are several."""
        if len(ranges) == 1:
            return [send(ranges[0])]
        with ThreadPoolExecutor(min(self.max_concurrency, len(ranges))) as pool:
            return list(pool.map(send, ranges))

    def tokenize(self, text: str, *, model: str | None = None, **fields) -> dict:
        """The served model's tokens of `text` (POST /tokenize): `{tokens, count, max_model_len, ...}`,
        for chunking documents by tokens without loading the tokenizer here."""
        return self.request("POST", "/tokenize", {"prompt": text, "model": model, **fields})

    def index(self, name: str) -> "Index":
        return Index(self, name)

    def chat(self, messages: list[dict], *, model: str | None = None, **params) -> dict:
        """A chat completion (OpenAI's response object as a dict)."""
        return self.request("POST", "/v1/chat/completions", {"messages": messages, "model": model, **params})

    def chat_stream(self, messages: list[dict], *, model: str | None = None, **params) -> Iterator[str]:
        """The answer's text as it is generated (SSE); connection errors before the first byte retry."""
        body = {"messages": messages, "model": model, "stream": True, **params}
        with self._http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code >= 400:
                r.read()
                raise error_from_response(r.status_code, r.content, r.headers)
            for event in _core.sse_events(r.iter_lines()):
                for choice in event.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        yield text

    def ingest(self, index: str, documents, **kw):
        """Upsert documents (an iterable or a JSONL path) into `index`: see `embedserve.client.ingest`."""
        from .ingest import ingest
        return ingest(self, index, documents, **kw)


class Index:
    """One named index on the server."""

    def __init__(self, client: Client, name: str):
        self.client, self.name = client, name

    def create(self, *, dense: str = "flat", model: str | None = None, exist_ok: bool = False,
               sparse_model: str | None = None) -> dict:
        """Create the index bound to the served model; with `exist_ok`, an existing one is fine."""
        from .errors import ConflictError
        try:
            return self.client.request("POST", "/v1/indexes", {"name": self.name, "dense": dense, "model": model,
                                                           "sparse_model": sparse_model})
        except ConflictError as exc:
            if exist_ok and exc.code == "index_exists":
                return self.info()
            raise

    def info(self) -> dict:
        return self.client.request("GET", f"/v1/indexes/{self.name}")

    def upsert(self, documents: list) -> dict:
        """Insert or replace documents by id (idempotent: a retried batch never duplicates)."""
        docs = [_core.document_dict(d) for d in documents]
        return self.client.request("POST", f"/v1/indexes/{self.name}/documents", {"documents": docs})

    def delete(self, ids: list[str]) -> dict:
        return self.client.request("DELETE", f"/v1/indexes/{self.name}/documents", {"ids": list(ids)})

    def drop(self) -> dict:
        """Delete the whole index."""
        return self.client.request("DELETE", f"/v1/indexes/{self.name}")

    def search(self, query: str, *, top_k: int = 10, mode: str = "dense", filters: dict | None = None,
               fusion: str | None = None, rerank: bool | str | dict | None = None,
               prompt_name: str | None = None) -> list[dict]:
        """The best `top_k` hits; `rerank` (True, a model name, or `{"model", "candidates"}`)
        retrieves more candidates and reranks them on the server."""
        body = _core.search_body(self.name, query, top_k, mode, filters, fusion, rerank, prompt_name)
        return self.client.request("POST", "/v1/search", body)["data"]
