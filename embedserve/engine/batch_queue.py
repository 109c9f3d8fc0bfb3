"""The embed engine's token-budget queue (TEI's `max_batch_tokens` idea).

Each input of each request is one entry; a batch takes entries in arrival order while
`batch_tokens + entry_tokens <= max_batch_tokens` and `len(batch) < max_batch_size`, so a
large request spreads over several batches and small ones ride along. Entries whose
request was cancelled (client gone) are dropped here, before the model sees them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from ..models.embedding_model import EmbedOutput


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass(slots=True, eq=False)
class EmbedRequest:
    """One API request: its inputs as token ids and a callback run (on the engine thread)
    when every input is done or the request failed."""

    inputs: list[list[int]]
    want: frozenset[str]
    on_done: Callable[["EmbedRequest"], None]
    arrival: float = field(default_factory=time.monotonic)
    outputs: list[EmbedOutput | None] = field(default_factory=list)
    num_remaining: int = 0
    num_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    first_scheduled: float | None = None
    error: BaseException | None = None
    # per input, where its second segment starts (a cross-encoder's query-document pair), or None
    segments: list[int | None] | None = None

    def __post_init__(self):
        self.outputs = [None] * len(self.inputs)
        self.num_remaining = len(self.inputs)
        self.num_tokens = sum(map(len, self.inputs))


@dataclass(slots=True)
class Entry:
    request: EmbedRequest
    index: int
    num_tokens: int


class TokenBudgetQueue:
    """FIFO of input entries; not thread-safe on its own (the engine holds its lock)."""

    def __init__(self):
        self._entries: deque[Entry] = deque()
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, request: EmbedRequest) -> None:
        for i, ids in enumerate(request.inputs):
            self._entries.append(Entry(request, i, len(ids)))
            self.num_tokens += len(ids)

    def next_batch(self, max_batch_tokens: int, max_batch_size: int) -> tuple[list[Entry], int]:
        """Pop the next batch; returns it and how many cancelled entries were dropped."""
        batch: list[Entry] = []
        tokens = dropped = 0
        while self._entries and len(batch) < max_batch_size:
            e = self._entries[0]
            if e.request.status is RequestStatus.CANCELLED:
                self._entries.popleft()
                self.num_tokens -= e.num_tokens
                dropped += 1
                continue
            if tokens + e.num_tokens > max_batch_tokens:
                break
            self._entries.popleft()
            self.num_tokens -= e.num_tokens
            tokens += e.num_tokens
            batch.append(e)
        assert tokens <= max_batch_tokens and len(batch) <= max_batch_size
        return batch, dropped
