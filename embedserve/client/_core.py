"""What the sync and async clients share: retry decisions, request splitting under the
server's limits, and response parsing. No I/O here."""

from __future__ import annotations

import base64
import json
import os
import random
from dataclasses import dataclass, field

import numpy as np

from .errors import APIStatusError, RateLimitError, ServiceUnavailableError

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
ENV_API_KEY = "EMBEDSERVE_API_KEY"
ENV_BASE_URL = "EMBEDSERVE_URL"


def transport_error(method: str, path: str, exc: Exception) -> Exception:
    """A connection-level failure as the client's own (retryable) error."""
    from .errors import APIConnectionError, APITimeoutError
    import httpx
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"{method} {path}: no answer in time ({exc})")
    return APIConnectionError(f"{method} {path}: {exc}")


def resolve(base_url: str | None, api_key: str | None) -> tuple[str, dict]:
    """The server's root URL (a trailing /v1 is accepted) and the request headers."""
    url = (base_url or os.environ.get(ENV_BASE_URL) or DEFAULT_BASE_URL).rstrip("/")
    url = url[:-3] if url.endswith("/v1") else url
    key = api_key if api_key is not None else os.environ.get(ENV_API_KEY)
    headers = {"User-Agent": "embedserve-client"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return url, headers


@dataclass(slots=True)
class RetryPolicy:
    """Exponential backoff with full jitter on 429, 503 and connection errors; a server's
    `Retry-After` is honoured as a lower bound. Other errors are raised at once."""

    max_retries: int = 5
    base_delay: float = 0.5
    max_delay: float = 30.0

    def delay(self, attempt: int, error: Exception) -> float | None:
        """Seconds to wait before retry number `attempt` (1-based), or None: raise `error`."""
        if attempt > self.max_retries:
            return None
        if isinstance(error, APIStatusError) and not isinstance(error, (RateLimitError, ServiceUnavailableError)):
            return None
        backoff = random.uniform(0, min(self.max_delay, self.base_delay * 2 ** (attempt - 1)))
        after = getattr(error, "retry_after", None) or 0.0
        return min(self.max_delay, max(backoff, after))


@dataclass(slots=True)
class Limits:
    """The server's request limits, read from GET /v1/models (defaults if it does not say)."""

    max_client_batch_size: int = 2048
    max_queued_tokens: int = 262_144
    max_body_bytes: int = 2 * 1024 * 1024

    @classmethod
    def from_models(cls, models: dict) -> "Limits":
        for m in models.get("data", []):
            if "limits" in m:
                lim = m["limits"]
                return cls(max_client_batch_size=lim.get("max_client_batch_size", 2048),
                           max_queued_tokens=lim.get("max_queued_tokens", 262_144),
                           max_body_bytes=lim.get("max_body_bytes", 2 * 1024 * 1024))
        return cls()


def estimate_tokens(text: str) -> int:
    """An upper-leaning guess without the tokenizer: ~1 token per 3 UTF-8 bytes, plus specials."""
    return len(text.encode("utf-8")) // 3 + 3


class Budget:
    """One request's room under every limit: item count, JSON body bytes (with room for the
    envelope), and a quarter of the server's token queue (so others still get in)."""

    def __init__(self, limits: Limits, max_items: int | None = None):
        self.max_items = min(max_items or limits.max_client_batch_size, limits.max_client_batch_size)
        self.max_bytes = int(limits.max_body_bytes * 0.9) - 1024
        self.max_tokens = max(1, limits.max_queued_tokens // 4)
        self.items = self.bytes = self.tokens = 0

    def take(self, nbytes: int, ntokens: int) -> bool:
        """Count one more item in; False (and nothing counted) if it must start a new request
        (a first item always fits)."""
        if self.items and (self.items >= self.max_items or self.bytes + nbytes > self.max_bytes
                           or self.tokens + ntokens > self.max_tokens):
            return False
        self.items, self.bytes, self.tokens = self.items + 1, self.bytes + nbytes, self.tokens + ntokens
        return True

    def reset(self) -> None:
        self.items = self.bytes = self.tokens = 0


def split(items: list, limits: Limits, size_of=len, tokens_of=estimate_tokens,
          max_items: int | None = None) -> list[tuple[int, int]]:
    """[start, end) ranges of `items`, each under every limit (`Budget`)."""
    budget, ranges, start = Budget(limits, max_items), [], 0
    for i, item in enumerate(items):
        b, t = size_of(item) + 8, tokens_of(item)
        if not budget.take(b, t):
            ranges.append((start, i))
            start = i
            budget.reset()
            budget.take(b, t)
    if start < len(items):
        ranges.append((start, len(items)))
    return ranges


def json_size(obj) -> int:
    return len(json.dumps(obj, ensure_ascii=False).encode("utf-8"))


@dataclass(slots=True)
class Embeddings:
    """`embed()`'s result, in input order: dense (n, d) float32, sparse {token id: weight} per
    input, ColBERT (tokens, d) per input — each None unless requested."""

    dense: np.ndarray | None = None
    sparse: list[dict[int, float]] | None = None
    colbert: list[np.ndarray] | None = None
    prompt_tokens: int = 0
    model: str = ""
    truncated: list[int] = field(default_factory=list)


def parse_embeddings(parts: list[tuple[int, dict]], n: int) -> Embeddings:
    """Reassemble the responses of split requests ((offset, body) pairs) into one result."""
    dense: list = [None] * n
    sparse: list = [None] * n
    colbert: list = [None] * n
    out = Embeddings()
    for offset, body in parts:
        out.model = body.get("model", out.model)
        usage = body.get("usage", {})
        out.prompt_tokens += usage.get("prompt_tokens", 0)
        out.truncated += [offset + i for i in usage.get("truncated_inputs", [])]
        for item in body["data"]:
            i = offset + item["index"]
            emb = item.get("embedding")
            if emb is not None:
                dense[i] = (np.frombuffer(base64.b64decode(emb), dtype="<f4") if isinstance(emb, str)
                            else np.asarray(emb, dtype=np.float32))
            if "sparse_embedding" in item:
                s = item["sparse_embedding"]
                sparse[i] = dict(zip(s["indices"], s["values"]))
            if "colbert_embedding" in item:
                colbert[i] = np.asarray(item["colbert_embedding"], dtype=np.float32)
    if any(v is not None for v in dense):
        out.dense = np.stack(dense)
    out.sparse = sparse if any(v is not None for v in sparse) else None
    out.colbert = colbert if any(v is not None for v in colbert) else None
    return out


def embed_body(texts: list[str], model: str | None, input_type: str | None,
               embedding_types: list[str] | None, truncate: bool, extra: dict | None = None) -> dict:
    """/v1/embeddings' body; `extra`: further fields (prompt_name, truncation_direction), None ones dropped."""
    body: dict = {"input": texts, "encoding_format": "base64", **{k: v for k, v in (extra or {}).items()
                                                                 if v is not None}}
    if model:
        body["model"] = model
    if input_type:
        body["input_type"] = input_type
    if embedding_types:
        body["embedding_types"] = list(embedding_types)
    if truncate:
        body["truncate"] = True
    return body


def document_dict(doc) -> dict:
    """A document from a dict ({id, text, metadata}) or a (id, text[, metadata]) tuple."""
    if isinstance(doc, dict):
        out = {"id": str(doc["id"]), "text": doc["text"]}
        if doc.get("metadata"):
            out["metadata"] = doc["metadata"]
        return out
    out = {"id": str(doc[0]), "text": doc[1]}
    if len(doc) > 2 and doc[2]:
        out["metadata"] = doc[2]
    return out


def sse_events(lines):
    """Parsed `data:` payloads of an SSE stream until `[DONE]`."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            return
        yield json.loads(data)


def search_body(index: str, query: str, top_k: int, mode: str, filters: dict | None, fusion: str | None,
                rerank: bool | str | dict | None = None, prompt_name: str | None = None) -> dict:
    """/v1/search's body; `rerank`: True (the server's default reranker), a model name, or the
    whole `{"model", "candidates"}` object."""
    body = {"index": index, "query": query, "top_k": top_k, "mode": mode}
    if filters:
        body["filter"] = filters
    if fusion:
        body["fusion"] = fusion
    if rerank:
        body["rerank"] = {} if rerank is True else {"model": rerank} if isinstance(rerank, str) else dict(rerank)
    if prompt_name:
        body["prompt_name"] = prompt_name
    return body


def rerank_body(query: str, documents: list, model: str | None, raw_scores: bool, extra: dict) -> dict:
    body = {"query": query, "documents": documents, "return_documents": False, **extra}
    if model:
        body["model"] = model
    if raw_scores:
        body["raw_scores"] = True
    return body


def merge_rerank(parts: list[tuple[int, dict]], documents: list, top_n: int | None,
                 return_documents: bool) -> list[dict]:
    """The results of requests that each scored a slice of `documents` (from `offset`), as one
    ranking over them all: `{index, relevance_score, document?}`, best first."""
    results = []
    for offset, body in parts:
        for r in body["results"]:
            item = {"index": offset + r["index"], "relevance_score": r["relevance_score"]}
            if return_documents:
                d = documents[item["index"]]
                item["document"] = {"text": d} if isinstance(d, str) else d
            results.append(item)
    results.sort(key=lambda r: (-r["relevance_score"], r["index"]))
    return results[:top_n] if top_n else results
