"""A bf16 decoder served with its small-batch path as shipped (the bf16 GEMV with AVX512-BF16 dot
products and the one-call step, for steps of up to `GEMV_BF16_MAX_ROWS` sequences) against the
same server with `EMBEDSERVE_DECODE_GEMV=0` (oneDNN's packed bf16 matmul, op by op: the path
before): make bench's generation workload (128-token prompts, 16-128 output tokens, ignore_eos)
at 1 and 16 clients, through the same load generator; both servers up at once, the rounds
alternated (this machine's speed drifts within minutes); medians of the rounds.

    python -m embedserve.studies.served_decode_paths [--rounds 3]    # ~2.5 minutes on 2 Zen 4 cores

Writes results/served_decode_paths-<kind>.json. Where the bf16 GEMV does not run (no AVX512-BF16)
the two servers run the same path: the result says so instead of timing it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SIDES = (("bf16 GEMV + one-call step", "1"), ("oneDNN per op (EMBEDSERVE_DECODE_GEMV=0)", "0"))
SHAPES = ((1, 6), (16, 32))                     # (clients, requests), as make bench's generation


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from embedserve.models.linear import small_rows_kernel
    from embedserve.models.registry import resolve_generate_model
    from embedserve.precision import cpu_flags
    from embedserve.studies.compare.generation import gen_dataset
    from embedserve.studies.compare.peers import GEN_MODEL, drive, ours, write_jsonl
    ap = argparse.ArgumentParser(prog="python -m embedserve.studies.served_decode_paths", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="[default: results/served_decode_paths-<kind>.json]")
    args = ap.parse_args(argv)
    flags = cpu_flags()
    res = {"date": time.strftime("%Y-%m-%d"), "flags": sorted(f for f in flags if f.startswith(("avx", "amx"))),
           "command": "python -m embedserve.studies.served_decode_paths", "dtype": "bfloat16"}
    out = args.out or RESULTS / f"served_decode_paths-{'avx512' if 'avx512f' in flags else 'avx2'}.json"
    why = small_rows_kernel(torch.bfloat16)
    if why is not None:
        res["not_run"] = why
        out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"not run: {why}")
        return 0
    _, path = resolve_generate_model(GEN_MODEL)
    tok = AutoTokenizer.from_pretrained(str(path))
    work = Path(tempfile.mkdtemp(prefix="served-decode-"))
    data = {c: write_jsonl(gen_dataset(tok, n, 128, 16, 128, seed=c), work / f"gen-{c}.jsonl") for c, n in SHAPES}
    rounds: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        bases = {}
        for label, gemv in SIDES:
            os.environ["EMBEDSERVE_DECODE_GEMV"] = gemv
            bases[label] = stack.enter_context(ours("all-MiniLM-L6-v2", "bfloat16", generate=GEN_MODEL,
                                                    extra=("--max-num-seqs", "64", "--decode-weights", "native")))
        os.environ.pop("EMBEDSERVE_DECODE_GEMV")
        for _ in range(args.rounds):
            for conc, n in SHAPES:
                for label, base in bases.items():
                    m = drive("generate", base, GEN_MODEL, data[conc], "--max-concurrency", str(conc),
                              "--num-requests", str(n), "--warmup", str(min(conc, 4)), "--ignore-eos")[0]["metrics"]
                    rounds.setdefault(f"{label} @{conc}", []).append(m["output_token_throughput"])
    res["output_tokens_per_s"] = {k: {"median": statistics.median(v), "rounds": v} for k, v in rounds.items()}
    for conc, _ in SHAPES:
        a, b = (res["output_tokens_per_s"][f"{label} @{conc}"]["median"] for label, _ in SIDES)
        res.setdefault("ratio", {})[f"@{conc}"] = a / b
    out.write_text(json.dumps(res, indent=1) + "\n")
    for k, v in res["output_tokens_per_s"].items():
        print(f"{k:48s} {v['median']:7.1f} output tokens/s (rounds {', '.join(f'{x:.1f}' for x in v['rounds'])})")
    print("ratio " + ", ".join(f"{k} {v:.2f}x" for k, v in res["ratio"].items()) + f"; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
