"""How close `make bench`'s runs come to the machine's limit: the encoder's FLOPs × tokens/s against
the matmul rate of the same precision, and the decoder's weight bytes per step against a copy's
memory bandwidth."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from .peers import EMBED_MODELS, GEN_MODEL, best_dtype, best_of

# the ceiling's matmul, as the near-the-limit issue defines it: a 4,096-token batch through the
# encoder's FFN up-projection (4096 x 384 x 1536 for MiniLM and e5-small: K = 384 is where these
# encoders' matmuls live, and it runs slower than a large square product)
CEILING_ROWS = 4096


def matmul_flops(dtype: str, shape: tuple[int, int, int] = (CEILING_ROWS, 384, 1536), reps: int = 20) -> float:
    """The machine's matmul FLOP/s in `dtype` for an (m x k) @ (k x n) product: the faster of
    `a @ b` and a linear packed for oneDNN (what our encoder runs; in fp32 it is ~2x MKL's `a @ b`
    on these CPUs); int8 on the matmul the encoder's int8 takes here (`_int_mm` with VNNI, fbgemm
    without). The best of `reps` timed calls after two warm-ups: a ceiling, and on a shared
    machine interference only slows a call down (5 calls once read 82 GFLOP/s where 129 held)."""
    import torch

    from embedserve.models.linear import Linear
    m, k, n = shape
    if dtype == "int8":
        from embedserve.models.int8 import int8_kernel
        if int8_kernel() == "fbgemm":       # what the encoder's int8 runs on here (no VNNI)
            import warnings
            from embedserve.models.int8 import FBGEMM_W_LEVELS
            w = torch.randint(-FBGEMM_W_LEVELS, FBGEMM_W_LEVELS + 1, (n, k), dtype=torch.int8)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                packed_q = torch.ops.quantized.linear_prepack(torch._make_per_channel_quantized_tensor(
                    w, torch.ones(n, dtype=torch.double), torch.zeros(n, dtype=torch.long), 0), None)
            x = torch.randint(-127, 128, (m, k)).float()
            fns = [lambda: torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, 1.0, 128, packed_q)]
        else:
            a = torch.randint(-100, 100, (m, k), dtype=torch.int8)
            b = torch.randint(-100, 100, (k, n), dtype=torch.int8)
            fns = [lambda: torch._int_mm(a, b)]
    else:
        a = torch.randn(m, k, dtype=getattr(torch, dtype))
        b = torch.randn(k, n, dtype=getattr(torch, dtype))
        packed = Linear(b.T.contiguous())
        fns = [lambda: a @ b, lambda: packed(a)]
    best = float("inf")
    with torch.inference_mode():
        for fn in fns:
            fn()
            fn()
            best = min(best, *(_timed(fn) for _ in range(reps)))
    return 2 * m * k * n / best


def ceiling_shape(model_dir: Path) -> tuple[int, int, int]:
    """The ceiling's matmul for this encoder: 4,096 tokens through its FFN up-projection."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return CEILING_ROWS, cfg["hidden_size"], cfg["intermediate_size"]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_buffers(mib: int = 512):
    """A source and a destination of `mib` MiB for `copy_rate`, the destination written once."""
    import torch
    src = torch.empty(mib * 2 ** 20, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return src, dst


def copy_rate(src, dst, reps: int = 5) -> float:
    """Bytes/s of the best of `reps` copies of src into dst, read and write counted."""
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * src.numel() / best


def copy_bandwidth(mib: int = 512, reps: int = 5) -> float:
    return copy_rate(*copy_buffers(mib), reps)


def encoder_flops_per_token(model_dir: Path, avg_len: float) -> float:
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    dense = layers * (4 * h * h + 2 * h * inter)          # Q, K, V, O and the two FFN matrices
    attention = layers * 2 * h * avg_len                  # QK^T and PV per token
    return 2 * (dense + attention)


def bench_ceiling(emb: dict, gen: dict) -> dict:
    import torch

    from embedserve.models.registry import resolve_generate_model, resolve_model
    out = {"threads": torch.get_num_threads()}
    for model in EMBED_MODELS:
        _, path = resolve_model(model)
        best = best_of(emb[model]["ours"])["32 texts/request, 8 clients"]
        fp32 = emb[model]["ours"]["float32"]["32 texts/request, 8 clients"]
        avg_len = best["tokens_per_s"] / max(best["texts_per_s"], 1e-9)
        fpt = encoder_flops_per_token(path, avg_len)
        dtype = best_dtype(emb[model]["ours"])
        ip = emb[model].get("in_process", {})
        # the rate measured beside the runs it is compared with (else measured now)
        ip_auto = ip.get("auto", ip.get("float32", {}))     # auto picked fp32: the one fp32 run
        shape = ceiling_shape(path)
        peak = ip_auto.get("matmul_gflops", 0) * 1e9 or matmul_flops(dtype, shape)
        peak32 = ip.get("float32", {}).get("matmul_gflops", 0) * 1e9 or matmul_flops("float32", shape)
        square = ip_auto.get("square_matmul_gflops", 0)
        square32 = ip.get("float32", {}).get("square_matmul_gflops", 0)
        ip_best = ip_auto.get("ours", {}).get("tokens_per_s", 0.0)
        ip_fp32 = ip.get("float32", {}).get("ours", {}).get("tokens_per_s", 0.0)
        out[model] = {"flops_per_token": fpt, "avg_tokens_per_text": avg_len,
                      "best": {"dtype": dtype, "tokens_per_s": best["tokens_per_s"],
                               "achieved_gflops": fpt * best["tokens_per_s"] / 1e9, "matmul_gflops": peak / 1e9,
                               "matmul_shape": list(shape), "square_matmul_gflops": square,
                               "fraction": fpt * best["tokens_per_s"] / peak,
                               "in_process_tokens_per_s": ip_best, "in_process_fraction": fpt * ip_best / peak},
                      "float32": {"tokens_per_s": fp32["tokens_per_s"],
                                  "achieved_gflops": fpt * fp32["tokens_per_s"] / 1e9, "matmul_gflops": peak32 / 1e9,
                                  "matmul_shape": list(shape), "square_matmul_gflops": square32,
                                  "fraction": fpt * fp32["tokens_per_s"] / peak32,
                                  "in_process_tokens_per_s": ip_fp32, "in_process_fraction": fpt * ip_fp32 / peak32}}
    _, gpath = resolve_generate_model(GEN_MODEL)
    from safetensors import safe_open
    params = 0
    for f in gpath.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                params += int(np.prod(st.get_slice(k).get_shape()))
    bw = copy_bandwidth()
    gdtype = next(iter(gen["ours"]))
    width = 2 if gdtype in ("bfloat16", "float16") else 4
    alone = gen["ours"][gdtype]["1"]["output_tokens_per_s"]
    out["decoder"] = {"params": params, "dtype": gdtype, "bytes_per_step": width * params, "steps_per_s_alone": alone,
                      "achieved_gb_per_s": width * params * alone / 1e9, "copy_gb_per_s": bw / 1e9,
                      "fraction": width * params * alone / bw}
    out["decoder"].update(_in_process_decoder(gen.get("single_stream", {}), width * params))
    return out


def _in_process_decoder(single: dict, bytes_per_step: float) -> dict:
    """The decoder alone in process (the single stream's native row: steady decode steps, no HTTP, no
    prompt), each run against the copy bandwidth measured just before it (the machine's memory
    bandwidth drifts by a third within an hour here, so a copy measured minutes apart says little):
    the median of the runs' fractions. Empty where the section has no such row or no per-run copy."""
    row = next((r for r in single.get("rows", []) if r.get("key") == "ours"), None)
    runs = [r for r in (row or {}).get("detail", []) if r.get("copy_gb_per_s")]
    if not runs:
        return {}
    new = single.get("new_tokens", 128) - 1
    fracs = [bytes_per_step * new / r["decode_s"] / (r["copy_gb_per_s"] * 1e9) for r in runs]
    return {"in_process": {"steps_per_s": row["decode_tokens_per_s"],
                           "achieved_gb_per_s": bytes_per_step * row["decode_tokens_per_s"] / 1e9,
                           "copy_gb_per_s": statistics.median(r["copy_gb_per_s"] for r in runs),
                           "fraction": statistics.median(fracs), "fractions": fracs}}
