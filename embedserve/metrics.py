"""Prometheus metrics, one registry per server instance (tests run several in one process)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _StorageCollector(Collector):
    """The index volume's state, read at each scrape from where the index library keeps it."""

    def __init__(self, read: Callable[[], tuple[int, bool]]):
        self.read = read

    def collect(self):
        refused, full = self.read()
        yield CounterMetricFamily("embedserve_storage_full", "Index writes and snapshots refused because the "
                                  "volume holding the indexes was full", value=refused)
        yield GaugeMetricFamily("embedserve_storage_full_now", "1 while the last write to the index volume "
                                "found it full (no write has succeeded since)", value=1.0 if full else 0.0)


class Metrics:
    """Everything the service exports at /metrics."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests_running = Gauge("embedserve_embed_requests_running",
                                      "Embedding requests with inputs in the model", registry=r)
        self.requests_waiting = Gauge("embedserve_embed_requests_waiting",
                                      "Embedding requests queued, none of their inputs scheduled yet", registry=r)
        self.queued_tokens = Gauge("embedserve_embed_queued_tokens", "Tokens waiting in the queue", registry=r)
        self.batch_inputs = Histogram("embedserve_embed_batch_size_inputs", "Inputs per model batch",
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=r)
        self.batch_tokens = Histogram("embedserve_embed_batch_size_tokens", "Real tokens per model batch",
                                      buckets=(16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768), registry=r)
        self.real_tokens = Counter("embedserve_embed_real_tokens", "Real (unpadded) tokens embedded", registry=r)
        self.computed_tokens = Counter("embedserve_embed_computed_tokens",
                                       "Tokens computed including attention padding", registry=r)
        self.padding_ratio = Gauge("embedserve_embed_padding_efficiency",
                                   "Real tokens / computed tokens over the last batch", registry=r)
        self.queue_time = Histogram("embedserve_embed_queue_time_seconds",
                                    "Arrival to first input scheduled", buckets=_LATENCY, registry=r)
        self.batch_time = Histogram("embedserve_embed_batch_seconds", "Model time per batch",
                                    buckets=_LATENCY, registry=r)
        self.latency = Histogram("embedserve_request_latency_seconds", "End-to-end request latency",
                                 ["route"], buckets=_LATENCY, registry=r)
        self.requests = Counter("embedserve_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.tokens = Counter("embedserve_prompt_tokens", "Prompt tokens accepted", registry=r)
        self.errors = Counter("embedserve_errors", "Errors by type", ["type"], registry=r)
        # generation (decode engine)
        self.gen_running = Gauge("embedserve_gen_requests_running", "Sequences running", registry=r)
        self.gen_waiting = Gauge("embedserve_gen_requests_waiting", "Sequences waiting", registry=r)
        self.gen_kv_usage = Gauge("embedserve_gen_kv_cache_usage", "Fraction of KV blocks in use", registry=r)
        self.gen_prefix_queries = Gauge("embedserve_gen_prefix_cache_queries_tokens",
                                        "Prompt tokens looked up in the prefix cache", registry=r)
        self.gen_prefix_hits = Gauge("embedserve_gen_prefix_cache_hits_tokens",
                                     "Prompt tokens served from the prefix cache", registry=r)
        self.gen_ttft = Histogram("embedserve_gen_time_to_first_token_seconds", "Time to first token",
                                  buckets=_LATENCY, registry=r)
        self.gen_itl = Histogram("embedserve_gen_inter_token_latency_seconds", "Time between output tokens",
                                 buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2), registry=r)
        self.gen_e2e = Histogram("embedserve_gen_e2e_latency_seconds", "Request end-to-end latency",
                                 buckets=_LATENCY, registry=r)
        self.gen_prompt_tokens = Counter("embedserve_gen_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.gen_tokens = Counter("embedserve_gen_generation_tokens", "Tokens generated", registry=r)
        self.gen_preemptions = Counter("embedserve_gen_preemptions", "Sequences preempted", registry=r)
        self.rerank_pairs = Counter("embedserve_rerank_pairs", "Query-document pairs scored by cross-encoders "
                                    "(their batches count in the embed_batch_* and queue families too)", registry=r)
        self.rerank_tokens = Counter("embedserve_rerank_tokens", "Real tokens of the pairs scored", registry=r)
        self.dropped = Counter("embedserve_embed_dropped_inputs",
                               "Inputs dropped before the model because their client went away", registry=r)
        self._storage: _StorageCollector | None = None

    def watch_storage(self, read: Callable[[], tuple[int, bool]]) -> None:
        """Export `read()` = (writes refused for lack of room, full now) as
        `embedserve_storage_full_total` and `embedserve_storage_full_now`."""
        if self._storage is None:
            self._storage = _StorageCollector(read)
            self.registry.register(self._storage)
        else:
            self._storage.read = read
