"""int8 linear layers for the encoder (`--dtype int8`): per-token dynamic int8 activations ×
per-output-channel int8 weights, int32 accumulation in `torch._int_mm` (oneDNN's VNNI kernel),
with the quantize / dequantize steps fused by `torch.compile`.

Why this scheme (measured on all-MiniLM-L6-v2 and multilingual-e5-small, 2-core EPYC with
AVX512-VNNI; the study is summarized in CHANGELOG.md): weights quantize well per output
channel; activations do not per tensor, because a few input channels carry outliers 20-60x
the median (the FFN-down input; a fixed QKV channel), so one scale per tensor crushes the rest
(plain dynamic quantization: min cosine 0.82-0.96 to fp32). One scale per token keeps every
linear in int8 at min cosine 0.996 (MiniLM) and 0.9986 (e5). Everything else (embeddings,
LayerNorm, attention, GELU, residuals) stays in the activation dtype: bf16 where the CPU has it
fast, else float32. Without a compiler the unfused steps cost more than the int8 matmul saves,
so int8 is refused where `torch.compile` does not work.

Two int8 matmuls, by what the CPU has (`EMBEDSERVE_INT8_KERNEL=int_mm|fbgemm` overrides, a
testing aid):
* VNNI (AVX512-VNNI, AVX-VNNI or AMX): `torch._int_mm`, 8-bit activations (±127 per token).
* AVX2 only: there `torch._int_mm` falls back to a plain loop (2-4 GOP/s against 135-171 GFLOP/s
  for the packed fp32 linear on a 2-core EPYC, `python -m embedserve.studies.cpu_paths`), so
  fbgemm's packed u8 x s8 GEMM runs instead
  (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`, 1.3-1.6x the fp32 linear there).
  Its AVX2 inner step (vpmaddubsw) adds two u8 x s8 products into a saturating int16, so the
  weights take 7 bits (±63 per output channel) while the activations keep 8 (±127 per token,
  stored as u8 around a zero point of 128): 2 x 255 x 63 fits, and the result equals the integer
  math exactly (checked in the tests); 8-bit weights would saturate. The scales are ours: the
  integers go in with scale 1, and the per-token scale and the bias are applied after, as on the
  VNNI path. FFN-down stays in the activation dtype on this path (FBGEMM_INT8_LINEARS).
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch

from kernels import compute

from ..precision import cpu_flags
from .linear import Linear

logger = logging.getLogger(__name__)

INT8_LINEARS = ("qkv", "attn_out", "ffn_up", "ffn_down")
# With fbgemm's 7-bit weights the FFN-down projection (its input, the GELU output, carries the
# outlier channels) stays in the activation dtype: measured on the retrieval test's 250 documents,
# MiniLM's recall@10 is 0.956 with it in int8 and 0.964 without (fp32 0.968), for a third of
# the int8 FLOPs.
FBGEMM_INT8_LINEARS = ("qkv", "attn_out", "ffn_up")
_VNNI = ("avx512_vnni", "avx_vnni", "amx_int8")
# fbgemm's AVX2 step sums two u8 x s8 products in a saturating int16: u8 activations (±127
# around a zero point of 128, so up to 255) times weights of at most ±63 fit (2 x 255 x 63 < 32768)
FBGEMM_X_LEVELS, FBGEMM_W_LEVELS = 127, 63


def int8_kernel() -> str:
    """`int_mm` where the CPU has VNNI (or a GPU), else `fbgemm`; the `int8_kernel` compute path
    (--int8-kernel, EMBEDSERVE_INT8_KERNEL) overrides."""
    forced = compute.current().int8_kernel
    return forced if forced != "auto" else _detected_int8_kernel()


@functools.cache
def _detected_int8_kernel() -> str:
    has_fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
    return "int_mm" if any(f in cpu_flags() for f in _VNNI) or not has_fbgemm else "fbgemm"


def _qlinear(x: torch.Tensor, wT: torch.Tensor, ws: torch.Tensor, b: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """x (T, K) float -> (T, N) out_dtype; wT (K, N) int8, ws (N,) per-channel scales, b (N,) fp32."""
    x = x.float()
    xs = x.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127.0          # (T, 1) per-token scale
    xq = (x / xs).round().to(torch.int8)                                # |x / xs| <= 127 by construction
    return (torch._int_mm(xq, wT).float() * xs * ws + b).to(out_dtype)


def _quantize_tokens(x: torch.Tensor, levels: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) -> (integers in [-levels, levels] as float32, (T, 1) per-token scales)."""
    x = x.float()
    xs = x.abs().amax(1, keepdim=True).clamp_min(1e-8) / levels
    return (x / xs).round(), xs


