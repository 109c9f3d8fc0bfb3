"""Packed (oneDNN) linears equal F.linear; the model falls back to F.linear where packing
does not run or is switched off."""

import pytest
import torch
import torch.nn.functional as F

from kernels import compute
from embedserve.models import linear as linear_mod
from embedserve.models.linear import Linear, packing_available


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 0.15)])
@pytest.mark.parametrize("rows", [1, 16, 165])
def test_packed_linear_equals_f_linear(dtype, tol, rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(3072, 576, generator=g).to(dtype), torch.randn(3072, generator=g).to(dtype)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    ref = F.linear(x.double(), w.double(), b.double())
    lin = Linear(w.clone(), b)
    why = packing_available(dtype, "cpu")
    # packed exactly where the probe says it runs, and then the row-major copy is not kept
    assert (lin.packed is not None) == (why is None) and (lin.weight is None) == (why is None)
    out = lin(x)
    assert out.dtype == dtype and out.shape == (rows, 3072)
    # fp32: strict fp32 math (outputs ~25 in magnitude); bf16: bf16 rounding of the output
    assert float((out.double() - ref).abs().max()) < tol * max(1.0, float(ref.abs().max()) / 25)
    assert float((out.double() - F.linear(x, w, b).double()).abs().max()) < tol * 2


def test_pack_false_keeps_the_weight_and_the_switch_turns_packing_off():
    w = torch.randn(8, 16)
    lin = Linear(w, pack=False)
    assert lin.packed is None and lin.weight is w and lin.tensors() == (w,)
    assert "CPU path" in packing_available(torch.float32, "cuda")
    with compute.override(packed_linear=False):
        assert packing_available(torch.float32, "cpu") == "packed_linear=false"
        lin = Linear(w)
        assert lin.packed is None and torch.equal(lin(torch.eye(16)), w.T)
    if packing_available(torch.float32, "cpu") is None:          # the switch back: packed again
        assert Linear(w).packed is not None


@pytest.mark.parametrize("act,fn", [("gelu", F.gelu), ("gelu_tanh", lambda y: F.gelu(y, approximate="tanh")),
                                    ("relu", F.relu)])
@pytest.mark.parametrize("pack,fused", [(True, True), (True, False), (False, False)])
def test_fused_activation_equals_activation_after_the_linear(monkeypatch, act, fn, pack, fused):
    """The activation as a oneDNN post-op, in place after the packed matmul (the faster of the two
    is what `fused_activation_preferred` picks per machine), or after F.linear: the same values."""
    monkeypatch.setattr(linear_mod, "fused_activation_preferred", lambda a, d: fused)
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(1536, 384, generator=g) * 0.05, torch.randn(1536, generator=g)
    x = torch.randn(33, 384, generator=g)
    ref = fn(F.linear(x.double(), w.double(), b.double()))
    lin = Linear(w.clone(), b, pack=pack, act=act)
    assert lin.fused == (fused and lin.packed is not None)
    out = lin(x)
    assert float((out.double() - ref).abs().max()) < 1e-4


@pytest.mark.skipif(packing_available(torch.float32, "cpu") is not None, reason="no oneDNN packing here")
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu"])
def test_the_fused_or_in_place_choice_is_timed_once_and_gives_a_boolean(act):
    choice = linear_mod.fused_activation_preferred(act, torch.float32)
    assert isinstance(choice, bool)
    assert linear_mod.fused_activation_preferred(act, torch.float32) is choice      # cached
    assert Linear(torch.randn(64, 32), act=act).fused is choice


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="activation 'swish'"):
        Linear(torch.randn(4, 4), act="swish")


def test_small_rows_keeps_the_row_major_weight_for_gemv_where_it_runs(monkeypatch):
    """`small_rows`: a few rows through `gemv` on the kept original, more through the packed (or
    plain) matmul; the same values either way. Not kept with an activation, with
    EMBEDSERVE_DECODE_GEMV=0, or for bf16 where its GEMV has no AVX512-BF16 (test_bf16_small_rows_...)."""
    from kernels import cpu_attention
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 64, generator=g) * 0.1, torch.randn(96, generator=g)
    why = linear_mod.small_rows_kernel(torch.float32)
    lin = Linear(w, b, small_rows=True)
    assert (lin.rows_weight is w) == (why is None)
    assert lin.extra_bytes() == (w.numel() * 4 if why is None and lin.packed is not None else 0)
    calls = []
    real = cpu_attention.gemv
    monkeypatch.setattr(cpu_attention, "gemv", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, cpu_attention.GEMV_MAX_ROWS, cpu_attention.GEMV_MAX_ROWS + 1, 100):
        x = torch.randn(rows, 64, generator=g)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert calls == ([1, cpu_attention.GEMV_MAX_ROWS] if why is None else [])
    assert lin(torch.empty(0, 64)).shape == (0, 96)                  # no rows: the matmul's empty result
    assert (Linear(w.bfloat16(), small_rows=True).rows_weight is None) == \
        (linear_mod.small_rows_kernel(torch.bfloat16) is not None)
    assert Linear(w, small_rows=True, act="gelu").rows_weight is None
    assert Linear(w).rows_weight is None and Linear(w).extra_bytes() == 0
    with compute.override(decode_gemv=False):
        assert linear_mod.small_rows_kernel(torch.float32) == "decode_gemv=false"
        assert Linear(w, small_rows=True).rows_weight is None


def test_bf16_small_rows_take_the_bf16_gemv_where_the_cpu_has_avx512_bf16(monkeypatch):
    """bf16 `small_rows`: kept and used for up to GEMV_BF16_MAX_ROWS bf16 rows where the C kernels
    have AVX512-BF16 dot products (and --fast-bf16 is not 0); the values are F.linear's in bf16 up
    to the order of the float32 sums (a bf16 rounding step at most). Elsewhere not kept at all."""
    from kernels import cpu_decode
    g = torch.Generator().manual_seed(5)
    w, b = (torch.randn(72, 64, generator=g) * 0.1).bfloat16(), torch.randn(72, generator=g).bfloat16()
    why = linear_mod.small_rows_kernel(torch.bfloat16)
    assert (why is None) == (cpu_decode.bf16_gemv_native() and compute.current().fast_bf16 != "0"
                             and compute.current().decode_gemv)
    lin = Linear(w, b, small_rows=True)
    assert (lin.rows_weight is w) == (why is None)
    calls = []
    real = cpu_decode.gemv_bf16
    monkeypatch.setattr(cpu_decode, "gemv_bf16", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, cpu_decode.GEMV_BF16_MAX_ROWS, cpu_decode.GEMV_BF16_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        out, ref = lin(x), F.linear(x.float(), w.float(), b.float())
        assert out.dtype == torch.bfloat16
        assert float((out.float() - ref).abs().max()) <= 2 ** -7 * float(ref.abs().max()) + 1e-6
    assert calls == ([1, cpu_decode.GEMV_BF16_MAX_ROWS] if why is None else [])
    with compute.override(fast_bf16="0"):            # imitates the AVX2 kind: oneDNN for every row count
        assert linear_mod.small_rows_kernel(torch.bfloat16) is not None
        assert Linear(w, small_rows=True).rows_weight is None
