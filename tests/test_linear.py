"""Packed (oneDNN) linears equal F.linear; the model falls back to F.linear where packing
does not run or is switched off."""

import pytest
import torch
import torch.nn.functional as F

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


def test_pack_false_keeps_the_weight_and_env_switches_packing_off(monkeypatch):
    w = torch.randn(8, 16)
    lin = Linear(w, pack=False)
    assert lin.packed is None and lin.weight is w and lin.tensors() == (w,)
    assert "CPU path" in packing_available(torch.float32, "cuda")
    packing_available.cache_clear()
    monkeypatch.setenv(linear_mod.ENV, "0")
    try:
        assert packing_available(torch.float32, "cpu") == f"{linear_mod.ENV}=0"
        lin = Linear(w)
        assert lin.packed is None and torch.equal(lin(torch.eye(16)), w.T)
    finally:
        packing_available.cache_clear()


@pytest.mark.parametrize("act,fn", [("gelu", F.gelu), ("gelu_tanh", lambda y: F.gelu(y, approximate="tanh")),
                                    ("relu", F.relu)])
@pytest.mark.parametrize("pack", [True, False])
def test_fused_activation_equals_activation_after_the_linear(act, fn, pack):
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(1536, 384, generator=g) * 0.05, torch.randn(1536, generator=g)
    x = torch.randn(33, 384, generator=g)
    ref = fn(F.linear(x.double(), w.double(), b.double()))
    out = Linear(w.clone(), b, pack=pack, act=act)(x)
    assert float((out.double() - ref).abs().max()) < 1e-4


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="activation 'swish'"):
        Linear(torch.randn(4, 4), act="swish")
