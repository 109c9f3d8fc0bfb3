"""Weight-only int8 for the decoder (`serve --decode-weights int8`, or `auto` behind the accuracy
gate of `int8_gate`): each linear's weight as int8 per output channel, the activations staying
in the model's dtype (float32, or bfloat16 where that is fast) between the linears.

Why: a decode step of a few sequences reads every weight once and does little else with it, so
its time is the weight bytes over the memory bandwidth; int8 weights are a quarter of fp32's
bytes (half of bf16's). SmolLM2-135M's 30 layers and tied head read 538 MB per fp32 step and
135 MB in int8. The kernel (`kernels.cpu_attention.gemv_w8`, blocked layout: see
cpu_paged_attention.c) scales each row of activations by a power of two into int16 (every value
to within 2^-15 of the row's largest; a bf16 row's top 8 binades exactly) and sums the int8 x
int16 products exactly in integers (AVX512-VNNI vpdpwssd or AVX2 vpmaddwd), then applies the
row's and the channel's scales: one widening load and one dot instruction per 16-32 weights,
where converting each weight to float and FMAing it kept the step under the memory bandwidth.
Prompt chunks of hundreds of rows go through the same kernel (each block's weights stay in L1
while every row of x passes), so no fp32 copy of the weights is kept.

Quantization: symmetric per output channel, scale = max |w_row| / 127, q = round(w / scale);
no calibration data (so every text the gate reads is held out). The embedding lookup keeps the
table in the model's dtype; a tied head quantizes its own copy.
"""

from __future__ import annotations

import torch

from kernels import cpu_attention

DECODE_WEIGHTS = ("auto", "native", "int8")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (q int8 (N, K), scale float32 (N,)) with w ≈ q * scale[:, None]; a row of
    zeros gets scale 1 (its q is zero either way)."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_available(device_type: str) -> str | None:
    """None where weight-only int8 decode runs here, else why not."""
    if device_type != "cpu":
        return f"weight-only int8 decode is a CPU path (the decoder runs on {device_type})"
    why = cpu_attention.available()
    return None if why is None else f"its kernel does not run here: {why}"


class WeightInt8Linear:
    """y = x (q * scale)^T + b through `gemv_w8`, for x (M, K) float32 or bfloat16 (y in x's
    dtype). Same interface as `linear.Linear` where the decoder uses it."""

    __slots__ = ("packed", "scale", "bias", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        q, self.scale = quantize_per_channel(weight)
        self.out_features, self.in_features = q.shape
        self.packed = cpu_attention.pack_w8(q)
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_attention.gemv_w8(x, self.packed, self.scale, self.bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 (N, K) weight this layer multiplies by (for tests and the gate's report)."""
        q = cpu_attention.unpack_w8(self.packed, self.out_features, self.in_features)
        return q.to(torch.float32) * self.scale[:, None]

    def extra_bytes(self) -> int:
        return 0

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.packed, self.scale, self.bias) if t is not None)

    def weight_bytes(self) -> int:
        """Bytes read per call: the int8 weights (padding included) and the scales."""
        return self.packed.numel() + self.scale.numel() * 4
