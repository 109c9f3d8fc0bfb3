"""Index benchmark: search latency, memory and recall for N random unit vectors.

    python -m index.bench --out index/bench-results/index.json       # 100k x 384, ~3-5 min on 2 cores

Exact (IndexFlatIP in an id map) against HNSW at several efSearch values: single-query
latency p50/p99 at the index's default FAISS thread count, index size, RSS growth, and
HNSW recall@10 against exact. Then the whole path (`Index.search`: manifest check, FAISS,
SQLite fetch of text and metadata) on an exact index of the same vectors, and what upserts,
a snapshot and an open cost. Random vectors are a hard case for HNSW (no low-dimensional
structure), so its recall here is a floor for real embeddings.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

from .dense import DenseIndex, search_threads
from .docstore import Document
from .manifest import DenseConfig, ModelIdentity
from .search import Query
from .store import IndexStore

logger = logging.getLogger(__name__)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _latency(fn, queries: np.ndarray) -> dict:
    for q in queries[:20]:
        fn(q)                                   # warm caches
    times = []
    for q in queries:
        t0 = time.perf_counter()
        fn(q)
        times.append(time.perf_counter() - t0)
    ms = np.array(times) * 1e3
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3),
            "mean_ms": round(float(ms.mean()), 3)}


def _recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(t)) / truth.shape[1] for f, t in zip(found, truth)]))


def bench_faiss(base: np.ndarray, queries: np.ndarray, truth: np.ndarray, ef_values: list[int],
                hnsw_m: int, ef_construction: int) -> list[dict]:
    """Exact vs HNSW through DenseIndex (FAISS only)."""
    n, dim = base.shape
    labels = np.arange(n, dtype=np.int64)
    rows = []
    for kind in ("flat", "hnsw"):
        cfg = DenseConfig(kind=kind, hnsw_m=hnsw_m, ef_construction=ef_construction, ef_search=ef_values[0])
        rss0 = _rss_mib()
        t0 = time.perf_counter()
        dense = DenseIndex(dim, cfg)
        dense.threads = os.cpu_count() or 1                  # building is batch work: all cores
        dense.add(labels, base)
        build_s = time.perf_counter() - t0
        size_mib = len(faiss.serialize_index(dense.index)) / 2**20
        rss_mib = _rss_mib() - rss0
        cores = os.cpu_count() or 1
        settings = ([(None, search_threads())] + ([(None, cores)] if cores > search_threads() else [])
                    if kind == "flat" else [(ef, search_threads()) for ef in ef_values])
        for ef, threads in settings:
            if ef is not None:
                dense.config.ef_search = ef
            dense.threads = threads
            lat = _latency(lambda q, ix=dense: ix.search(q[None, :], 10), queries)
            _, found = dense.search(queries, 10)
            name = f"flat (exact), {threads} thread{'s' if threads > 1 else ''}" if ef is None else \
                f"hnsw M={hnsw_m} efC={ef_construction} efSearch={ef}"
            rows.append({"index": name, **lat, "recall_at_10": round(_recall(found, truth), 4), "build_s": round(build_s, 1),
                         "index_mib": round(size_mib, 1), "rss_growth_mib": round(rss_mib, 1)})
            logger.info("%s", rows[-1])
        del dense
    return rows


def bench_end_to_end(base: np.ndarray, queries: np.ndarray, batch: int = 5000) -> dict:
    """Index.search through the store (exact index), plus upsert, snapshot and open costs."""
    n, dim = base.shape
    ident = ModelIdentity(model="bench-random", fingerprint="b" * 64, dimension=dim, normalize=True,
                          pooling="mean", query_prefix="", passage_prefix="", has_sparse=False)
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory(prefix="index-bench-") as tmp:
        store = IndexStore(tmp)
        ix = store.create("bench", ident, snapshot_min_ops=10 * n)
        t0 = time.perf_counter()
        for s in range(0, n, batch):
            ids = range(s, min(n, s + batch))
            docs = [Document(f"doc-{i}", f"document {i}", {"shard": i % 8}) for i in ids]
            sparse = [(np.unique(rng.integers(0, 30000, 12)).astype(np.int64), np.ones(12, np.float32)) for _ in ids]
            sparse = [(t, w[:len(t)]) for t, w in sparse]
            ix.upsert(docs, list(base[s:s + len(docs)]), sparse, ident)
        upsert_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ix.snapshot()
        snapshot_s = time.perf_counter() - t0
        lat = _latency(lambda q: ix.search(Query(dense=q, top_k=10), ident), queries)
        lat_f = _latency(lambda q: ix.search(Query(dense=q, top_k=10, filter={"shard": 3}), ident), queries[:100])
        ix.close()
        t0 = time.perf_counter()
        ix = store.open("bench", ident)
        open_s = time.perf_counter() - t0
        ix.close(snapshot=False)
        db_mib = sum(p.stat().st_size for p in Path(tmp).rglob("docs.sqlite*")) / 2**20
    return {"upsert_docs_per_s": round(n / upsert_s), "snapshot_s": round(snapshot_s, 2), "open_s": round(open_s, 2),
            "search": lat, "search_with_filter_1_in_8": lat_f, "sqlite_mib": round(db_mib, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m index.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=500)
    p.add_argument("--hnsw-m", type=int, default=32)
    p.add_argument("--ef-construction", type=int, default=200)
    p.add_argument("--ef-search", default="32,64,128,256")
    p.add_argument("--out", type=Path, default=Path("index/bench-results/index.json"))
    p.add_argument("--skip-end-to-end", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    load_start = os.getloadavg()[0]        # other work on the cores shows up in the numbers
    rng = np.random.default_rng(0)
    base = _unit(rng, args.n, args.dim)
    queries = _unit(rng, args.queries, args.dim)
    truth = np.argsort(-(queries @ base.T), axis=1)[:, :10]
    rows = bench_faiss(base, queries, truth, [int(x) for x in args.ef_search.split(",")],
                       args.hnsw_m, args.ef_construction)
    e2e = None if args.skip_end_to_end else bench_end_to_end(base, queries)
    result = {"n": args.n, "dim": args.dim, "queries": args.queries, "faiss_threads_search": search_threads(),
              "cpu_count": os.cpu_count(), "machine": platform.machine(), "faiss": faiss.__version__,
              "load_average_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
              "dense": rows, "end_to_end_exact": e2e}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{args.n:,} x {args.dim} random unit vectors, {args.queries} single queries, top 10, "
          f"FAISS search threads {search_threads()}, load average {result['load_average_1m']}\n")
    print("| index | p50 ms | p99 ms | recall@10 | build s | index MiB | RSS growth MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['index']} | {r['p50_ms']} | {r['p99_ms']} | {r['recall_at_10']} | {r['build_s']} | "
              f"{r['index_mib']} | {r['rss_growth_mib']} |")
    if e2e:
        print(f"\nIndex.search (exact, with SQLite fetch): p50 {e2e['search']['p50_ms']} ms, p99 "
              f"{e2e['search']['p99_ms']} ms; with a 1-in-8 metadata filter p50 "
              f"{e2e['search_with_filter_1_in_8']['p50_ms']} ms; upsert {e2e['upsert_docs_per_s']:,} docs/s "
              f"(vectors given); snapshot {e2e['snapshot_s']} s; open {e2e['open_s']} s; SQLite {e2e['sqlite_mib']} MiB")
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
