"""Attention on the CPU from small C kernels (`cpu_paged_attention.c`), compiled at first use
with the machine's C compiler and called through ctypes: paged decode attention for the decoder,
`varlen_attention` for the encoder (packed sequences, no padding), and the glue between the
decoder's matmuls (`rms_norm` with the residual add, `rope_store_kv`, `silu_mul`) and the
encoder's `add_layer_norm`: one call each where torch dispatches 4-12 small ops; and `gemv`, the
decoder's linears for steps of a few sequences, reading the row-major weights at memory speed.

Why: the torch path gathers each sequence's K/V blocks into a copy and runs SDPA, whose CPU
kernel spends most of a one-token query on setup. Profile of one 16-sequence SmolLM2 decode
step in bf16 (`python -m embedserve.studies.profile decode`): SDPA 5.4 ms + gather 2.0 ms of
20.9 ms. The kernel reads K/V in place through the block table, loads each K/V row once for
the query heads that share it, and accumulates in float32. For the encoder, SDPA over padded
length groups ran its small-head (d = 32) problems at ~40 GFLOP/s, 26-29 % of the forward; the
varlen kernel computes no padding and register-blocks the scores (8 query rows x 16 keys with AVX-512, 4 with AVX2);
in bf16 on a CPU with AMX-BF16 its twin computes Q K^T and P V as tile products (`amx_attention_runs`).

The shared library is cached under $EMBEDSERVE_HOME/kernels, keyed by the source, the flags
and the CPU (it is built with -march=native): a build is ~1 s, once per machine. No compiler,
a failed build or EMBEDSERVE_CPU_ATTENTION=torch: `available()` says why and callers keep the
torch path. ctypes releases the GIL for the call.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from . import cbuild, compute

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
_VARLEN_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                ctypes.c_float, ctypes.c_int]
_RMS_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int]
_ROPE_ARGS = ([ctypes.c_void_p] * 6 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 4
              + [ctypes.c_int])
_SILU_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
_ADD_LN_ARGS = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int]
_GEMV_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
_GEMV_W8_ARGS = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
         ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_float, ctypes.c_int]


_memo: tuple[object, ctypes.CDLL | None, str | None] = (None, None, None)


def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded library, None) or (None, why not); built or loaded once per setting of the
    compute paths (`kernels.compute`), and said once in the log, for every caller (decode and
    encoder attention)."""
    global _memo
    paths = compute.current()
    if _memo[0] is not paths:
        lib, why = load_library(paths.cpu_attention)
        if why is None:
            logger.info("CPU attention: the C kernels (%s) for decode and encoder attention", SOURCE.name)
        else:
            logger.info("CPU attention: the torch paths (SDPA), the C kernels do not run here: %s", why)
        _memo = (paths, lib, why)
    return _memo[1], _memo[2]


def load_library(mode: str = "auto", source: Path = SOURCE) -> tuple[ctypes.CDLL | None, str | None]:
    """Build (or find the build of) the library of `source` (another revision's, for a study) and load
    it: (it, None) or (None, why not); `mode` is the cpu_attention switch."""
    if mode == "torch":
        return None, "cpu_attention=torch"
    target, why = cbuild.built(source)
    if target is None:
        return None, why
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        return None, f"loading {target.name} failed: {exc}"
    for kernel, args in (("paged_decode_attention", _ARGS), ("varlen_attention", _VARLEN_ARGS),
                         ("add_layer_norm", _ADD_LN_ARGS), ("rms_norm", _RMS_ARGS), ("rope_store", _ROPE_ARGS),
                         ("silu_mul", _SILU_ARGS)):
        mixed = _KV_SUFFIX.values() if kernel in ("paged_decode_attention", "rope_store") else ()
        for suffix in {*_SUFFIX.values(), *mixed}:
            if suffix not in _SUFFIX.values() and not hasattr(lib, f"{kernel}_{suffix}"):
                continue                  # another revision's build (a study's --against) without them
            fn = getattr(lib, f"{kernel}_{suffix}")
            fn.argtypes, fn.restype = args, ctypes.c_int
    lib.varlen_attention_bf16_amx.argtypes, lib.varlen_attention_bf16_amx.restype = _VARLEN_ARGS, ctypes.c_int
    lib.amx_available.argtypes, lib.amx_available.restype = [], ctypes.c_int
    lib.gemv_f32.argtypes, lib.gemv_f32.restype = _GEMV_ARGS, ctypes.c_int
    lib.gemv_w8_f32.argtypes, lib.gemv_w8_f32.restype = _GEMV_W8_ARGS, ctypes.c_int
    lib.gemv_w8_bf16.argtypes, lib.gemv_w8_bf16.restype = _GEMV_W8_ARGS, ctypes.c_int
    if lib.w8_layout() != W8_ROWS * 100 + W8_COLS:
        return None, f"{SOURCE.name}'s int8 layout is not the one pack_w8 packs"
    return lib, None


