"""Weight-only int8 decoding and the one-call decode step: the int8 kernel against the float
product of its dequantized weights, the fused step against the per-op path (bit for bit, fp32
and int8), the accuracy gate on the real SmolLM2 (passes) and on a broken quantization
(fails), and `--decode-weights` choosing by the gate's cached report."""

import json
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from embedserve.errors import ConfigError
from embedserve.models import decode_int8, int8_gate
from embedserve.models.attention_dispatch import AttentionMetadata
from embedserve.models.linear import small_rows_kernel
from embedserve.models.llama import LlamaConfig, LlamaModel, load_weights
from embedserve.serve import load_decoder
from kernels import compute, cpu_attention, cpu_decode


def _quantized(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3 % n] = 0.0                                              # a row of zeros keeps a finite scale
    q, scale = decode_int8.quantize_per_channel(w)
    return w, q, scale


def test_quantization_is_per_channel_within_half_a_step():
    w, q, scale = _quantized(37, 50)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())
    assert float(scale[3]) == 1.0 and int(q[3].abs().max()) == 0
    assert torch.equal(cpu_attention.unpack_w8(cpu_attention.pack_w8(q), 37, 50), q)


def _int16_rows_reference(x, q, scale, bias):
    """gemv_w8's arithmetic spelled out: each row (float32 or bf16 values) times 2^(15 - e)
    (max |x| < 2^e), rounded to integers (ties to even), the integer products summed exactly
    (float64 holds these sums exactly), times scale * 2^(e - 15) in float64 (one rounding), rounded
    to float32, + bias."""
    x = x.double()
    amax = x.abs().amax(1, keepdim=True)
    e = torch.frexp(amax.float())[1].double()
    nz = amax > 0
    xq = torch.round(x * torch.where(nz, torch.pow(2.0, 15 - e), torch.zeros_like(amax))).clamp(-32767, 32767)
    sums = xq @ q.double().T
    y = (sums * scale.double() * torch.where(nz, torch.pow(2.0, e - 15), torch.zeros_like(amax))).float()
    return y if bias is None else y + bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 17, 64])
