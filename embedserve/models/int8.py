"""int8 linear layers for the encoder (`--dtype int8`): per-token dynamic int8 activations ×
per-output-channel int8 weights, int32 accumulation in `torch._int_mm` (oneDNN's VNNI kernel),
with the quantize / dequantize steps fused by `torch.compile`.

Why this scheme (measured on all-MiniLM-L6-v2 and multilingual-e5-small, 2-core EPYC with
AVX512-VNNI; the study is summarized in BENCHMARKS.md): weights quantize well per output
channel; activations do not per tensor, because a few input channels carry outliers 20-60x
the median (the FFN-down input; a fixed QKV channel), so one scale per tensor crushes the rest
(plain dynamic quantization: min cosine 0.82-0.96 to fp32). One scale per token keeps every
linear in int8 at min cosine 0.996 (MiniLM) and 0.9986 (e5). Everything else (embeddings,
LayerNorm, attention, GELU, residuals) stays in the activation dtype: bf16 where the CPU has it
fast, else float32. Without a compiler the unfused steps cost more than the int8 matmul saves,
so int8 is refused where `torch.compile` does not work.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)


def _qlinear(x: torch.Tensor, wT: torch.Tensor, ws: torch.Tensor, b: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """x (T, K) float -> (T, N) out_dtype; wT (K, N) int8, ws (N,) per-channel scales, b (N,) fp32."""
    x = x.float()
    xs = x.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127.0          # (T, 1) per-token scale
    xq = (x / xs).round().to(torch.int8)                                # |x / xs| <= 127 by construction
    return (torch._int_mm(xq, wT).float() * xs * ws + b).to(out_dtype)


@functools.cache
def _compiled():
    return torch.compile(_qlinear, dynamic=True)


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

    __slots__ = ("wT", "ws", "b", "out_dtype")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, out_dtype: torch.dtype):
        w = weight.detach().float()                                     # (N, K)
        ws = w.abs().amax(1).clamp_min(1e-8) / 127.0                    # (N,)
        self.wT = (w / ws[:, None]).round().clamp(-127, 127).to(torch.int8).t().contiguous()   # (K, N)
        self.ws = ws.contiguous()
        self.b = bias.detach().float().contiguous()
        self.out_dtype = out_dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _compiled()(x, self.wT, self.ws, self.b, self.out_dtype)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.wT, self.ws, self.b)

    def dequantized(self) -> torch.Tensor:
        """The weights as the int8 path sees them, (N, K) float32 (for checks)."""
        return self.wT.t().float() * self.ws[:, None]


def quantize_encoder(encoder, act_dtype: torch.dtype):
    """In place: every linear of every layer to int8, the rest of the encoder to `act_dtype`."""
    why = int8_available()
    if why is not None:
        raise RuntimeError(f"int8 linears do not run on this machine ({why}); use --dtype float32 or bfloat16")
    cast = lambda t: t.to(act_dtype)  # noqa: E731
    for p in encoder.layers:
        for name in ("qkv", "attn_out", "ffn_up", "ffn_down"):
            p[name] = Int8Linear(p[name].weight, p[name].bias, act_dtype)
        p["ln1"], p["ln2"] = tuple(map(cast, p["ln1"])), tuple(map(cast, p["ln2"]))
    encoder.word, encoder.pos, encoder.type0 = cast(encoder.word), cast(encoder.pos), cast(encoder.type0)
    encoder.emb_ln = tuple(map(cast, encoder.emb_ln))
    encoder.dtype = act_dtype
    return encoder
