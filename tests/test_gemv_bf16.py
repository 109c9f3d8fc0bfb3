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


def test_the_bf16_decode_studies_say_not_run_where_the_gemv_does_not_run(tmp_path):
    """`cpu_paths --only decoder_bf16` and `served_decode_paths` time nothing where the bf16 GEMV
    is off (here: imitating the AVX2 kind), and say why; the table renders a measured row."""
    import json

    from embedserve.studies import cpu_paths, served_decode_paths
    from kernels import compute
    with compute.override(fast_bf16="0"):
        assert cpu_paths.decoder_bf16() == [{"not_run": "the bf16 small-batch kernel needs AVX512-BF16 (its dot products)"}]
        assert served_decode_paths.main(["--out", str(tmp_path / "s.json")]) == 0
    assert "AVX512-BF16" in json.loads((tmp_path / "s.json").read_text())["not_run"]
    row = {"sequences": 1, "ms_per_step": {"as run": 13.0, "oneDNN per op": 19.5, "GEMV up to 8 rows": 13.1},
           "as_run_over_onednn": 1.5, "gemv8_over_onednn": 1.49, "weight_gb_per_s_as_run": 20.7}
    md = cpu_paths.markdown({"cpu": "x", "flags": ["avx512_bf16"], "threads": 2, "date": "d", "decoder_bf16": [row]})
    assert "| 1 sequences | 13.0 | 19.5 | 13.1 | 1.50× | 1.49× | 20.7 |" in md