@pytest.mark.parametrize("n,k", [(8, 16), (37, 50), (200, 576), (13, 4100)])
def test_gemv_w8_sums_the_int16_rows_exactly(dtype, rows, n, k):
    """Rows go through int16 and integer sums: the result is that arithmetic's to the bit (every
    ISA path of the kernel gives the same integers), and a row of zeros or one of tiny values
    (2^-120: the power-of-two scale leaves float's range; 2^-100 and 2^-101 with a subnormal value:
    the vector loop's last row and the scalar loop's first) still comes out right."""
    _, q, scale = _quantized(n, k, seed=n * k)
    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=g)
    x[rows // 2] *= 2.0 ** -120
    if rows > 2:
        x[1] = 0.0
    if rows > 4:           # largest |x| just under a power of two: float32's rounds to 2^15, held at 2^15 - 1
        x[3] = x[3].clamp(-0.5, 0.5)
        x[3, k // 2] = 1.0 - 2.0 ** -24
        x[3, k // 2 + 1] = -(1.0 - 2.0 ** -24)
    for r, top in ((4, 2.0 ** -100), (5, 2.0 ** -101)):      # either side of the vector loop's limit
        if rows > r:       # largest |x| 0.75 * top, and one subnormal value (1.2e-38 is float's least normal)
            x[r] = x[r] / x[r].abs().max() * 0.75 * top
            x[r, 1] = 3e-39
    x = x.to(dtype)
    bias = torch.randn(n, generator=g)
    packed = cpu_attention.pack_w8(q)
    got = cpu_attention.gemv_w8(x, packed, scale, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert torch.equal(got, _int16_rows_reference(x, q, scale, bias).to(dtype))
    if rows > 2:
        assert torch.equal(got[1], bias.to(dtype))
    # without a bias, which would hide the tiny rows' outputs (~1e-30 and less) under its rounding
    unbiased = cpu_attention.gemv_w8(x, packed, scale)
    want = _int16_rows_reference(x, q, scale, None).to(dtype)
    assert torch.equal(unbiased, want)
    assert bool((want[rows // 2] != 0).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx512_vnni_path_sums_the_same_integers_on_any_cpu(avx512_emulated, dtype):
    """The AVX512-VNNI path (vpdpwssd, 4 rows of x a pass) runs on AVX-512 CPUs only, which most
    machines here are not: built with its intrinsics emulated, it must give the int16 arithmetic's
    result to the bit, as the native build does, at row counts around its groups of 4, a K past
    one 4,096-column integer chunk, and 1-3 threads."""
    assert avx512_emulated.w8_int_path() == 2
    fn = avx512_emulated.gemv_w8_bf16 if dtype == torch.bfloat16 else avx512_emulated.gemv_w8_f32
    for n, k in [(8, 16), (37, 50), (200, 576), (13, 4100)]:
        _, q, scale = _quantized(n, k, seed=n * k)
        packed = cpu_attention.pack_w8(q)
        g = torch.Generator().manual_seed(k)
        bias = torch.randn(n, generator=g)
        for rows in (1, 2, 3, 4, 5, 9, 17):
            x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
            if rows > 2:
                x[1] = 0.0
            want = _int16_rows_reference(x, q, scale, bias).to(dtype)
            xp = F.pad(x, (0, packed.shape[1] - k)).contiguous()
            for threads in (1, 2, 3):
                y = torch.empty(rows, n)
                assert fn(xp.data_ptr(), packed.data_ptr(), scale.data_ptr(), bias.data_ptr(), y.data_ptr(),
                          rows, n, packed.shape[1], threads) == 0
                assert torch.equal(y.to(dtype), want), (n, k, rows, threads)


def test_the_native_build_sums_with_this_cpus_integer_path():
    """AVX512-VNNI where the compiler targets it for this CPU (-march=native), else AVX2's."""
    flags = open("/proc/cpuinfo").read().split()
    lib, why = cpu_attention.load_library()
    assert why is None, why
    assert lib.w8_int_path() == (2 if {"avx512bw", "avx512_vnni"} <= set(flags) else 1 if "avx2" in flags else 0)


@pytest.mark.parametrize("rows", [1, 3, 17, 600])
@pytest.mark.parametrize("n,k", [(8, 16), (37, 50), (200, 576), (13, 1100)])
def test_gemv_w8_is_the_dequantized_float_product_within_the_int16_bound(rows, n, k):
    """Against the float64 product of the dequantized weight: each x is off by at most half an
    int16 step (2^(e - 16), max |x| < 2^e), so an output by at most that times sum_k |q scale|,
    plus float32's rounding of the result. Rows with one outlier 2^10 above the rest included
    (the small values then keep ~5 bits: the bound still holds, relative to the outlier)."""
    w, q, scale = _quantized(n, k, seed=n + k)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    x[::2, k // 3] = 1024.0
    bias = torch.randn(n, generator=g)
    wd = q.double() * scale.double()[:, None]
    ref = F.linear(x.double(), wd, bias.double())
    got = cpu_attention.gemv_w8(x, cpu_attention.pack_w8(q), scale, bias)
    step = torch.pow(2.0, torch.frexp(x.abs().amax(1).float())[1].double() - 16)      # half an int16 step
    bound = step[:, None] * wd.abs().sum(1)[None, :] + 2.0 ** -23 * ref.abs() + 1e-30
    assert bool(((got.double() - ref).abs() <= bound * 1.0001).all())


def test_gemv_w8_bf16_does_not_overflow_at_the_largest_products():
    """Every weight at +-127 and every activation at its row's largest: a lane's int32 sum would
    wrap past 4,096 columns, so longer rows are summed in chunks (here 9,008 columns)."""
    k = 9008
    q = torch.full((16, k), 127, dtype=torch.int8)
    q[1] = -127
    x = torch.full((2, k), 3.0, dtype=torch.bfloat16)
    got = cpu_attention.gemv_w8(x, cpu_attention.pack_w8(q), torch.ones(16)).float()
    want = torch.tensor(3.0 * 127 * k).to(torch.bfloat16).float()
    assert float(got[0, 0]) == float(want) and float(got[1, 1]) == -float(want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_w8_a_row_with_inf_or_nan_comes_out_nan_and_leaves_the_others(dtype):
    _, q, scale = _quantized(24, 64, seed=5)
    x = torch.randn(4, 64)
    x[1, 7], x[2, 0] = float("inf"), float("nan")
    x = x.to(dtype)
    got = cpu_attention.gemv_w8(x, cpu_attention.pack_w8(q), scale)
    assert bool(got[1:3].isnan().all())
    assert torch.equal(got[[0, 3]], _int16_rows_reference(x[[0, 3]], q, scale, None).to(dtype))


def test_weight_int8_linear_reads_a_quarter_of_fp32s_bytes():
    w, _, _ = _quantized(64, 96)
    lin = decode_int8.WeightInt8Linear(w)
    assert lin.weight_bytes() == 64 * 96 + 64 * 4
    assert float((lin.dequantized() - w).abs().max()) <= float(w.abs().max()) / 254 + 1e-7


def _prefill_then_decode(model, prompt, token, fused, kv_dtype=None):
    """Prefill `prompt` (one sequence), then one decode step of `token`; the step's final hidden
    state, with the fused step on or off (the KV cache in `kv_dtype`, default the model's)."""
    cfg, bs = model.cfg, 16
    T = len(prompt)
    nb = -(-(T + 1) // bs)
    shape = (nb, bs, cfg.num_key_value_heads, cfg.head_dim)
    kv_dtype = kv_dtype or model.dtype
    caches = [(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
              for _ in range(cfg.num_hidden_layers)]
    table = torch.arange(nb, dtype=torch.int32)[None]

    def meta(start, n):
        return AttentionMetadata(slot_mapping=torch.arange(start, start + n), block_tables=table,
                                 context_lens=torch.tensor([start + n], dtype=torch.int32),
                                 cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), num_decodes=int(n == 1),
                                 context_lens_list=[start + n], q_lens_list=[n])
    model.forward(torch.tensor(prompt), torch.arange(T), caches, meta(0, T))
    with compute.override(fused_decode=fused):
        used = model._fused(caches, meta(T, 1)) is not None
        hidden = model.forward(torch.tensor([token]), torch.tensor([T]), caches, meta(T, 1))
    return hidden, used


# bf16 native weights take the step where the bf16 GEMV has AVX512-BF16 (elsewhere: the next test)
BF16_GEMV = small_rows_kernel(torch.bfloat16) is None


# float32 decoders also over a 16-bit KV cache (`--kv-cache-dtype float16|bfloat16`)
@pytest.mark.parametrize("dtype,linear_weights,kv_dtype",
                         [(torch.float32, "native", None), (torch.float32, "int8", None),
                          (torch.bfloat16, "int8", None), (torch.float32, "int8", torch.float16),
                          (torch.float32, "native", torch.bfloat16)]
                         + ([(torch.bfloat16, "native", None)] if BF16_GEMV else []))
def test_the_one_call_decode_step_equals_the_per_op_path_bit_for_bit(smollm2_dir, smollm2, dtype, linear_weights,
                                                                     kv_dtype):
    _, tok = smollm2
    model = LlamaModel.from_dir(smollm2_dir, dtype, linear_weights=linear_weights)
    prompt = tok("The capital of France is").input_ids
    fused, used = _prefill_then_decode(model, prompt, 12366, fused=True, kv_dtype=kv_dtype)
    model._fused_memo = None
    plain, used_plain = _prefill_then_decode(model, prompt, 12366, fused=False, kv_dtype=kv_dtype)
    assert used and not used_plain, "the switch turns the one-call step on and off"
    assert fused.dtype == dtype and torch.equal(fused, plain)


def test_native_bf16_weights_take_the_one_call_step_only_with_the_bf16_gemv_and_odd_widths_stay_off(
        smollm2_dir, smollm2):
    _, tok = smollm2
    prompt = tok("The capital of France is").input_ids
    # the step after " Paris": fp32's top two logits ("." and ",") lie 1.3 apart, far past bf16's
    # rounding, so both bf16 summation orders must pick the same token (an earlier step token,
    # " toile", left a 0.09 near-tie that oneDNN's AMX order and the GEMV's broke differently)
    paris = tok(" Paris").input_ids[0]
    native = LlamaModel.from_dir(smollm2_dir, torch.bfloat16)
    hidden, used = _prefill_then_decode(native, prompt, paris, fused=True)
    assert used == BF16_GEMV
    with compute.override(fast_bf16="0"):             # the AVX2 kind: oneDNN's packed bf16, per op
        slow = LlamaModel.from_dir(smollm2_dir, torch.bfloat16)
    assert all(layer["wqkv"].rows_weight is None for layer in slow.layers)
    other, used_slow = _prefill_then_decode(slow, prompt, paris, fused=True)
    assert not used_slow               # no bf16 row-major weights: no descriptor for the C step
    # the GEMV and oneDNN sum in another order: the same step to bf16's rounding, and the same token
    assert float((hidden.float() - other.float()).abs().max()) <= 0.05 * float(other.float().abs().max())
    a, b = native.logits(hidden).float(), slow.logits(other).float()
    assert float((a - b).abs().max()) <= 0.5          # logits near 25: a few bf16 ulps apart at most
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert tok.decode(a.argmax(-1)) == "."
    # an int8 weight whose K is not a multiple of 16 is packed to longer rows than the step's
    # activations: the step must refuse it rather than read past them
    lin = decode_int8.WeightInt8Linear(torch.randn(64, 50))
    assert cpu_decode.linear_descriptor(None, None, lin.packed, lin.scale, 64, lin.in_features) is None
    lin = decode_int8.WeightInt8Linear(torch.randn(64, 48))
    assert cpu_decode.linear_descriptor(None, None, lin.packed, lin.scale, 64, lin.in_features) is not None


@pytest.fixture(scope="module")
def models(smollm2_dir):
    cfg, weights = LlamaConfig.from_dir(smollm2_dir), load_weights(smollm2_dir)
    return cfg, weights, LlamaModel(cfg, weights, torch.float32), LlamaModel(cfg, weights, torch.float32, "cpu", "int8")


def test_int8_smollm2_passes_the_gate(models, smollm2):
    _, _, native, int8 = models
    report = int8_gate.run_gate(native, int8, smollm2[1])
    print(asdict(report))
    assert report.passed, report.reason
    assert report.equal + report.ties == report.prompts == len(int8_gate.PROMPTS)
    assert 1.0 - 0.01 < report.ppl_ratio <= int8_gate.MAX_PPL_RATIO
    assert report.worst_gap <= int8_gate.TIE
    assert int8.weight_bytes_per_step() * 3.9 < native.weight_bytes_per_step()


def test_a_broken_quantization_fails_the_gate(models, smollm2, monkeypatch):
    cfg, weights, native, _ = models

    def three_levels(weight):                      # q in {-1, 0, 1}: what the gate exists to catch
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12)
        return torch.round(w / scale[:, None]).to(torch.int8), scale
    monkeypatch.setattr(decode_int8, "quantize_per_channel", three_levels)
    broken = LlamaModel(cfg, weights, torch.float32, "cpu", "int8")
    report = int8_gate.run_gate(native, broken, smollm2[1], new_tokens=8)
    assert not report.passed
    assert "no near-tie" in report.reason or "perplexity" in report.reason
    assert report.ppl_ratio > int8_gate.MAX_PPL_RATIO


def _cached(tmp_path, smollm2_dir, passed):
    from embedserve.models.model_dir import fingerprint_dir
    path = int8_gate.gate_path(tmp_path, fingerprint_dir(smollm2_dir), torch.float32)
    path.parent.mkdir(parents=True)
    report = int8_gate.GateReport(passed=passed, reason="passed" if passed else "held-out perplexity too high",
                                  prompts=8, equal=8, ties=0, worst_gap=0.0, mean_equal_tokens=32.0, ppl_native=28.6,
                                  ppl_int8=28.7 if passed else 40.0, ppl_ratio=1.003 if passed else 1.4, seconds=1.0)
    path.write_text(json.dumps(asdict(report)))


@pytest.mark.parametrize("passed", [True, False])
def test_auto_takes_int8_only_where_the_cached_gate_passed(tmp_path, monkeypatch, smollm2_dir, smollm2, passed):
    monkeypatch.setenv("EMBEDSERVE_CACHE_DIR", str(tmp_path))
    _cached(tmp_path, smollm2_dir, passed)
    monkeypatch.setattr(int8_gate, "run_gate", lambda *a, **k: pytest.fail("the cached report is used"))
    model, gate = load_decoder(smollm2_dir, torch.float32, "cpu", "auto", smollm2[1])
    assert model.linear_weights == ("int8" if passed else "native")
    assert gate["passed"] is passed


def test_auto_keeps_a_bf16_decoders_native_weights(tmp_path, monkeypatch, smollm2_dir, smollm2):
    monkeypatch.setenv("EMBEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(int8_gate, "run_gate", lambda *a, **k: pytest.fail("no gate for a bf16 decoder under auto"))
    model, gate = load_decoder(smollm2_dir, torch.bfloat16, "cpu", "auto", smollm2[1])
    assert model.linear_weights == "native" and model.dtype == torch.bfloat16 and gate is None


def test_explicit_choices_skip_the_gate_and_int8_off_the_cpu_is_refused(tmp_path, monkeypatch, smollm2_dir, smollm2):
    monkeypatch.setenv("EMBEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(int8_gate, "run_gate", lambda *a, **k: pytest.fail("an explicit choice runs no gate"))
    for choice in ("native", "int8"):
        model, gate = load_decoder(smollm2_dir, torch.float32, "cpu", choice, smollm2[1])
        assert model.linear_weights == choice and gate is None
    with pytest.raises(ConfigError, match="--decode-weights int8: weight-only int8 decode is a CPU path"):
        load_decoder(smollm2_dir, torch.float32, "cuda", "int8", smollm2[1])
