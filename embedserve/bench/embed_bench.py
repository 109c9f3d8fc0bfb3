"""Embedding throughput benchmark: our server over HTTP vs sentence-transformers offline.

One run, one model, one fixed corpus of mixed-length texts:
  * ours-1x32     our server, 32 concurrent clients, one text per request
  * ours-32x8     our server, 8 concurrent clients, 32 texts per request
  * st            sentence-transformers `encode(batch_size=32)` in-process (no HTTP)
each in fp32, in bf16 (the whole corpus where the CPU has fast bf16, else a slice: emulated bf16
is slow) and, ours only, in int8 (sentence-transformers has no int8 path; its fp32 is the peer).
Writes a JSON result file and prints a table. Run it alone: the machine's cores are the thing being measured.

    python -m embedserve.bench.embed_bench --out embedserve/bench/results/embed.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import inspect
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

_STDLIB_MODULES = ["collections", "json", "os", "pathlib", "re", "asyncio", "argparse", "logging",
                   "threading", "subprocess", "random", "statistics", "datetime", "decimal",
                   "fractions", "functools", "itertools", "heapq", "bisect", "sqlite3", "socket",
                   "email", "http.client", "urllib.parse", "zipfile", "tarfile", "csv", "string",
                   "textwrap", "difflib", "unittest", "typing", "dataclasses", "enum", "inspect"]


def build_corpus(n: int, seed: int = 0) -> list[str]:
    """A fixed corpus: paragraphs of the Python standard library's docstrings, cut to a
    log-normal length mix (median ≈ 40 words, a long tail to ~400), deterministic per Python."""
    import importlib

    paras: list[str] = []
    for name in _STDLIB_MODULES:
        mod = importlib.import_module(name)
        objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
        for o in objs:
            doc = inspect.getdoc(o) if (inspect.isclass(o) or inspect.isfunction(o) or inspect.ismodule(o)) else None
            if doc:
                paras += [" ".join(p.split()) for p in doc.split("\n\n") if len(p.split()) >= 4]
    paras = sorted(set(paras))
    words = " ".join(paras).split()
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=np.log(40), sigma=0.8, size=n), 3, 400).astype(int)
    starts = rng.integers(0, len(words) - 400, size=n)
    return [" ".join(words[s:s + L]) for s, L in zip(starts, lengths)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`embedserve serve` in a subprocess, ready when /ready says so."""

    def __init__(self, model: str, dtype: str, max_batch_tokens: int):
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "embedserve.cli", "serve", "--model", model, "--dtype", dtype,
             "--port", str(self.port), "--max-batch-tokens", str(max_batch_tokens),
             "--max-concurrent-requests", "4096", "--max-queued-tokens", "4000000", "--log-level", "warning",
             "--generate-model", "none"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        import httpx
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited during start-up")
            try:
                if httpx.get(self.base + "/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("server not ready in 300 s")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(30)


async def _drive(base: str, model: str, texts: list[str], per_request: int, concurrency: int) -> dict:
    import httpx
    chunks = [texts[i:i + per_request] for i in range(0, len(texts), per_request)]
    latencies: list[float] = []
    it = iter(chunks)

    async def worker(client):
        for chunk in it:
            t0 = time.perf_counter()
            r = await client.post("/v1/embeddings", json={"input": chunk, "model": model})
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        await client.post("/v1/embeddings", json={"input": texts[:4], "model": model})   # warm
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * float(np.percentile(latencies, 99)), "requests": len(latencies)}


def run_ours(model: str, path: Path, dtype: str, texts: list[str], max_batch_tokens: int) -> list[dict]:
    rows = []
    with Server(model, dtype, max_batch_tokens) as srv:
        for name, per_req, conc in (("ours-1x32", 1, 32), ("ours-32x8", 32, 8)):
            r = asyncio.run(_drive(srv.base, model, texts, per_req, conc))
            rows.append({"system": name, "dtype": dtype, **r})
    return rows


