"""One C call for a whole decode step's layers (`decode_forward_f32` in cpu_paged_attention.c):
float32 activations, every sequence bringing one token, each linear fp32 row-major (`gemv`) or
int8 blocked (`gemv_w8`); or bfloat16 activations and K/V with every linear int8 (`--decode-weights
int8`) or bf16 row-major (`gemv_bf16`, native weights on a CPU with AVX512-BF16)
(`decode_forward_bf16`). The same kernels in the same order as the per-op glue path
(`LlamaModel._forward_glue`), so the same numbers; what goes is the interpreter between them.

`DecodeLayers` holds the per-layer descriptors (pointers into tensors the model keeps alive)
built once at load; `forward` takes the step's tensors.
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu_attention


class _Linear(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("kind", ctypes.c_int64)]


_P = ctypes.c_void_p
_I = ctypes.c_int64
# x, out, linears, norms, k caches, v caches, cos, sin, slots; num_slots, block tables, their stride, context
# lens; T, H, I, L, nh, kvh, hd, block size, the caches' dtype (_KV_KIND); eps, scale; scratch; threads
_ARGS = [_P] * 9 + [_I, _P, _I, _P] + [_I] * 9 + [ctypes.c_float, ctypes.c_float, _P, ctypes.c_int]
# bf16: the same, with two scratch buffers (bf16 intermediates, float32 linear output)
_ARGS_BF16 = _ARGS[:-1] + [_P, ctypes.c_int]
_FNS = {torch.float32: ("decode_forward_f32", _ARGS), torch.bfloat16: ("decode_forward_bf16", _ARGS_BF16)}
# the caches' dtype as the C step takes it; float32 activations take any of them, bfloat16 its own
_KV_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _fn(dtype: torch.dtype):
    lib, why = cpu_attention._library()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are not available: {why}")
    name, args = _FNS[dtype]
    fn = getattr(lib, name)
    if fn.argtypes is None:
        fn.argtypes, fn.restype = args, ctypes.c_int
    return fn


_GEMV_BF16_ARGS = [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int]
# Rows up to which gemv_bf16 (AVX512-BF16) beats oneDNN's packed bf16 matmul on a decoder's linears
# (embedserve.studies.cpu_paths; measured in BENCHMARKS.md).
GEMV_BF16_MAX_ROWS = 2


def bf16_gemv_native() -> bool:
    """Whether `gemv_bf16` was built with AVX512-BF16 dot products here (the only place it beats
    oneDNN's packed bf16 matmul for a few rows; elsewhere it widens to float and is a reference)."""
    lib, _ = cpu_attention._library()
    return lib is not None and bool(lib.gemv_bf16_native())


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` in bfloat16 for x (M, K) and a row-major weight (N, K): the
    products summed in float32, the output rounded to bf16 (as torch's bf16 matmul rounds, its sums
    in another order)."""
    lib, why = cpu_attention._library()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are not available: {why}")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.dim() != 2 or weight.dim() != 2 \
            or x.shape[1] != weight.shape[1] or not weight.is_contiguous():
        raise ValueError(f"gemv_bf16 takes bf16 x (M, K) and a contiguous bf16 weight (N, K); got {x.dtype} "
                         f"{tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    if lib.gemv_bf16.argtypes is None:
        lib.gemv_bf16.argtypes, lib.gemv_bf16.restype = _GEMV_BF16_ARGS, ctypes.c_int
    return cpu_attention.rows_gemv(lib.gemv_bf16, "gemv_bf16", x, weight, bias).to(torch.bfloat16)


def linear_descriptor(weight: torch.Tensor | None, bias: torch.Tensor | None, packed: torch.Tensor | None = None,
                      scale: torch.Tensor | None = None, out_features: int = 0, in_features: int = 0
                      ) -> _Linear | None:
    """A float32 or bfloat16 row-major (N, K) `weight` (kind 0, 2), or the int8 `packed` (pack_w8)
    of an (out_features, in_features) weight with its `scale` (kind 1); None where the fused step
    cannot take it (another dtype; an int8 K not a multiple of 16, whose packed rows are longer
    than the activations the step passes)."""
    b = 0 if bias is None else bias.data_ptr()
    if packed is not None:
        if in_features != packed.shape[1] or bias is not None and bias.dtype != torch.float32:
            return None
        return _Linear(packed.data_ptr(), scale.data_ptr(), b, out_features, packed.shape[1], 1)
    if weight is None or weight.dtype not in (torch.float32, torch.bfloat16) or not weight.is_contiguous() \
            or bias is not None and bias.dtype != torch.float32:
        return None
    return _Linear(weight.data_ptr(), 0, b, weight.shape[0], weight.shape[1], 0 if weight.dtype == torch.float32 else 2)


class DecodeLayers:
    """The fused step's view of a decoder: 4 linears (qkv, o, gate|up, down) and 2 norms per
    layer, the final norm (in the activations' dtype), the caches. `keep` holds every tensor a
    pointer points into. float32 activations take fp32 and int8 linears and a float32, bfloat16 or
    float16 cache; bfloat16 ones int8 and bf16 linears and a bfloat16 cache."""

    def __init__(self, linears: list[_Linear], norms: list[torch.Tensor], kv_caches, hidden: int,
                 intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, keep: list):
        self.dtype, self.kv_dtype = norms[0].dtype, kv_caches[0][0].dtype
        kinds = (0, 1) if self.dtype == torch.float32 else (1, 2)
        if self.dtype not in _FNS or any(t.dtype != self.dtype for t in norms) \
                or any(lin.kind not in kinds for lin in linears) \
                or cpu_attention.kv_kernel_suffix(self.dtype, self.kv_dtype) is None \
                or any(c.dtype != self.kv_dtype for kv in kv_caches for c in kv):
            raise ValueError("the one-call step takes float32 with fp32 or int8 linears and a float32, bfloat16 or "
                             "float16 cache, or bfloat16 with int8 or bf16 linears and a bfloat16 cache; norms in "
                             "the activations' dtype")
        self.num_layers = len(norms) // 2
        self.lins = (_Linear * len(linears))(*linears)
        self.norms = (ctypes.c_void_p * len(norms))(*[t.data_ptr() for t in norms])
        self.k = (ctypes.c_void_p * len(kv_caches))(*[kc.data_ptr() for kc, _ in kv_caches])
        self.v = (ctypes.c_void_p * len(kv_caches))(*[vc.data_ptr() for _, vc in kv_caches])
        self.caches, self.keep = kv_caches, keep + norms
        self.H, self.I, self.nh, self.kvh, self.hd, self.eps = (hidden, intermediate, num_heads, num_kv_heads,
                                                                head_dim, eps)
        kc = kv_caches[0][0]
        self.block_size, self.num_slots = kc.shape[1], kc.shape[0] * kc.shape[1]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """x (T, H) in the caches' dtype (the embedding rows; updated in place as the residual
        stream), cos/sin (T, hd / 2) float32 -> the final normed hidden (T, H)."""
        if x.dtype != self.dtype:
            raise ValueError(f"the one-call step was built for {self.dtype} activations, not {x.dtype}")
        fn = _fn(self.dtype)
        T = x.shape[0]
        slots = slots.to(torch.int64).contiguous()          # bounds checked by rope_store (code -3)
        bt = block_tables.to(torch.int32).contiguous()
        ctx = context_lens.to(torch.int32).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        qkv_w = (self.nh + 2 * self.kvh) * self.hd
        # the intermediates in the activations' dtype: h, qkv, q, o, gate|up, SiLU * up, the residual
        scratch = torch.empty(T * (2 * self.H + qkv_w + 2 * self.nh * self.hd + 3 * self.I), dtype=self.dtype)
        out = torch.empty_like(x)
        args = [x.data_ptr(), out.data_ptr(), ctypes.addressof(self.lins), ctypes.addressof(self.norms),
                ctypes.addressof(self.k), ctypes.addressof(self.v), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                self.num_slots, bt.data_ptr(), bt.shape[1], ctx.data_ptr(), T, self.H, self.I, self.num_layers,
                self.nh, self.kvh, self.hd, self.block_size, _KV_KIND[self.kv_dtype], float(self.eps),
                float(self.hd ** -0.5),
                scratch.data_ptr()]
        if self.dtype == torch.bfloat16:          # one linear's float32 output rows
            wide = torch.empty(T * max(qkv_w, self.H, 2 * self.I), dtype=torch.float32)
            args.append(wide.data_ptr())
        rc = fn(*args, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"cpu decode_forward failed (code {rc}: -3 is a slot outside the cache, "
                               "-4 a linear of another dtype than its activations take)")
        return out