def available() -> str | None:
    """None where the kernel runs here, else why not."""
    return _library()[1]


# the dtypes the kernels take, and the suffix of each kernel's symbol for it (`rms_norm_bf16`)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
# (activations, KV cache) dtypes the cache kernels take (paged_decode_attention, rope_store): each
# dtype with itself, and float32 activations over a 16-bit cache (`--kv-cache-dtype bfloat16|float16`
# for a float32 decoder: half the bytes read per key, each row widened in registers)
_KV_SUFFIX = {(torch.float32, torch.float32): "f32", (torch.bfloat16, torch.bfloat16): "bf16",
              (torch.float32, torch.bfloat16): "f32_kvbf16", (torch.float32, torch.float16): "f32_kvf16"}


def kv_kernel_suffix(dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """The suffix of the cache kernels' C symbols (`paged_decode_attention_f32_kvf16`) for
    activations in `dtype` over a cache in `kv_dtype`, or None where no kernel takes the pair."""
    return _KV_SUFFIX.get((dtype, kv_dtype))


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The shapes and dtypes the kernel takes (else the caller keeps the torch path)."""
    nh, hd = q.shape[1], q.shape[2]
    kvh = k_cache.shape[2]
    return (q.device.type == "cpu" and (q.dtype, k_cache.dtype) in _KV_SUFFIX and nh % kvh == 0
            and nh // kvh <= 16 and hd <= 256 and k_cache.is_contiguous())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as `kernels.reference.paged_decode_attention`: q [B, nh, hd] -> [B, nh, hd]."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the CPU attention kernel is not available: {why}")
    if not supports(q, k_cache) or v_cache.dtype != k_cache.dtype or not v_cache.is_contiguous():
        raise ValueError("cpu paged attention: q and the caches must share float32 or bfloat16 (or q float32 "
                         "over bfloat16 or float16 caches), with num_heads / num_kv_heads <= 16 and head_dim <= 256")
    q = q.contiguous()
    bt = block_tables.to(torch.int32).contiguous()
    ctx = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    B, nh, hd = q.shape
    rc = getattr(lib, "paged_decode_attention_" + _KV_SUFFIX[q.dtype, k_cache.dtype])(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(),
                                       bt.shape[1], ctx.data_ptr(), out.data_ptr(), B, nh, k_cache.shape[2], hd,
                                       k_cache.shape[1], float(scale), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"cpu paged attention failed (code {rc})")
    return out


def varlen_supports(qkv: torch.Tensor, num_heads: int) -> bool:
    """The encoder shapes the varlen kernel takes: head_dim a multiple of 16, at most 64."""
    three_h = qkv.shape[-1]
    hd = three_h // (3 * num_heads)
    return (qkv.device.type == "cpu" and qkv.dtype in _SUFFIX and qkv.dim() == 2 and 3 * num_heads * hd == three_h
            and hd % 16 == 0 and hd <= 64)


def varlen_preferred() -> bool:
    """Whether the encoder takes the varlen kernel over SDPA: yes, on both kinds of CPU (in
    vectors of the machine's width it is ahead of per-sequence SDPA on 2-core EPYCs with AVX-512
    and with AVX2 only, `python -m embedserve.studies.cpu_paths`; before it was written that way,
    GCC's lowering of 16-float vectors on AVX2 made it 8x slower there).
    `cpu_attention=sdpa` keeps SDPA for the encoder (the decode kernel stays)."""
    return compute.current().cpu_attention in ("auto", "c")


def amx_attention_runs(qkv: torch.Tensor, num_heads: int) -> bool:
    """Whether `varlen_attention` takes its AMX tile kernel for this input: bf16, head_dim 32 or
    64, a library built for a CPU with AMX-BF16 whose tiles Linux lets this process use, the
    `amx_attention` switch on and bf16 not declared slow (`fast_bf16=0` imitates a CPU without it,
    as for the bf16 GEMV)."""
    lib = _library()[0]                                  # amx_available() asks Linux once per process
    paths = compute.current()
    return (lib is not None and paths.amx_attention and paths.fast_bf16 != "0" and qkv.dtype == torch.bfloat16
            and qkv.shape[-1] // (3 * num_heads) in (32, 64) and varlen_supports(qkv, num_heads)
            and lib.amx_available() == 1)


def varlen_attention(qkv: torch.Tensor, cu_seqlens: torch.Tensor, num_heads: int, scale: float) -> torch.Tensor:
    """Bidirectional attention of packed sequences (an encoder's): qkv [T, 3 * nh * hd] (each
    token's q | k | v), sequence b = rows cu_seqlens[b]:cu_seqlens[b + 1] -> [T, nh * hd]. No
    padding and no mask: each sequence attends to its own tokens only."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the CPU attention kernel is not available: {why}")
    if not varlen_supports(qkv, num_heads):
        raise ValueError("cpu varlen attention: qkv must be a float32 or bfloat16 CPU tensor [T, 3 * nh * hd] "
                         "with head_dim a multiple of 16, at most 64")
    T, three_h = qkv.shape
    hd = three_h // (3 * num_heads)
    qkv = qkv.contiguous()
    cu = cu_seqlens.to(torch.int32).contiguous()
    out = torch.empty(T, num_heads * hd, dtype=qkv.dtype)
    fn = (lib.varlen_attention_bf16_amx if amx_attention_runs(qkv, num_heads)
          else getattr(lib, "varlen_attention_" + _SUFFIX[qkv.dtype]))
    rc = fn(qkv.data_ptr(), out.data_ptr(), cu.data_ptr(), cu.numel() - 1, num_heads, hd, float(scale),
            torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"cpu varlen attention failed (code {rc})")
    return out


def add_layer_norm_supports(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """(T, H) float32 or bfloat16 CPU tensors of one dtype, H at most 4,096."""
    return (x.device.type == "cpu" and x.dtype in _SUFFIX and x.dim() == 2 and x.shape == y.shape
            and x.shape[1] <= 4096 and all(t.dtype == x.dtype and t.device.type == "cpu" for t in (y, weight, bias))
            and weight.shape == bias.shape == (x.shape[1],))


def add_layer_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """`F.layer_norm(x + y, (H,), weight, bias, eps)` for (T, H) tensors, in one pass: the sum
    rounded to the dtype as torch's would be, statistics in float32."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are not available: {why}")
    if not add_layer_norm_supports(x, y, weight, bias):
        raise ValueError("cpu add_layer_norm: x, y (T, H) and weight, bias (H,) must share float32 or bfloat16 "
                         "on the CPU, H <= 4096")
    x, y, weight, bias = x.contiguous(), y.contiguous(), weight.contiguous(), bias.contiguous()
    out = torch.empty_like(x)
    rc = getattr(lib, "add_layer_norm_" + _SUFFIX[x.dtype])(x.data_ptr(), y.data_ptr(), weight.data_ptr(), bias.data_ptr(), out.data_ptr(),
                            x.shape[0], x.shape[1], float(eps), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"cpu add_layer_norm failed (code {rc})")
    return out


# ---- the decoder's glue (cpu_paged_attention.c, last section): one call per step instead of
# 4-12 torch ops. Callers check `decoder_glue_supports` once per step; the functions assume it.


def decoder_glue_supports(x: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Hidden states (T, H) and a KV cache [blocks, block_size, kvh, hd] the glue kernels take:
    float32 or bfloat16 on the CPU, the cache in that dtype (or bfloat16 or float16 under float32),
    H at most 4,096, hd even and at most 256, the cache contiguous; and the library built."""
    return (x.device.type == "cpu" and (x.dtype, k_cache.dtype) in _KV_SUFFIX and x.dim() == 2
            and x.shape[1] <= 4096 and k_cache.shape[-1] <= 256 and k_cache.shape[-1] % 2 == 0
            and x.is_contiguous() and k_cache.is_contiguous() and available() is None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """HF's RMSNorm of (T, H) rows: `round(round(x * rsqrt(mean(x^2) + eps)) * weight)`, statistics
    in float32. With `residual`, first `x += residual` in place (rounded to the dtype, as torch's
    add), so one call is the residual add and the next layer's norm."""
    lib = _library()[0]
    out = torch.empty_like(x)
    weight = weight.to(x.dtype).contiguous()
    residual = None if residual is None else residual.to(x.dtype).contiguous()     # held: its pointer is passed
    r = 0 if residual is None else residual.data_ptr()
    rc = getattr(lib, "rms_norm_" + _SUFFIX[x.dtype])(x.data_ptr(), r, weight.data_ptr(), out.data_ptr(),
                                                     x.shape[0], x.shape[1], float(eps), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"cpu rms_norm failed (code {rc})")
    return out


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """qkv (T, (nh + 2 kvh) hd), cos/sin float32 (T, hd / 2) of each token's position ->
    rotated q (T, nh, hd); the rotated k and the v of token t written to cache slot
    `slot_mapping[t]` (caches [blocks, block_size, kvh, hd]). HF's rotate-half RoPE."""
    lib = _library()[0]
    T = qkv.shape[0]
    hd = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q = torch.empty(T, num_heads, hd, dtype=qkv.dtype)
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = getattr(lib, "rope_store_" + _KV_SUFFIX[qkv.dtype, k_cache.dtype])(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
        num_slots, q.data_ptr(), T, num_heads, num_kv_heads, hd, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"cpu rope_store failed (code {rc}: -3 is a slot outside the cache)")
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) = [gate | up] -> silu(gate) * up (T, I), each rounded to the dtype as torch's ops."""
    lib = _library()[0]
    T, I2 = gate_up.shape
    gate_up = gate_up.contiguous()
    out = torch.empty(T, I2 // 2, dtype=gate_up.dtype)
    rc = getattr(lib, "silu_mul_" + _SUFFIX[gate_up.dtype])(gate_up.data_ptr(), out.data_ptr(), T, I2 // 2,
                                                           torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"cpu silu_mul failed (code {rc})")
    return out


# ---- a few rows against a row-major weight (cpu_paged_attention.c, last section). Rows up to
# which it beats oneDNN's packed linear: SmolLM2's decode linears (30 layers + the 49,152-row head,
# fp32, cold caches, 2-core AVX2 EPYC) took 1.39x less time at 1 row, 1.47x at 4, 1.46x at 8, 1.24x
# at 16, 1.10x at 24, 1.06x at 32, 0.99x at 64 (the packed matmul wins from there).
GEMV_MAX_ROWS = 32


def gemv_supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x (M <= GEMV_MAX_ROWS, K) and weight (N, K), float32 CPU tensors, the weight contiguous;
    and the library built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2
            and 1 <= x.shape[0] <= GEMV_MAX_ROWS and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and weight.is_contiguous() and available() is None)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for the few rows `gemv_supports` takes (the caller checks)."""
    return rows_gemv(_library()[0].gemv_f32, "gemv", x, weight, bias)


def rows_gemv(fn, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y (M, N) float32 from a row-major GEMV kernel `fn` of the library (gemv_f32, gemv_bf16):
    x (M, K) and weight (N, K) in the kernel's dtype, bias float32 or None."""
    x = x.contiguous()
    bias = None if bias is None else bias.to(torch.float32).contiguous()      # held: its pointer is passed
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    rc = fn(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
            x.shape[0], weight.shape[0], x.shape[1], torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"cpu {name} failed (code {rc})")
    return y


W8_ROWS, W8_COLS = 8, 16           # the blocked int8 layout gemv_w8_f32 reads (cpu_paged_attention.c)


def pack_w8(qweight: torch.Tensor) -> torch.Tensor:
    """int8 (N, K) row-major -> the kernel's blocked layout [ceil(N/8)][Kp/16][8][16] (flattened to
    (ceil(N/8) * 8, Kp)), zero-padded to whole blocks: Kp = K rounded up to 16."""
    N, K = qweight.shape
    Np, Kp = -(-N // W8_ROWS) * W8_ROWS, -(-K // W8_COLS) * W8_COLS
    padded = torch.zeros(Np, Kp, dtype=torch.int8)
    padded[:N, :K] = qweight
    blocked = padded.view(Np // W8_ROWS, W8_ROWS, Kp // W8_COLS, W8_COLS).permute(0, 2, 1, 3)
    return blocked.contiguous().view(Np, Kp)


def unpack_w8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`pack_w8`'s inverse: the row-major (n, k) int8 matrix."""
    Np, Kp = packed.shape
    rows = packed.view(Np // W8_ROWS, Kp // W8_COLS, W8_ROWS, W8_COLS).permute(0, 2, 1, 3).reshape(Np, Kp)
    return rows[:n, :k].contiguous()


def gemv_w8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Weight-only int8: `F.linear(x, q * scale[:, None], bias)` for x (M, K) float32 or bfloat16
    (returned in x's dtype), `packed` = pack_w8(q) of the int8 (N, K) q, scale (N,) float32. Each
    row is scaled by a power of two into int16 (every value to within 2^-15 of the row's largest |x|;
    bf16 values within 2^7 of it exactly) and the int8 x int16 products summed exactly in integers
    (gemv_w8_f32 / gemv_w8_bf16, cpu_paged_attention.c). Any M: a block's weights are read once per
    call whatever the rows."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are not available: {why}")
    N, Kp = scale.shape[0], packed.shape[1]
    if not (x.dim() == 2 and packed.dtype == torch.int8 and packed.is_contiguous() and x.device.type == "cpu"
            and Kp - W8_COLS < x.shape[1] <= Kp and packed.shape[0] == -(-N // W8_ROWS) * W8_ROWS):
        raise ValueError("cpu gemv_w8: x (M, K), packed = pack_w8(q) of an int8 q (N, K), scale (N,), on the CPU")
    bf16 = x.dtype == torch.bfloat16
    xf = x if bf16 else x.to(torch.float32)
    if x.shape[1] != Kp:
        xf = torch.nn.functional.pad(xf, (0, Kp - x.shape[1]))
    xf = xf.contiguous()
    scale = scale.to(torch.float32).contiguous()
    bias = None if bias is None else bias.to(torch.float32).contiguous()      # held: its pointer is passed
    y = torch.empty(x.shape[0], N, dtype=torch.float32)
    rc = (lib.gemv_w8_bf16 if bf16 else lib.gemv_w8_f32)(
        xf.data_ptr(), packed.data_ptr(), scale.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
        x.shape[0], N, Kp, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"cpu gemv_w8 failed (code {rc})")
    return y if x.dtype == torch.float32 else y.to(x.dtype)
