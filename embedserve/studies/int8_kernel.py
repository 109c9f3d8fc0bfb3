"""`python -m embedserve.studies.int8_kernel [--against REV]`: the weight-only int8 linear
(`gemv_w8_f32` / `gemv_w8_bf16`, kernels/cpu_paged_attention.c) of this tree against the same
kernel built from another git revision's source, both libraries loaded in one process and called
alternately on the same inputs, so the machine's drift falls on both alike. The workload is
SmolLM2-135M's linear shapes (K x N: q/o 576 x 576, k/v 576 x 192, gate/up 576 x 1,536, down
1,536 x 576, the tied head 576 x 49,152) at 1, 4, 16, 64 and 256 rows of activations (one
sequence's decode step, small and large decode batches, a prompt chunk), float32 and bfloat16
activations, 2 threads; per case the median of `--rounds` alternated rounds. Reported: microseconds
per call, int8 weight bytes read per second, multiply-adds per second and the ratio. Both builds
must give the same outputs to the bit (the integer sums are fixed by the arithmetic; checked on
every case), which the study asserts.

    python -m embedserve.studies.int8_kernel --against HEAD~1        # ~25 seconds on 2 AVX2 cores

Writes results/int8_kernel-<avx2|avx512>.{json,md} (`--out` to choose)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import write_results

RESULTS = Path(__file__).parent / "results"
SHAPES = {"q/o": (576, 576), "k/v": (576, 192), "gate/up": (576, 1536), "down": (1536, 576), "head": (576, 49152)}
ROWS = (1, 4, 16, 64, 256)


def _source_at(rev: str, root: Path) -> str:
    p = subprocess.run(["git", "-C", str(root), "show", f"{rev}:kernels/cpu_paged_attention.c"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"--against {rev}: git show failed: {p.stderr.strip()}")
    return p.stdout


def _call(lib, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, threads: int) -> None:
    fn = lib.gemv_w8_bf16 if x.dtype == torch.bfloat16 else lib.gemv_w8_f32
    rc = fn(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), 0, y.data_ptr(), x.shape[0], y.shape[1],
            packed.shape[1], threads)
    if rc != 0:
        raise RuntimeError(f"gemv_w8 returned {rc}")


def study(against: str, rounds: int = 7, threads: int = 2, rows=ROWS, shapes=SHAPES) -> dict:
    from embedserve.models.decode_int8 import quantize_per_channel
    from embedserve.precision import cpu_flags, cpu_model
    from kernels import cpu_attention
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "cpu_paged_attention.c"          # the same file name: the same build flags
        src.write_text(_source_at(against, root))
        base, why = cpu_attention.load_library(source=src)
    this, why_this = cpu_attention.load_library()
    if base is None or this is None:
        raise SystemExit(f"a kernel library did not build: {why or why_this}")
    g = torch.Generator().manual_seed(0)
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (k, n) in shapes.items():
            q, scale = quantize_per_channel(torch.randn(n, k, generator=g) * 0.05)
            packed = cpu_attention.pack_w8(q)
            for m in rows:
                x = torch.randn(m, k, generator=g).to(dtype).contiguous()
                ys = {side: torch.empty(m, n) for side in ("this", "base")}
                calls = max(3, int(2e8 // (m * n * k + 2e6)))     # ~0.1 s per side per round
                times: dict[str, list[float]] = {"this": [], "base": []}
                for r in range(rounds):
                    for side, lib in (("this", this), ("base", base)) if r % 2 == 0 else (("base", base), ("this", this)):
                        _call(lib, x, packed, scale, ys[side], threads)             # warm, and the output
                        t = time.perf_counter()
                        for _ in range(calls):
                            _call(lib, x, packed, scale, ys[side], threads)
                        times[side].append((time.perf_counter() - t) / calls)
                assert torch.equal(ys["this"], ys["base"]), f"{name} {m} rows {dtype}: the builds' outputs differ"
                us = {side: 1e6 * statistics.median(v) for side, v in times.items()}
                cases.append({"dtype": str(dtype).removeprefix("torch."), "shape": name, "K": k, "N": n, "rows": m,
                              "us_this": us["this"], "us_base": us["base"], "speedup": us["base"] / us["this"],
                              "gb_per_s_this": packed.numel() / us["this"] / 1e3,
                              "gmac_per_s_this": m * n * k / us["this"] / 1e3})
                print(f"{cases[-1]['dtype']:8} {name:8} rows {m:3}: {us['base']:9.1f} -> {us['this']:9.1f} us "
                      f"({cases[-1]['speedup']:.2f}x)", file=sys.stderr, flush=True)
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "threads": threads, "rounds": rounds,
            "flags": sorted(f for f in cpu_flags() if f.startswith(("avx2", "avx512f", "avx512_vnni", "avx512_bf16",
                                                                    "amx"))),
            "this": head.stdout.strip() + " (+ working tree)", "against": against, "cases": cases}


def markdown(res: dict) -> str:
    lines = [f"int8 linear, this tree ({res['this']}) against {res['against']}: {res['cpu']}, flags "
             f"{', '.join(res['flags'])}, {res['threads']} threads, medians of {res['rounds']} alternated rounds "
             f"({res['date']}); outputs equal to the bit in every case.", "",
             "| activations | shape (K × N) | rows | before µs | now µs | now / before speed | now GB/s of int8 weights | now GMAC/s |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {c['dtype']} | {c['shape']} ({c['K']} × {c['N']}) | {c['rows']} | {c['us_base']:.1f} | "
              f"{c['us_this']:.1f} | {c['speedup']:.2f}× | {c['gb_per_s_this']:.1f} | {c['gmac_per_s_this']:.1f} |"
              for c in res["cases"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    from embedserve.precision import cpu_flags
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="HEAD", help="the git revision whose kernel source is the baseline")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.threads < 1:
        ap.error("--rounds and --threads must be at least 1")
    res = study(args.against, args.rounds, args.threads)
    out = args.out or RESULTS / f"int8_kernel-{'avx512' if 'avx512f' in cpu_flags() else 'avx2'}.json"
    write_results(out, res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
