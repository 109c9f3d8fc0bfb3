"""The CPU paged decode attention kernel alone, on SmolLM2-135M's shapes (9 query heads, 3 KV
heads, head_dim 64, 16-token blocks, block tables shuffled as a long-running cache leaves them):
each case
as a model's 30 layers (their own caches, called in turn, so K/V come from memory, as in a
decode step: `--layers 1` keeps one case's cache-resident); this tree's kernel against the torch reference (gather + softmax, `kernels.reference`) and,
with `--against REV`, against the kernel of another git revision built beside it: both loaded
in one process, called alternately, median of the rounds; each with its max abs error against
the reference run in float32 on the same inputs.

    python -m embedserve.studies.paged_decode --against 0bb1cce --out embedserve/studies/results/paged_decode.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kernels import cpu_attention, reference

NH, KVH, HD, BS = 9, 3, 64, 16
# (sequences, shortest, longest context): the generation bench @64 (128-token prompts, up to 128
# out), a small batch, one stream, and long RAG contexts
CASES = ((64, 130, 256), (16, 130, 256), (1, 130, 256), (8, 1500, 2048), (1, 3000, 4096))


def _library(source: Path):
    lib, why = cpu_attention.load_library(source=source)
    if lib is None:
        raise SystemExit(f"{source}: {why}")
    return lib


def _case(batch: int, lo: int, hi: int, dtype: torch.dtype, seed: int = 0, kv_dtype: torch.dtype | None = None):
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(lo, hi + 1, (batch,), generator=gen, dtype=torch.int32)
    blocks = [(int(n) + BS - 1) // BS for n in ctx]
    total = sum(blocks) + 4
    k = torch.randn(total, BS, KVH, HD, generator=gen).to(kv_dtype or dtype)
    v = torch.randn(total, BS, KVH, HD, generator=gen).to(kv_dtype or dtype)
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    tables = torch.zeros(batch, max(blocks), dtype=torch.int32)
    at = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = perm[at:at + nb]
        at += nb
    q = torch.randn(batch, NH, HD, generator=gen).to(dtype)
    return q, k, v, tables, ctx


def _layers(batch: int, lo: int, hi: int, dtype: torch.dtype, layers: int,
            kv_dtype: torch.dtype | None = None) -> list[tuple]:
    """`layers` cases of the same shapes, each with its own caches (as a model's layers have): a
    pass over them reads K/V from memory, not from a cache level that one layer's would fit in."""
    return [_case(batch, lo, hi, dtype, seed=i, kv_dtype=kv_dtype) for i in range(layers)]


def _symbol(q, k) -> str:
    """The C kernel of q's and the cache's dtypes (cpu_attention's table)."""
    return "paged_decode_attention_" + cpu_attention.kv_kernel_suffix(q.dtype, k.dtype)


def _call(lib, q, k, v, tables, ctx) -> torch.Tensor:
    out = torch.empty_like(q)
    fn = getattr(lib, _symbol(q, k))
    rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), tables.shape[1], ctx.data_ptr(),
            out.data_ptr(), q.shape[0], NH, KVH, HD, BS, ctypes.c_float(HD ** -0.5), torch.get_num_threads())
    assert rc == 0, rc
    return out


def run(against: str | None, rounds: int, reps: int, layers: int) -> list[dict]:
    libs = {"this tree": _library(cpu_attention.SOURCE)}
    if against:
        text = subprocess.run(["git", "show", f"{against}:kernels/cpu_paged_attention.c"], check=True,
                              capture_output=True).stdout
        old = Path(tempfile.mkdtemp(prefix="paged-decode-")) / "cpu_paged_attention.c"
        old.write_bytes(text)
        libs[against] = _library(old)
    rows = []
    # (activations, cache): bf16, fp32, and fp32 over the float16 cache `auto` gives a float32 decoder
    for dtype, kv_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                            (torch.float32, torch.float16)):
        for batch, lo, hi in CASES:
            cases = _layers(batch, lo, hi, dtype, layers, kv_dtype)
            q, k, v, tables, ctx = cases[0]
            exact = reference.paged_decode_attention(q.float(), k.float(), v.float(), tables, ctx, HD ** -0.5).double()
            fns = {name: (lambda c, lib=lib: _call(lib, *c)) for name, lib in libs.items()
                   if hasattr(lib, _symbol(q, k))}            # an older build may lack the mixed kernels
            fns["torch reference"] = lambda c: reference.paged_decode_attention(c[0], c[1].to(c[0].dtype),
                                                                                c[2].to(c[0].dtype), *c[3:], HD ** -0.5)
            times: dict[str, list[float]] = {name: [] for name in fns}
            # the kernels alternated round by round, so drift hits them alike; the torch reference
            # after them, not between: its OpenMP pool (torch ships its own libgomp) spins on the
            # cores after each call, and the kernel run next had paid for it (1-sequence short
            # cases 20-50 % slower, whichever build ran there)
            kernels = [name for name in fns if name != "torch reference"]
            for group in (kernels, ["torch reference"]):
                for _ in range(rounds):
                    for name in group:
                        fn = fns[name]
                        fn(cases[-1])
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            for c in cases:             # a decode step's pass over the layers
                                fn(c)
                        times[name].append((time.perf_counter() - t0) / reps / layers * 1e3)
            for name, fn in fns.items():
                rows.append({"dtype": str(dtype).removeprefix("torch.") + (
                                 f" / {str(kv_dtype).removeprefix('torch.')} cache" if kv_dtype != dtype else ""),
                             "sequences": batch,
                             "context": f"{lo}-{hi}", "kernel": name, "median_ms": statistics.median(times[name]),
                             "max_abs_err": float((fn(cases[0]).double() - exact).abs().max())})
    return rows


def markdown(rows: list[dict]) -> str:
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    out = ["| dtype | sequences | context | " + " | ".join(f"{k} ms" for k in kernels) + " |",
           "|---|---|---|" + "---|" * len(kernels)]
    keys = list(dict.fromkeys((r["dtype"], r["sequences"], r["context"]) for r in rows))
    for key in keys:
        cells = {r["kernel"]: r for r in rows if (r["dtype"], r["sequences"], r["context"]) == key}
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | "
                   + " | ".join(f"{cells[k]['median_ms']:.3f} (err {cells[k]['max_abs_err']:.1e})" if k in cells
                                else "–" for k in kernels) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default=None, help="a git revision whose kernel to time beside this tree's")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30, help="caches per case, each called in turn (SmolLM2 has 30 "
                    "layers): K/V come from memory as in a decode step; 1 times a cache-resident case")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.against, args.rounds, args.reps, args.layers)
    print(markdown(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"threads": args.threads, "layers": args.layers, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
