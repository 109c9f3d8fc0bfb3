"""y = x W^T + b with the weight reordered once, at load, into oneDNN's blocked layout.

`F.linear` on a CPU hands the row-major weight to the matmul library on every call; for the
shapes these models run (a few to a few thousand rows against 0.3-30 M-element weights) that
costs more than the product. oneDNN's `_linear_pointwise` on a weight reordered once by
`_reorder_linear_weight` (what `torch.compile`'s freezing pass does for CPU linears) measured
here, 2-core EPYC with AVX512-BF16, against `F.linear` in the same dtype:

    bf16, (16, 576) x (3072, 576)^T:  0.073 vs 0.112 ms   (1 row: 0.034 vs 0.069)
    fp32, (16, 576) x (3072, 576)^T:  0.130 vs 0.364 ms   (1,024 rows: 7.3 vs 16.8 ms)

fp32 stays fp32 (oneDNN's default fp32 math is strict): errors against a float64 product are
~1e-4 on outputs of magnitude ~25, twice F.linear's, far inside the equivalence tests' bounds.

Packing is used where a probe at first use shows the op runs and agrees with `F.linear` on
this machine and device (a CPU with oneDNN); elsewhere, or with --no-packed-linear,
it is plain `F.linear`. The packed weight replaces the original (same bytes, no copy kept),
except where `small_rows` keeps it too: the decoder's steps of a few sequences are bound by
reading the weights once, and `kernels.cpu_attention.gemv` reads the row-major original faster
than oneDNN reads its packed copy (1.06-1.47x at 1-32 rows, fp32, AVX2); in bf16 on a CPU with
AVX512-BF16, `kernels.cpu_decode.gemv_bf16` (dot products in vdpbf16ps); see `small_rows_kernel`.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from kernels import compute, cpu_attention, cpu_decode
from kernels.cpu_attention import GEMV_MAX_ROWS
from kernels.cpu_decode import GEMV_BF16_MAX_ROWS

logger = logging.getLogger(__name__)

def packing_available(dtype: torch.dtype, device_type: str = "cpu") -> str | None:
    """None where packed linears run and agree with F.linear in `dtype`, else why not (the
    `packed_linear` compute path, `kernels.compute`, turns them off)."""
    if not compute.current().packed_linear:
        return "packed_linear=false"
    return _packing_probe(dtype, device_type)


@functools.cache
def _packing_probe(dtype: torch.dtype, device_type: str) -> str | None:
    """Whether the packed op runs and agrees with F.linear here (probed once per dtype)."""
    if device_type != "cpu":
        return f"packed linears are a CPU path (device {device_type})"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    try:
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(48, 64, generator=g) * 0.1).to(dtype)
        b = torch.randn(48, generator=g).to(dtype)
        x = torch.randn(5, 64, generator=g).to(dtype)
        with torch.inference_mode():
            ours = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 16), b,
                                                      "none", [], "")
            ref = F.linear(x.float(), w.float(), b.float())
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        err = float((ours.float() - ref).abs().max())
        if not err <= tol:
            return f"packed linear check failed in {dtype} (max error {err:.3g})"
    except Exception as exc:  # no oneDNN kernel for this dtype on this CPU, an op missing, ...
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return None


def small_rows_kernel(dtype: torch.dtype, device_type: str = "cpu") -> str | None:
    """None where `Linear(small_rows=True)` takes a GEMV for a few rows (float32 on a CPU with the
    C kernels built; bfloat16 where they are built with AVX512-BF16 dot products and bf16 is not
    turned slow by --fast-bf16 0), else why not; the `decode_gemv` compute path turns it off."""
    if not compute.current().decode_gemv:
        return "decode_gemv=false"
    if device_type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return f"the small-batch kernel is a float32 / bfloat16 CPU path (here {dtype} on {device_type})"
    why = cpu_attention.available()
    if why is None and dtype == torch.bfloat16 and (compute.current().fast_bf16 == "0"
                                                     or not cpu_decode.bf16_gemv_native()):
        return "the bf16 small-batch kernel needs AVX512-BF16 (its dot products)"
    return why


# activation applied to the output: (oneDNN post-op, its algorithm, torch's function in place
# on the matmul's fresh output)
ACTIVATIONS = {
    None: ("none", "", None),
    "gelu": ("gelu", "none", torch.ops.aten.gelu_),                             # erf, as HF's "gelu"
    "gelu_tanh": ("gelu", "tanh", lambda y: torch.ops.aten.gelu_(y, approximate="tanh")),
    "relu": ("relu", "", torch.relu_),
}


@functools.cache
def fused_activation_preferred(act: str, dtype: torch.dtype) -> bool:
    """Whether oneDNN's post-op is faster here than the packed matmul followed by torch's
    activation in place, timed once per process (interleaved, ~0.2 s): on a 2-core AVX2 EPYC the
    erf GELU post-op added 11.8 ms to a 4096 x 384 x 1536 fp32 matmul of 39.4 ms, torch's
    in-place GELU 3.8 ms. Same values either way (tests/test_linear.py)."""
    import statistics
    import time
    post, algorithm, inplace = ACTIVATIONS[act]
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 384, generator=g).to(dtype)
        w = torch.ops.mkldnn._reorder_linear_weight((torch.randn(1536, 384, generator=g) * 0.05).to(dtype), 16)
        b = torch.randn(1536, generator=g).to(dtype)
        fns = {True: lambda: torch.ops.mkldnn._linear_pointwise(x, w, b, post, [], algorithm),
               False: lambda: inplace(torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""))}
        times: dict[bool, list[float]] = {True: [], False: []}
        with torch.inference_mode():
            for fn in fns.values():
                fn()
            for _ in range(9):
                for fused, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    times[fused].append(time.perf_counter() - t0)
    except Exception:  # the op is missing here: keep the fused call, whose own failure is the packing probe's
        return True
    fused = statistics.median(times[True]) <= statistics.median(times[False])
    logger.info("packed linears: %s %s (%.2f ms fused post-op vs %.2f ms in place after the matmul, %s)",
                act, "fused as a oneDNN post-op" if fused else "in place after the matmul",
                statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3, dtype)
    return fused


class Linear:
    """One linear layer: packed for oneDNN where that runs, plain `F.linear` otherwise; `act`
    (a key of ACTIVATIONS) is fused into the packed matmul as a post-op where that is faster
    here (`fused_activation_preferred`), else applied in place to the matmul's fresh output.

    `weight` (N, K) is the original while `pack=False` (the int8 path quantizes from it) and
    None once packed; `bias` (N,) or None. With `small_rows` (no activation) and where
    `small_rows_kernel` allows, `rows_weight` keeps the row-major original beside the packed copy
    (the same tensor where the caller holds it anyway, as a tied head's embedding matrix) and
    inputs of at most `cpu_attention.GEMV_MAX_ROWS` rows go through `gemv` (bf16:
    `cpu_decode.GEMV_BF16_MAX_ROWS` rows through `cpu_decode.gemv_bf16`)."""

    __slots__ = ("weight", "bias", "packed", "act", "rows_weight", "fused")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True,
                 act: str | None = None, small_rows: bool = False):
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not one of {sorted(k for k in ACTIVATIONS if k)}")
        self.weight, self.bias, self.packed, self.act, self.rows_weight = weight, bias, None, act, None
        if small_rows and act is None and small_rows_kernel(weight.dtype, weight.device.type) is None:
            self.rows_weight = weight.contiguous()
        self.fused = False
        if pack and packing_available(weight.dtype, weight.device.type) is None:
            with torch.inference_mode():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 16)
            self.weight = None
            self.fused = act is not None and fused_activation_preferred(act, weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        post, algorithm, inplace = ACTIVATIONS[self.act]
        if self.rows_weight is not None and x.dim() == 2 and 0 < x.shape[0]:
            if self.rows_weight.dtype == torch.bfloat16:
                if x.shape[0] <= GEMV_BF16_MAX_ROWS and x.dtype == torch.bfloat16:
                    return cpu_decode.gemv_bf16(x, self.rows_weight, self.bias)
            elif x.shape[0] <= GEMV_MAX_ROWS:
                return cpu_attention.gemv(x, self.rows_weight, self.bias)
        if self.packed is not None:
            if self.fused or inplace is None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, post, [], algorithm)
            return inplace(torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], ""))
        y = F.linear(x, self.weight, self.bias)
        return y if inplace is None else inplace(y)

    def extra_bytes(self) -> int:
        """Bytes held beyond `tensors()`: the row-major copy kept for `gemv` beside the packed one."""
        return self.rows_weight.numel() * self.rows_weight.element_size() if self.rows_weight is not None \
            and self.packed is not None else 0

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.weight if self.packed is None else self.packed, self.bias) if t is not None)
