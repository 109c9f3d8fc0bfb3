"""`ingest()`: upsert many documents into an index from a batch job — batched under the server's
limits, idempotent by document id (a retried or repeated batch never duplicates), with a
progress bar on a terminal, a summary, and resume from a document offset."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from . import _core
from .errors import BadRequestError, ConflictError, NotFoundError


@dataclass(slots=True)
class IngestSummary:
    """What an ingest did. `next_offset` is where a rerun resumes (`start=`)."""

    index: str
    model: str = ""
    sent: int = 0
    added: int = 0
    replaced: int = 0
    metadata: int = 0
    unchanged: int = 0
    truncated: list[str] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)       # {"offset", "ids", "reason"}
    next_offset: int = 0
    seconds: float = 0.0

    @property
    def docs_per_s(self) -> float:
        return self.sent / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "docs_per_s": round(self.docs_per_s, 1)}


def read_jsonl(path: str | Path) -> Iterator[dict]:
    """Documents from a JSONL file, one {id, text, metadata?} object per line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                yield {"id": str(obj["id"]), "text": obj["text"], "metadata": obj.get("metadata") or {}}
            except (ValueError, KeyError, TypeError) as exc:   # JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{n}: each line must be a JSON object with `id` and `text` "
                                 f"({type(exc).__name__}: {exc})") from None


def check_index(client, index: str, create: bool) -> str:
    """Before anything is sent: the index exists (or is created) and its manifest belongs to the
    model the server serves. Returns that model's name."""
    try:
        info = client.index(index).info()
    except NotFoundError:
        if not create:
            raise
        info = client.index(index).create(exist_ok=True)
    if info.get("compatible") is False:
        raise ConflictError(409, f"index {index!r} was built with {info.get('model')!r}, which this server does "
                                 f"not serve: {info.get('mismatch')}; point at a server with that model or "
                                 "reindex", code="manifest_mismatch")
    return info.get("model", "")


def _batches(docs: Iterator[dict], limits: _core.Limits, max_docs: int) -> Iterator[list[dict]]:
    """Documents grouped into upserts under the server's limits, streaming (never all in memory)."""
    budget, batch = _core.Budget(limits, max_docs), []
    for doc in docs:
        size, tokens = _core.json_size(doc) + 8, _core.estimate_tokens(doc["text"])
        if not budget.take(size, tokens):
            yield batch
            budget.reset()
            budget.take(size, tokens)
            batch = []
        batch.append(doc)
    if batch:
        yield batch


def ingest(client, index: str, documents: Iterable | str | Path, *, start: int = 0, create: bool = True,
           max_docs: int = 256, progress: bool | None = None, total: int | None = None,
           on_batch: Callable[[IngestSummary], None] | None = None) -> IngestSummary:
    """Upsert `documents` (dicts {id, text, metadata}, (id, text[, metadata]) tuples, or a JSONL
    path) into `index`, skipping the first `start`. A batch the server refuses (400) is recorded in
    `failed` and the job goes on; any other error propagates with `next_offset` set on it."""
    summary = IngestSummary(index=index, next_offset=start)
    summary.model = check_index(client, index, create)
    if isinstance(documents, (str, Path)):
        documents = read_jsonl(documents)
    elif total is None and hasattr(documents, "__len__"):
        total = len(documents)
    docs = (_core.document_dict(d) for i, d in enumerate(documents) if i >= start)
    bar = _progress(progress, total, start, index)
    handle, t0 = client.index(index), time.perf_counter()
    try:
        for batch in _batches(docs, client.limits(), max_docs):
            try:
                res = handle.upsert(batch)
                for key in ("added", "replaced", "metadata", "unchanged"):
                    setattr(summary, key, getattr(summary, key) + res.get(key, 0))
                summary.truncated += res.get("truncated", [])
            except BadRequestError as exc:
                summary.failed.append({"offset": summary.next_offset, "ids": [d["id"] for d in batch],
                                       "reason": exc.message})
            summary.sent += len(batch)
            summary.next_offset += len(batch)
            summary.seconds = time.perf_counter() - t0
            if bar is not None:
                bar.update(len(batch))
            if on_batch is not None:
                on_batch(summary)
    except BaseException as exc:
        exc.next_offset = summary.next_offset          # resume with ingest(..., start=exc.next_offset)
        raise
    finally:
        if bar is not None:
            bar.close()
    summary.seconds = time.perf_counter() - t0
    return summary


def _progress(progress: bool | None, total: int | None, start: int, index: str):
    """A tqdm bar (documents/s, ETA) on a terminal, none otherwise."""
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=start, unit="doc", desc=f"ingest {index}", dynamic_ncols=True)
