"""embedserve's Python client, for ingestion jobs and RAG code: `Client` / `AsyncClient` on httpx
(importing it loads no torch, transformers or faiss).

    from embedserve.client import Client
    with Client("http://127.0.0.1:8000") as c:                  # or $EMBEDSERVE_URL, $EMBEDSERVE_API_KEY
        vecs = c.embed(["hello", "你好"]).dense                   # (2, d) float32
        c.index("docs").create(exist_ok=True)
        c.ingest("docs", "corpus.jsonl")                        # progress bar, summary, resume
        hits = c.index("docs").search("greeting", top_k=3)
"""

from ._core import Embeddings, Limits, RetryPolicy
from .aio import AsyncClient, AsyncIndex
from .errors import (APIConnectionError, APIStatusError, APITimeoutError, AuthenticationError, BadRequestError,
                     ConflictError, EmbedServeClientError, InternalServerError, NotFoundError, RateLimitError,
                     ServiceUnavailableError)
from .ingest import IngestSummary, ingest, read_jsonl
from .sync import Client, Index

__all__ = ["Client", "AsyncClient", "Index", "AsyncIndex", "Embeddings", "Limits", "RetryPolicy",
           "IngestSummary", "ingest", "read_jsonl", "EmbedServeClientError", "APIConnectionError",
           "APITimeoutError", "APIStatusError", "BadRequestError", "AuthenticationError", "NotFoundError",
           "ConflictError", "RateLimitError", "ServiceUnavailableError", "InternalServerError"]
