"""Check the Triton paged-KV kernels against the reference on this device, then time decode.

    python -m kernels.bench [--out kernels/bench-results/kernels.json]    # a GPU: checks + timing table
    python -m kernels.bench --smoke                               # tiny shapes (automatic without a GPU)

1. Checks: store_kv, decode (with and without split-K) and prefill against kernels.reference
   on fresh random inputs, in fp16, bf16, fp32 (and an fp8 cache where the GPU has fp8),
   GQA 4:1 and 1:1; a failed check makes the exit status 1.
2. Bandwidth ceiling: a device-to-device copy, counted as bytes read + bytes written.
3. Decode: for each batch x context (all sequences at that context, blocks scattered over
   the cache), the median over --iters runs of the kernel time (CUDA events around a CUDA
   graph replay of the whole call, after a write of 512 MB that evicts L2 and keeps the GPU
   busy while the replay is queued), its achieved bandwidth = bytes of K/V it must read /
   time, that as a share of the copy bandwidth, and the reference's time.

The target on a GPU is decode at >= 60% of copy bandwidth for batch >= 64 and context >= 2048.
Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before
triton is imported) on tiny shapes: a smoke test of this script and of the kernels, whose
timings say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

TARGET_SHARE = 0.60          # of copy bandwidth, for batch >= 64 and context >= 2048
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}   # as in tests/test_kernels.py


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("kernels/bench-results/kernels.json"), help="JSON results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (the default without a GPU)")
    p.add_argument("--heads", type=int, default=32, help="query heads (default: Llama-3-8B's 32)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    p.add_argument("--batches", default="32,64,128,256")
    p.add_argument("--contexts", default="512,2048,8192")
    p.add_argument("--iters", type=int, default=50, help="timed runs per shape (median)")
    return p.parse_args(argv)


def _paged(gen: torch.Generator, context_lens: list[int], block_size: int, kvh: int, hd: int,
           dtype: torch.dtype, device: torch.device, spare_blocks: int = 3):
    """Random K/V caches and block tables scattering each sequence over shuffled blocks."""
    need = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(need) + spare_blocks
    shape = (num_blocks, block_size, kvh, hd)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(context_lens), max(need) + 1), -1, dtype=torch.int32)
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return k_cache, v_cache, tables.to(device), torch.tensor(context_lens, dtype=torch.int32, device=device)


def _rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    if out.isnan().any():
        return float("inf")
    return ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def run_checks(device: torch.device, smoke: bool) -> list[dict]:
    """Every kernel against its reference on this device; one record per check."""
    from . import triton_attention as pa
    from . import reference as ref
    from .store_kv import store_kv

    gen = torch.Generator().manual_seed(1234)
    fp8 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    hd, bs = 64, 16
    decode_lens = [1, 2 * bs, 150] if smoke else [1, 2 * bs, 1000, 3000, 77]
    prefill_seqs = [(20, 20), (40, 90), (1, 33)] if smoke else [(200, 200), (300, 1500), (1, 33), (0, 9), (64, 64)]
    cases = [(dt, dt, heads) for dt in TOL for heads in ((8, 2), (4, 4))]
    if fp8:
        cases.append((torch.bfloat16, torch.float8_e4m3fn, (8, 2)))
    records = []
    for q_dtype, cache_dtype, (nh, kvh) in cases:
        name = f"{str(cache_dtype).removeprefix('torch.')} {nh}/{kvh} heads"
        tol = TOL[q_dtype]

        k_cache, v_cache, tables, ctx = _paged(gen, decode_lens, bs, kvh, hd, cache_dtype, device)
        q = torch.randn(len(decode_lens), nh, hd, generator=gen).to(q_dtype).to(device)
        expected = ref.paged_decode_attention(q, k_cache, v_cache, tables, ctx, hd ** -0.5)
        records.append({"kernel": "decode", "case": name, "tol": tol, "rel_err": _rel_err(
            pa.paged_decode_attention(q, k_cache, v_cache, tables, ctx, hd ** -0.5), expected)})
        records.append({"kernel": "decode split-K x3", "case": name, "tol": tol, "rel_err": _rel_err(
            pa.decode_with_splits(q, k_cache, v_cache, tables, ctx, hd ** -0.5, num_splits=3), expected)})

        k_cache, v_cache, tables, ctx = _paged(gen, [n for _, n in prefill_seqs], bs, kvh, hd, cache_dtype, device)
        cu = torch.tensor([0] + [sum(ql for ql, _ in prefill_seqs[:i + 1]) for i in range(len(prefill_seqs))],
                          dtype=torch.int32, device=device)
        q = torch.randn(int(cu[-1]), nh, hd, generator=gen).to(q_dtype).to(device)
        args = (q, k_cache, v_cache, tables, cu, ctx, hd ** -0.5)
        records.append({"kernel": "prefill", "case": name, "tol": tol, "rel_err": _rel_err(
            pa.paged_prefill_attention(*args), ref.paged_prefill_attention(*args))})

        # store_kv: a copy with one cast, bit-exact (fp8 in the interpreter rounds wrongly: skipped)
        if cache_dtype == torch.float8_e4m3fn and device.type != "cuda":
            continue
        key = torch.randn(9, kvh, hd, generator=gen).to(q_dtype).to(device)
        slots = torch.randperm(k_cache.shape[0] * bs, generator=gen)[:9].to(device)
        slots[2] = -1
        caches = [torch.full_like(k_cache, float("nan")) for _ in range(4)]
        store_kv(key, -key, caches[0], caches[1], slots)
        ref.store_kv(key, -key, caches[2], caches[3], slots)
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(caches[:2], caches[2:]))
        records.append({"kernel": "store_kv", "case": name, "tol": 0.0, "rel_err": 0.0 if same else float("inf")})
    for r in records:
        r["ok"] = r["rel_err"] <= r["tol"]
        if r["rel_err"] == float("inf"):
            r["rel_err"] = None                                # NaN in the output, or store_kv differs
    return records


class _Timer:
    """Median time of a callable: CUDA events on a GPU (L2 evicted before each run), wall
    clock otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # 512 MB: ten times an H100/H200 L2, and ~150 us of GPU work queued ahead of each run
        self.flush = torch.empty(2**27, dtype=torch.float32, device=device) if self.cuda else None

    def median_s(self, fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def copy_bandwidth(device: torch.device, timer: _Timer, smoke: bool) -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 2**20 if smoke else 2**29                              # 1 GiB of fp16 on a GPU
    src = torch.randn(n, device=device).half()
    dst = torch.empty_like(src)
    t = timer.median_s(lambda: dst.copy_(src), iters=5 if smoke else 20)
    return 2 * src.numel() * src.element_size() / t


def _graphed(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """fn captured in a CUDA graph (no Python or launch overhead in the timing, as the
    engine's decode would run); fn itself where graphs are not available."""
    if device.type != "cuda":
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()                                                   # compile + value checks before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as e:
        logger.warning("CUDA graph capture failed (%s); timing eager launches", e)
        return fn
    return graph.replay


def time_decode(args: argparse.Namespace, device: torch.device, smoke: bool, timer: _Timer,
                copy_bps: float) -> list[dict]:
    from . import triton_attention as pa
    from . import reference as ref

    dtype = getattr(torch, args.dtype)
    nh, kvh, hd, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    if smoke:
        nh, kvh, hd, batches, contexts = 4, 2, 64, [1, 4], [32, 128]
    iters = 3 if smoke else args.iters
    blocks_per_seq = -(-max(contexts) // bs)
    num_blocks = max(batches) * blocks_per_seq
    cache_bytes = 2 * num_blocks * bs * kvh * hd * dtype.itemsize
    if device.type == "cuda" and cache_bytes > 0.7 * torch.cuda.mem_get_info(device)[0]:
        raise SystemExit(f"the K/V caches for batch {max(batches)} x context {max(contexts)} need "
                         f"{cache_bytes / 2**30:.1f} GiB; pass smaller --batches/--contexts")
    k_cache = torch.randn((num_blocks, bs, kvh, hd), device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        for context in contexts:
            nblk = -(-context // bs)
            tables = torch.randperm(num_blocks, generator=gen)[:batch * nblk].view(batch, nblk).int().to(device)
            ctx = torch.full((batch,), context, dtype=torch.int32, device=device)
            q = torch.randn(batch, nh, hd, generator=gen).to(dtype).to(device)
            scale = hd ** -0.5
            run = _graphed(lambda: pa.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale), device)
            t = timer.median_s(run, iters)
            t_ref = timer.median_s(lambda: ref.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale),
                                   iters=min(iters, 3), warmup=1)
            kv_bytes = 2 * batch * context * kvh * hd * dtype.itemsize
            splits = pa.decode_num_splits(batch, kvh, tables.shape[1] * bs, pa._num_sms(device))
            rows.append({"batch": batch, "context": context, "splits": splits, "kernel_us": t * 1e6,
                         "kv_bytes": kv_bytes, "gbps": kv_bytes / t / 1e9, "share_of_copy": kv_bytes / t / copy_bps,
                         "reference_ms": t_ref * 1e3, "speedup": t_ref / t})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cuda = torch.cuda.is_available()
    smoke = args.smoke or not cuda
    if not cuda:
        # read when triton decorates its functions, so before anything imports triton
        os.environ["TRITON_INTERPRET"] = "1"
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(device) if cuda else "CPU (Triton interpreter)"
    print(f"device: {name}{'  [smoke: tiny shapes]' if smoke else ''}")

    t0 = time.perf_counter()
    checks = run_checks(device, smoke)
    for c in checks:
        err = "NaN/differs" if c["rel_err"] is None else f"{c['rel_err']:.1e}"
        print(f"  check {c['kernel']:<18} {c['case']:<24} rel err {err:>7} (tol {c['tol']:.0e})"
              f"  {'ok' if c['ok'] else 'FAIL'}")
    timer = _Timer(device)
    copy_bps = copy_bandwidth(device, timer, smoke)
    print(f"device-to-device copy: {copy_bps / 1e9:,.0f} GB/s (read + write)")
    rows = time_decode(args, device, smoke, timer, copy_bps)
    shape = "4/2 heads x 64" if smoke else f"{args.heads}/{args.kv_heads} heads x {args.head_dim}"
    print(f"\ndecode attention, {shape}, {args.dtype}, block {args.block_size}")
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'kernel us':>10} {'GB/s':>8} {'% copy':>7} "
          f"{'ref ms':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['batch']:>6} {r['context']:>8} {r['splits']:>6} {r['kernel_us']:>10.1f} {r['gbps']:>8,.0f} "
              f"{100 * r['share_of_copy']:>6.1f}% {r['reference_ms']:>9.2f} {r['speedup']:>7.0f}x")
    judged = [r for r in rows if r["batch"] >= 64 and r["context"] >= 2048]
    target_met = None if smoke or not judged else all(r["share_of_copy"] >= TARGET_SHARE for r in judged)
    if target_met is not None:
        print(f"target: >= {TARGET_SHARE:.0%} of copy bandwidth at batch >= 64, context >= 2048: "
              f"{'met' if target_met else 'NOT met'}")
    result = {"device": name, "smoke": smoke, "dtype": args.dtype, "shape": shape, "block_size": args.block_size,
              "copy_gbps": copy_bps / 1e9, "checks": checks, "decode": rows, "target_share": TARGET_SHARE,
              "target_met": target_met, "seconds": time.perf_counter() - t0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