def run_st(path: Path, dtype: str, texts: list[str]) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(str(path), device="cpu")
    if dtype == "bfloat16":
        st = st.to(torch.bfloat16)
    st.encode(texts[:32], batch_size=32)   # warm
    t0 = time.perf_counter()
    st.encode(texts, batch_size=32)
    return {"system": "sentence-transformers encode(batch_size=32)", "dtype": dtype,
            "wall_s": time.perf_counter() - t0, "p50_ms": None, "p99_ms": None, "requests": None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="embedserve bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="multilingual-e5-small")
    ap.add_argument("--texts", type=int, default=2000, help="corpus size for the fp32 runs")
    ap.add_argument("--bf16-texts", type=int, default=400,
                    help="corpus slice for the bf16 runs (0 to skip; bf16 is emulated, slow, on CPUs without AVX512-BF16/AMX)")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8", help="comma-separated precisions to run")
    ap.add_argument("--max-batch-tokens", type=int, default=4096)
    ap.add_argument("--out", default="embedserve/bench/results/embed.json")
    args = ap.parse_args(argv)

    import torch
    from embedserve.precision import fast_bf16_available
    from embedserve.models.registry import resolve_model

    torch.set_num_threads(os.cpu_count() or 1)
    name, path = resolve_model(args.model)
    corpus = build_corpus(args.texts)
    from tokenizers import Tokenizer
    tk = Tokenizer.from_file(str(path / "tokenizer.json"))
    tk.no_truncation()
    lens = [len(e.ids) for e in tk.encode_batch(corpus)]
    corpus = [t for t, L in zip(corpus, lens) if L <= 512]
    lens = [L for L in lens if L <= 512]
    meta = {"model": name, "texts": len(corpus), "real_tokens": int(sum(lens)),
            "median_tokens": int(np.median(lens)), "max_tokens": int(max(lens)),
            "corpus_sha256": hashlib.sha256("\n".join(corpus).encode()).hexdigest()[:16],
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "fast_bf16": fast_bf16_available(torch.device("cpu")), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M")}
    print(json.dumps(meta))
    rows = []
    sizes = {"float32": len(corpus), "int8": len(corpus),
             "bfloat16": len(corpus) if meta["fast_bf16"] else min(args.bf16_texts, len(corpus))}
    for dtype in args.dtypes.split(","):
        n = sizes[dtype]
        if n == 0:
            continue
        texts, tokens = corpus[:n], int(sum(lens[:n]))
        # peer first, then ours, each alone on the machine
        peer = [run_st(path, dtype, texts)] if dtype != "int8" else []
        for row in peer + run_ours(args.model, path, dtype, texts, args.max_batch_tokens):
            row.update(texts=n, tokens=tokens, tokens_per_s=tokens / row["wall_s"], texts_per_s=n / row["wall_s"])
            rows.append(row)
            print(f"{row['system']:<44} {dtype:<9} {row['tokens_per_s']:>9.0f} tok/s {row['texts_per_s']:>8.1f} texts/s"
                  + (f"  p50 {row['p50_ms']:.0f} ms  p99 {row['p99_ms']:.0f} ms" if row["p50_ms"] else ""), flush=True)
    st_fp32 = next(r for r in rows if r["system"].startswith("sentence") and r["dtype"] == "float32")["tokens_per_s"]
    for r in rows:
        peer = next((p for p in rows if p["system"].startswith("sentence") and p["dtype"] == r["dtype"]
                     and p["texts"] == r["texts"]), None)
        r["ratio_vs_st_same_dtype"] = r["tokens_per_s"] / peer["tokens_per_s"] if peer else None
        r["ratio_vs_st_fp32"] = r["tokens_per_s"] / st_fp32
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print("\n| system | dtype | texts | tokens/s | texts/s | p50 ms | p99 ms | × ST same dtype | × ST fp32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p50 = f"{r['p50_ms']:.0f}" if r["p50_ms"] else "–"
        p99 = f"{r['p99_ms']:.0f}" if r["p99_ms"] else "–"
        print(f"| {r['system']} | {r['dtype']} | {r['texts']} | {r['tokens_per_s']:.0f} | {r['texts_per_s']:.1f} | "
              f"{p50} | {p99} | {_ratio(r['ratio_vs_st_same_dtype'])} | {r['ratio_vs_st_fp32']:.2f} |")
    print(f"\nresults written to {out}")
    return 0


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    sys.exit(main())
