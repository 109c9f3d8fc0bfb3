"""kernels.cpu_decode.gemv_bf16: a bf16 decoder's linears for a few rows (vdpbf16ps where the CPU
has AVX512-BF16; widened to float elsewhere), against a float64 product and torch's bf16 matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_attention, cpu_decode

WHY = cpu_attention.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")


@pytest.mark.parametrize("M", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("N,K", [(960, 576), (576, 1536), (13, 37), (8, 32), (70, 100)])
@pytest.mark.parametrize("bias", [True, False])
def test_gemv_bf16_sums_in_float32_and_rounds_once(M, N, K, bias):
    """Row blocks of 8 with a tail (13, 70), K with a tail under 32 (37, 100), one to nine x rows
    (four at a time, with a remainder). The float32 sum of exact bf16 products, rounded to bf16
    once: within half a bf16 step of the float64 result (plus float32's summation error), as close
    as torch's own bf16 matmul is."""
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    x = torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    out = cpu_decode.gemv_bf16(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    err = (out.double() - ref).abs()
    bound = ref.abs() * 2 ** -8 + 1e-6 * K ** 0.5 * float(ref.abs().max())
    assert bool((err <= bound).all()), float((err - bound).max())
    theirs = F.linear(x, w, b)
    assert float((out.double() - theirs.double()).abs().max()) <= 2 ** -7 * float(ref.abs().max()) + 1e-6
    # a column slice (not contiguous) is read as its values
    wide = torch.randn(M, K + 3, generator=g).bfloat16()
    assert torch.equal(cpu_decode.gemv_bf16(wide[:, 3:], w, b), cpu_decode.gemv_bf16(wide[:, 3:].contiguous(), w, b))


def test_gemv_bf16_refuses_what_it_cannot_read():
    x, w = torch.randn(2, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    for bad_x, bad_w in ((x.float(), w), (x, w.float()), (x, torch.randn(16, 8).bfloat16().T),
                         (torch.randn(2, 15).bfloat16(), w), (x[0], w)):
        with pytest.raises(ValueError, match="gemv_bf16 takes bf16 x"):
            cpu_decode.gemv_bf16(bad_x, bad_w)


def test_the_bf16_descriptor_is_kind_2_and_the_float32_step_refuses_it():
    w = torch.randn(8, 16).bfloat16()
    d = cpu_decode.linear_descriptor(w, None)
    assert d is not None and d.kind == 2 and (d.n, d.k) == (8, 16)
    assert cpu_decode.linear_descriptor(w.float(), None).kind == 0
    assert cpu_decode.linear_descriptor(w, w[0].float()[:8]) is not None
    assert cpu_decode.linear_descriptor(w, torch.zeros(8).bfloat16()) is None      # a bf16 bias: per op
    caches = [(torch.zeros(2, 16, 1, 16), torch.zeros(2, 16, 1, 16))]
    norms = [torch.ones(16)] * 3
    with pytest.raises(ValueError, match="float32 with fp32 or int8 linears"):
        cpu_decode.DecodeLayers([d] * 4, norms, caches, 16, 8, 1, 1, 16, 1e-5, [w])