def _dequantize(y: torch.Tensor, xs: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return (y * xs + b).to(out_dtype)


@functools.cache
def _compiled():
    return torch.compile(_qlinear, dynamic=True)


@functools.cache
def _compiled_fbgemm_steps():
    # fbgemm's op takes a packed-weights object that inductor does not trace: the quantize and
    # dequantize steps around it are compiled (fused) on their own
    return torch.compile(_quantize_tokens, dynamic=True), torch.compile(_dequantize, dynamic=True)


@functools.cache
def int8_available() -> str | None:
    """None where fused int8 linears run here, else why not (no compiler, no int8 matmul)."""
    try:
        x = torch.randn(5, 64)
        lin = Int8Linear(torch.randn(32, 64) * 0.05, torch.zeros(32), torch.float32)
        err = float((lin(x) - x @ lin.dequantized().T).abs().max())
        if not err < 1e-1:
            return f"int8 linear check failed (max error {err:.3g})"
    except Exception as exc:  # no C++ compiler for inductor, no _int_mm on this build, ...
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return None


class Int8Linear:
    """y = x W^T + b with W in int8 (per output channel) and x quantized per token on the fly."""

    __slots__ = ("wT", "ws", "b", "out_dtype", "kernel", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, out_dtype: torch.dtype, kernel: str | None = None):
        self.kernel = kernel or int8_kernel()
        w_levels = FBGEMM_W_LEVELS if self.kernel == "fbgemm" else 127
        w = weight.detach().float()                                     # (N, K)
        ws = w.abs().amax(1).clamp_min(1e-8) / w_levels                 # (N,)
        self.wT = (w / ws[:, None]).round().clamp(-w_levels, w_levels).to(torch.int8).t().contiguous()   # (K, N)
        self.ws = ws.contiguous()
        self.b = bias.detach().float().contiguous()
        self.out_dtype = out_dtype
        self.packed = None
        if self.kernel == "fbgemm":
            with warnings.catch_warnings():     # torch calls quantized tensors deprecated; int8_available()
                warnings.simplefilter("ignore")  # turns int8 off if a later torch removes them
                qw = torch._make_per_channel_quantized_tensor(self.wT.t().contiguous(), ws.double(),
                                                              torch.zeros_like(ws, dtype=torch.long), 0)
                self.packed = torch.ops.quantized.linear_prepack(qw, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return _compiled()(x, self.wT, self.ws, self.b, self.out_dtype)
        quantize, dequantize = _compiled_fbgemm_steps()
        xi, xs = quantize(x, float(FBGEMM_X_LEVELS))
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(xi, 1.0, FBGEMM_X_LEVELS + 1, self.packed)
        return dequantize(y, xs, self.b, self.out_dtype)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.wT, self.ws, self.b)

    def dequantized(self) -> torch.Tensor:
        """The weights as the int8 path sees them, (N, K) float32 (for checks)."""
        return self.wT.t().float() * self.ws[:, None]


def quantize_encoder(encoder, act_dtype: torch.dtype):
    """In place: the linears of every layer to int8 (all four with `_int_mm`; with fbgemm all but
    FFN-down, see FBGEMM_INT8_LINEARS), the rest of the encoder to `act_dtype`."""
    why = int8_available()
    if why is not None:
        raise RuntimeError(f"int8 linears do not run on this machine ({why}); use --dtype float32 or bfloat16")
    cast = lambda t: t.to(act_dtype)  # noqa: E731
    quantized = INT8_LINEARS if int8_kernel() == "int_mm" else FBGEMM_INT8_LINEARS
    for p in encoder.layers:
        for name in INT8_LINEARS:
            lin = p[name]
            p[name] = (Int8Linear(lin.weight, lin.bias, act_dtype) if name in quantized
                       else Linear(cast(lin.weight), cast(lin.bias), act=lin.act))    # packed, in act_dtype
        p["ln1"], p["ln2"] = tuple(map(cast, p["ln1"])), tuple(map(cast, p["ln2"]))
    encoder.word, encoder.pos, encoder.types = cast(encoder.word), cast(encoder.pos), cast(encoder.types)
    encoder.type0 = encoder.types[0]
    encoder.emb_ln = tuple(map(cast, encoder.emb_ln))
    encoder.dtype = act_dtype
    return encoder
