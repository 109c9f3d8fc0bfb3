"""EmbedEngine: a dedicated thread that forms token-budget batches and runs the model.

The HTTP layer calls `submit` (which may refuse with OverloadedError) and `abort`; results
come back through each request's `on_done` callback, called on the engine thread.
"""

from __future__ import annotations

import logging
import time

from ..config import EmbedConfig
from ..errors import OverloadedError, UnavailableError, ValidationError
from ..metrics import Metrics
from ..models.embedding_model import EmbeddingModel
from .batch_queue import EmbedRequest, RequestStatus, TokenBudgetQueue
from .compute import COMPUTE_LOCK
from .engine_thread import EngineThread

logger = logging.getLogger(__name__)


class EmbedEngine(EngineThread):
    """Owns the queue and the model thread."""

    thread_name = "embed-engine"

    def __init__(self, model: EmbeddingModel, config: EmbedConfig, metrics: Metrics | None = None):
        """`config` is the tree's embed section (its batch budget filled in, as `ServerConfig` does);
        ConfigError where its limits cannot hold this model's longest input."""
        super().__init__()
        assert config.max_batch_tokens is not None, "the configuration tree fills in the batch budget"
        self.model = model
        self.config = config
        self.max_input_length = config.input_limit(model.max_input_length)
        self.metrics = metrics or Metrics()
        self._queue = TokenBudgetQueue()
        self._active: set[EmbedRequest] = set()
        self._tokens_per_s = 2000.0     # EMA of model throughput, for Retry-After estimates
        self.last_error: BaseException | None = None

    # ------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        """Stop the thread; requests still in flight fail with 503."""
        super().stop()
        with self._cv:
            pending = list(self._active)
            self._active.clear()
        for r in pending:
            r.error = UnavailableError("the server is shutting down; retry against another replica")
            r.on_done(r)

    def stats(self) -> dict:
        with self._cv:
            return {"queued_inputs": len(self._queue), "queued_tokens": self._queue.num_tokens,
                    "active_requests": len(self._active), "tokens_per_s": round(self._tokens_per_s, 1)}

    # ------------------------------------------------- the model, as callers may use it
    @property
    def spec(self):
        """The served model's `ModelSpec` (name, dimension, heads, dtype, fingerprint...)."""
        return self.model.spec

    @property
    def task(self) -> str:
        """"embed" (an embedding model) or "rerank" (a cross-encoder scoring pairs)."""
        return self.model.spec.task

    @property
    def embedding_types(self) -> set[str]:
        """What this model can produce from one forward pass."""
        return self.model.spec.embedding_types

    @property
    def special_ids(self) -> set[int]:
        return self.model.special_ids

    @property
    def prompts(self) -> dict[str, str]:
        """The model's named prompts (query, passage, and its own), name -> text."""
        return self.model.prefixes

    def prompt_name(self, prompt_name: str | None, input_type: str | None = None) -> str | None:
        """The prompt a request's text gets: `prompt_name`, else `input_type` (query | passage),
        else `--default-prompt-name` where this model has it, else the model's own default.
        ValidationError naming the prompts when the model has no such prompt."""
        if prompt_name is not None and input_type is not None and prompt_name != input_type:
            raise ValidationError(f"`prompt_name` {prompt_name!r} and `input_type` {input_type!r} disagree; send one",
                                  param="prompt_name")
        name = prompt_name or input_type
        if name is None:
            default = self.config.default_prompt_name
            name = default if default in self.prompts else self.model.default_prompt_name
        if name is not None and name not in self.prompts:
            raise ValidationError(f"model {self.spec.name!r} has no prompt {name!r}; its prompts are "
                                  f"{', '.join(repr(n) for n in sorted(self.prompts))}", param="prompt_name")
        return name

    def has_prefix(self, input_type: str | None) -> bool:
        """Whether `input_type` (query | passage) adds a text prefix for this model."""
        return bool(self.model.prefixes.get(input_type or ""))

    def tokenize(self, texts: list[str], input_type: str | None = None) -> list[list[int]]:
        """Token ids with specials and the model's prefix for `input_type`, untruncated (thread-safe)."""
        return self.model.tokenize(texts, input_type)

    def wrap_token_ids(self, ids: list[int]) -> list[int]:
        return self.model.wrap_token_ids(ids)

    def truncate(self, ids: list[int], limit: int | None = None, direction: str = "right") -> list[int]:
        return self.model.truncate(ids, limit or self.max_input_length, direction)

    # ------------------------------------------------------------ interface
    def submit(self, request: EmbedRequest) -> None:
        """Queue a request or refuse it (overloaded); never blocks."""
        cfg = self.config
        too_long = [i for i, ids in enumerate(request.inputs) if len(ids) > cfg.max_batch_tokens]
        if too_long:
            raise ValidationError(f"input {too_long[0]} has {len(request.inputs[too_long[0]])} tokens, "
                                  f"more than --max-batch-tokens {cfg.max_batch_tokens}", param="input")
        with self._cv:
            if self._stop or not self.alive():
                raise UnavailableError("the embedding engine is not running" + (f" ({self.death})" if self.death else ""))
            if len(self._active) >= cfg.max_concurrent_requests:
                raise OverloadedError(
                    f"{len(self._active)} requests in flight, the limit (--max-concurrent-requests) is "
                    f"{cfg.max_concurrent_requests}; retry later", retry_after=self._retry_after())
            if self._queue.num_tokens + request.num_tokens > cfg.max_queued_tokens:
                if self._queue.num_tokens > 0:
                    raise OverloadedError(
                        f"{self._queue.num_tokens} tokens queued; this request's {request.num_tokens} more "
                        f"would pass --max-queued-tokens {cfg.max_queued_tokens}; retry later",
                        retry_after=self._retry_after())
                raise ValidationError(
                    f"this request has {request.num_tokens} tokens, more than --max-queued-tokens "
                    f"{cfg.max_queued_tokens} can ever hold; split it into smaller requests", param="input")
            self._queue.append(request)
            self._active.add(request)
            self._update_gauges()
            self._cv.notify()

    def abort(self, request: EmbedRequest) -> None:
        """The client went away: its queued inputs are dropped before reaching the model."""
        with self._cv:
            if request.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
                request.status = RequestStatus.CANCELLED
                self._active.discard(request)
                self._update_gauges()

    # ------------------------------------------------------------ internals
    def _retry_after(self) -> float:
        return 1.0 + self._queue.num_tokens / max(self._tokens_per_s, 1.0)

    def _update_gauges(self) -> None:
        m = self.metrics
        running = sum(1 for r in self._active if r.status is RequestStatus.RUNNING)
        m.requests_running.set(running)
        m.requests_waiting.set(len(self._active) - running)
        m.queued_tokens.set(self._queue.num_tokens)

    def _loop(self) -> None:
        cfg, m = self.config, self.metrics
        while True:
            with self._cv:
                idle = not self._stop and not len(self._queue)
            if idle:
                COMPUTE_LOCK.idle()             # nothing queued: this thread's OpenMP team goes
            with self._cv:
                while not self._stop and not len(self._queue):
                    self._cv.wait()
                if self._stop:
                    return
                batch, dropped = self._queue.next_batch(cfg.max_batch_tokens, cfg.max_batch_size)
                now = time.monotonic()
                for e in batch:
                    r = e.request
                    if r.status is RequestStatus.WAITING:
                        r.status = RequestStatus.RUNNING
                        r.first_scheduled = now
                        m.queue_time.observe(now - r.arrival)
                self._update_gauges()
            if dropped:
                m.dropped.inc(dropped)
            if not batch:
                continue
            want = set().union(*(e.request.want for e in batch))
            inputs = [e.request.inputs[e.index] for e in batch]
            # a cross-encoder's pairs carry where their document segment starts (token type 1)
            extra = ({"segments": [e.request.segments[e.index] if e.request.segments else None for e in batch]}
                     if any(e.request.segments for e in batch) else {})
            t0 = time.perf_counter()
            try:
                with COMPUTE_LOCK, self.busy():
                    outs, computed = self.model.embed(inputs, want, **extra)
            except Exception as exc:  # a model failure fails this batch's requests, not the engine
                logger.exception("embedding batch of %d inputs failed", len(batch))
                self.last_error = exc
                self._fail({e.request for e in batch}, exc)
                continue
            dt = time.perf_counter() - t0
            real = sum(e.num_tokens for e in batch)
            self._tokens_per_s = 0.8 * self._tokens_per_s + 0.2 * (real / max(dt, 1e-6))
            m.batch_inputs.observe(len(batch))
            m.batch_tokens.observe(real)
            m.batch_time.observe(dt)
            m.real_tokens.inc(real)
            m.computed_tokens.inc(computed)
            m.padding_ratio.set(real / max(computed, 1))
            if self.task == "rerank":
                m.rerank_pairs.inc(len(batch))
                m.rerank_tokens.inc(real)
            self._deliver(batch, outs)

    def _deliver(self, batch, outs) -> None:
        done = []
        with self._cv:
            for e, out in zip(batch, outs):
                r = e.request
                if r.status is RequestStatus.CANCELLED:
                    continue
                r.outputs[e.index] = out
                r.num_remaining -= 1
                if r.num_remaining == 0:
                    r.status = RequestStatus.FINISHED
                    self._active.discard(r)
                    done.append(r)
            self._update_gauges()
        for r in done:
            r.on_done(r)

    def _on_death(self, exc: BaseException) -> None:
        with self._cv:
            waiting = set(self._active)
        self._fail(waiting, UnavailableError(f"the embedding engine stopped ({self.death})"))

    def _fail(self, requests: set[EmbedRequest], exc: BaseException) -> None:
        with self._cv:
            for r in requests:
                r.status = RequestStatus.CANCELLED
                self._active.discard(r)
            self._update_gauges()
        for r in requests:
            r.error = exc
            r.on_done(r)
