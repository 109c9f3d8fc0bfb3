"""The C decode-attention kernel (kernels/cpu_attention.py) equals kernels.reference on ragged,
GQA batches with shuffled block tables, in float32 and bfloat16, and float32 over a bfloat16 or
float16 cache; where it cannot build, it says why and the model keeps the torch path."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import cbuild, compute, cpu_attention, reference

WHY = cpu_attention.available()


def _case(seed, nh, kvh, hd, block_size, lens, dtype, kv_dtype=None):
    g = torch.Generator().manual_seed(seed)
    nmax = -(-max(lens) // block_size)
    num_blocks = nmax * len(lens) + 3
    kc = torch.randn(num_blocks, block_size, kvh, hd, generator=g).to(kv_dtype or dtype)
    vc = torch.randn(num_blocks, block_size, kvh, hd, generator=g).to(kv_dtype or dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lens), nmax + 2), -1, dtype=torch.int32)      # padded past the blocks
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[i * nmax: i * nmax + nb].int()
    q = torch.randn(len(lens), nh, hd, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32)


# (activations, cache): each dtype with itself, and float32 over a 16-bit cache (compared with the
# reference on the cache's own values widened: the kernel widens them exactly)
_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
          (torch.float32, torch.float16)]


@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
# (4, 2, 40, 8): a head size the vector path does not take (the scalar one); (32, 32, 64, 16): K/V
# of a whole sequence past the 32 MiB scratch bound, so tasks stay one KV head each
@pytest.mark.parametrize("nh,kvh,hd,block_size", [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 48, 8), (16, 1, 64, 16),
                                                  (4, 2, 40, 8), (32, 32, 64, 16)])
@pytest.mark.parametrize("dtype,kv_dtype", _PAIRS)
def test_kernel_equals_reference(nh, kvh, hd, block_size, dtype, kv_dtype):
    # context 1 (one key), a block boundary exactly, ragged, and one past the kernel's stack buffer
    lens = [1, block_size, 77, 3 * block_size + 5, 3000]
    q, kc, vc, tables, ctx = _case(nh + hd, nh, kvh, hd, block_size, lens, dtype, kv_dtype)
    scale = hd ** -0.5
    ours = cpu_attention.paged_decode_attention(q, kc, vc, tables, ctx, scale)
    ref = reference.paged_decode_attention(q.float(), kc.float(), vc.float(), tables, ctx, scale)
    assert ours.dtype == dtype and ours.shape == q.shape
    tol = 2e-5 if dtype == torch.float32 else 1e-2          # bf16: the output's own rounding
    torch.testing.assert_close(ours.float(), ref, rtol=tol, atol=tol)
    # one sequence: the kernel splits it by KV head across the threads instead of by sequence
    one = cpu_attention.paged_decode_attention(q[4:], kc, vc, tables[4:], ctx[4:], scale)
    torch.testing.assert_close(one.float(), ref[4:], rtol=tol, atol=tol)


@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("nh,kvh", [(9, 3), (16, 1)])
@pytest.mark.parametrize("lens", [[255], [256], [257], [1000], [5, 700], [3, 300, 1000]])
@pytest.mark.parametrize("dtype,kv_dtype", _PAIRS)
def test_keys_split_between_threads_merge_to_the_reference(threads, nh, kvh, lens, dtype, kv_dtype):
    """Fewer sequences than twice the threads (2 or more), 256 keys or more: each sequence's keys go
    in splits (all its KV heads a task, 2 x threads tasks at least), merged after; one thread
    never splits. 255 keys: not split; 257 on 4 threads: the last two of 8 splits are empty;
    [5, 700]: the short sequence's splits but the first are empty; 3 sequences on 4 threads: 3
    splits each, a span not a power of two."""
    q, kc, vc, tables, ctx = _case(sum(lens) + nh + threads, nh, kvh, 64, 16, lens, dtype, kv_dtype)
    scale = 64 ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = cpu_attention.paged_decode_attention(q, kc, vc, tables, ctx, scale)
    finally:
        torch.set_num_threads(before)
    ref = reference.paged_decode_attention(q.float(), kc.float(), vc.float(), tables, ctx, scale)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.float(), ref, rtol=tol, atol=tol)


@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
@pytest.mark.parametrize("dtype,kv_dtype", _PAIRS)
def test_the_avx512_layout_equals_the_reference_on_any_cpu(avx512_emulated, dtype, kv_dtype):
    """The VW = 16 paths (16-key chunks and their transpose-add, the 4-vector value passes, the
    prefetch spread over 16 keys, the f16 and bf16 widening, the splits) run on the AVX-512 CPUs
    only, which most machines here are not: built with the intrinsics emulated, they must give
    the reference's result on every shape the native build is tested on, on 1, 2 and 4 threads."""
    assert avx512_emulated.decode_vector_width() == 16
    fn = getattr(avx512_emulated, "paged_decode_attention_" + cpu_attention.kv_kernel_suffix(dtype, kv_dtype))
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    cases = [((nh, kvh, hd, bs), [1, bs, 77, 3 * bs + 5, 3000])
             for nh, kvh, hd, bs in [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 48, 8), (16, 1, 64, 16),
                                     (4, 2, 40, 8), (32, 32, 64, 16), (9, 3, 64, 8)]]
    cases += [((nh, kvh, 64, 16), lens) for nh, kvh in [(9, 3), (16, 1)]
              for lens in ([255], [257], [1000], [5, 700], [3, 300, 1000])]
    for (nh, kvh, hd, bs), lens in cases:
        q, kc, vc, tables, ctx = _case(nh + hd + len(lens), nh, kvh, hd, bs, lens, dtype, kv_dtype)
        ref = reference.paged_decode_attention(q.float(), kc.float(), vc.float(), tables, ctx, hd ** -0.5)
        for threads in (1, 2, 4):
            out = torch.empty_like(q)
            rc = fn(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), tables.data_ptr(), tables.shape[1], ctx.data_ptr(),
                    out.data_ptr(), len(lens), nh, kvh, hd, bs, hd ** -0.5, threads)
            assert rc == 0
            torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol,
                                       msg=lambda m: f"{(nh, kvh, hd, bs)} {lens} {threads} threads: {m}")


@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
def test_the_native_build_takes_the_layout_of_this_cpu():
    """16-float vectors where the compiler targets AVX-512 for this CPU (-march=native), else 8."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    lib, _ = cpu_attention.load_library()
    assert lib.decode_vector_width() == (16 if "avx512f" in flags else 8)


@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
def test_kernel_reads_a_non_contiguous_query_and_refuses_what_it_cannot_run():
    q, kc, vc, tables, ctx = _case(1, 9, 3, 64, 16, [20, 40], torch.float32)
    wide = torch.cat([q, torch.zeros(2, 3, 64)], dim=1)[:, :9]            # the model's q is such a view
    ref = reference.paged_decode_attention(q, kc, vc, tables, ctx, 0.125)
    torch.testing.assert_close(cpu_attention.paged_decode_attention(wide, kc, vc, tables, ctx, 0.125), ref,
                               rtol=2e-5, atol=2e-5)
    assert not cpu_attention.supports(q.to(torch.float16), kc.to(torch.float16))
    assert not cpu_attention.supports(q.to(torch.bfloat16), kc)            # a cache wider than q
    assert not cpu_attention.supports(q.to(torch.bfloat16), kc.to(torch.float16))
    assert cpu_attention.supports(q, kc.to(torch.bfloat16)) and cpu_attention.supports(q, kc.to(torch.float16))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_attention.paged_decode_attention(q.to(torch.float16), kc.to(torch.float16), vc.to(torch.float16),
                                             tables, ctx, 0.125)


def test_switched_off_or_missing_compiler_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBEDSERVE_HOME", str(tmp_path))
    with compute.override(cpu_attention="torch"):
        assert cpu_attention.available() == "cpu_attention=torch"
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with compute.override(cpu_attention="auto"):                 # a new setting: the library is looked for again
        why = cpu_attention.available()
        assert why is not None and "compiling cpu_paged_attention.c failed" in why
        with pytest.raises(RuntimeError, match="not available"):
            cpu_attention.paged_decode_attention(*_case(0, 4, 2, 64, 16, [5], torch.float32), 0.125)
    monkeypatch.delenv("CC")
    assert cpu_attention.available() == WHY                       # the process's own setting, as before


@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
def test_read_only_home_builds_into_a_temp_folder(monkeypatch, tmp_path):
    """The container's home is read-only: the library goes to a per-user temp folder instead."""
    home = tmp_path / "home-is-a-file"
    home.write_text("")                                    # mkdir under it fails
    monkeypatch.setenv("EMBEDSERVE_HOME", str(home))
    monkeypatch.setattr(cbuild.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    with compute.override():
        assert cpu_attention.available() is None
        built = list((tmp_path / "tmp").glob("embedserve-kernels-*/cpu_paged_attention-*.so"))
        assert len(built) == 1
        q, kc, vc, tables, ctx = _case(2, 4, 2, 64, 16, [9, 33], torch.float32)
        torch.testing.assert_close(cpu_attention.paged_decode_attention(q, kc, vc, tables, ctx, 0.125),
                                   reference.paged_decode_attention(q, kc, vc, tables, ctx, 0.125),
                                   rtol=2e-5, atol=2e-5)


def test_a_cache_dir_beside_a_read_only_home_keeps_the_build(monkeypatch, tmp_path):
    """EMBEDSERVE_CACHE_DIR (the image's /data/cache volume) holds the build, so the next start
    on this machine loads it instead of compiling again."""
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    monkeypatch.setenv("EMBEDSERVE_HOME", str(home))
    monkeypatch.setenv("EMBEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cbuild.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    with compute.override():
        assert cpu_attention.available() is None
        assert len(list((tmp_path / "cache" / "kernels").glob("cpu_paged_attention-*.so"))) == 1
        assert not (tmp_path / "tmp").exists()


def _varlen_reference(qkv, lens, nh):
    """Each sequence alone through SDPA in float64."""
    T, three_h = qkv.shape
    H, hd = three_h // 3, three_h // (3 * nh)
    out, start = torch.empty(T, H, dtype=torch.float64), 0
    for L in lens:
        q, k, v = qkv[start:start + L].double().view(L, 3, nh, hd).permute(1, 2, 0, 3)
        out[start:start + L] = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(L, H)
        start += L
    return out


@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
@pytest.mark.parametrize("nh,hd", [(12, 32), (6, 64), (4, 16), (4, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_attention_equals_per_sequence_sdpa(nh, hd, dtype):
    g = torch.Generator().manual_seed(nh * hd)
    # one token (attends to itself), fewer rows than the row block (4 with AVX2, 8 with AVX-512), one
    # past it, a 16-key boundary, ragged, long
    lens = [1, 2, 3, 16, 17, 64, 300, 5, 9, 7]
    qkv = torch.randn(sum(lens), 3 * nh * hd, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    ours = cpu_attention.varlen_attention(qkv, cu, nh, hd ** -0.5)
    assert ours.dtype == dtype and ours.shape == (sum(lens), nh * hd)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.double(), _varlen_reference(qkv, lens, nh), rtol=tol, atol=tol)


_BF16_QKV = torch.zeros(1, 3 * 12 * 32, dtype=torch.bfloat16)
with compute.override(fast_bf16="auto"):              # the hardware's answer, under EMBEDSERVE_FAST_BF16=0 too
    AMX = WHY is None and cpu_attention.amx_attention_runs(_BF16_QKV, 12)


@pytest.mark.skipif(not AMX, reason="no AMX-BF16 tiles here (the CPU's flags, the C kernel's build, or Linux "
                                    "refused them): the vector kernel serves bf16, tested above")
@pytest.mark.parametrize("nh,hd", [(12, 32), (6, 64)])
def test_amx_attention_equals_sdpa_and_the_vector_kernel(nh, hd):
    """The AMX tile kernel against float64 SDPA and the vector kernel, on lengths around its
    16-row and 32-key blocks. Tolerance as the bf16 case above: the output is rounded to bf16
    (2^-9 relative), and the probabilities are too before P V (as SDPA's bf16 path does)."""
    g = torch.Generator().manual_seed(7 * nh + hd)
    lens = [1, 2, 15, 16, 17, 31, 32, 33, 48, 64, 65, 300, 5]
    qkv = (2 * torch.randn(sum(lens), 3 * nh * hd, generator=g)).bfloat16()      # wide scores: a peaked softmax
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    with compute.override(fast_bf16="auto"):
        assert cpu_attention.amx_attention_runs(qkv, nh)
        amx = cpu_attention.varlen_attention(qkv, cu, nh, hd ** -0.5)
        again = cpu_attention.varlen_attention(qkv, cu, nh, hd ** -0.5)
    with compute.override(amx_attention=False):
        assert not cpu_attention.amx_attention_runs(qkv, nh)
        vector = cpu_attention.varlen_attention(qkv, cu, nh, hd ** -0.5)
    ref = _varlen_reference(qkv, lens, nh)
    torch.testing.assert_close(amx.double(), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(amx.double(), vector.double(), rtol=1e-2, atol=1e-2)
    assert torch.equal(amx, again)                                                        # deterministic


def test_amx_attention_takes_only_bf16_at_head_sizes_32_and_64():
    assert not cpu_attention.amx_attention_runs(torch.zeros(1, 3 * 12 * 32), 12)              # float32
    assert not cpu_attention.amx_attention_runs(torch.zeros(1, 3 * 4 * 16, dtype=torch.bfloat16), 4)
    assert not cpu_attention.amx_attention_runs(torch.zeros(1, 3 * 2 * 48, dtype=torch.bfloat16), 2)
    with compute.override(amx_attention=False):
        assert not cpu_attention.amx_attention_runs(_BF16_QKV, 12)
    with compute.override(fast_bf16="0"):                     # imitating a CPU without fast bf16
        assert not cpu_attention.amx_attention_runs(_BF16_QKV, 12)


def test_varlen_refuses_what_it_cannot_run():
    qkv = torch.randn(10, 3 * 4 * 40)
    assert not cpu_attention.varlen_supports(qkv, 4)                       # head_dim 40
    assert not cpu_attention.varlen_supports(torch.randn(10, 3 * 2 * 128), 2)
    assert not cpu_attention.varlen_supports(qkv.half(), 4)
    if WHY is None:
        with pytest.raises(ValueError, match="multiple of 16"):
            cpu_attention.varlen_attention(qkv, torch.tensor([0, 10], dtype=torch.int32), 4, 0.1)


@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
def test_encoder_with_the_kernel_equals_the_padded_sdpa_path(monkeypatch, minilm_dir):
    """The bundled MiniLM, fp32: the kernel (no padding) and SDPA over padded groups agree, and
    the padding metric counts what the kernel computed."""
    from embedserve.models import encoder as enc_mod
    from embedserve.models.encoder import AttentionPlan, bucket_rows, load_encoder

    monkeypatch.setattr(cpu_attention, "varlen_preferred", lambda: True)   # on an AVX2-only CPU too
    enc = load_encoder(minilm_dir, "float32")
    g = torch.Generator().manual_seed(3)
    lens = [40, 33, 31, 9, 2, 1]
    ids = torch.randint(1000, 20000, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(L) for L in lens])
    plan = AttentionPlan.build(lens)
    padded = plan.computed_tokens
    with compute.override(bucket_rows=False):                  # the exact rows: no padding at all
        kernel = enc(ids, pos, plan)
    assert plan.computed_tokens == sum(lens) < padded
    bucketed = enc(ids, pos, plan)                              # the default: rows up to their bucket
    assert plan.computed_tokens == bucket_rows(sum(lens)) > sum(lens)
    torch.testing.assert_close(bucketed, kernel, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(enc_mod, "_varlen_kernel_runs", lambda qkv, nh: False)
    torch.testing.assert_close(kernel, enc(ids, pos, AttentionPlan.build(lens)), rtol=1e-4, atol=1e-4)


def test_the_encoder_takes_the_varlen_kernel_on_both_kinds_of_cpu_unless_told(monkeypatch):
    """Measured (`python -m embedserve.studies.cpu_paths`): in vectors of the machine's width the
    kernel is ahead of per-sequence SDPA with AVX-512 and with AVX2 only; `cpu_attention=sdpa`
    keeps SDPA for the encoder (the decode kernel stays), `c` is the default spelled out."""
    for flags in ("flags\t: fma avx avx2", "flags\t: avx2 avx512f avx512_bf16"):
        monkeypatch.setattr(cbuild, "cpu_id", lambda flags=flags: "model name\t: X\n" + flags)
        with compute.override(cpu_attention="auto"):
            assert cpu_attention.varlen_preferred() is True, flags
    for value, want in (("sdpa", False), ("c", True), ("auto", True), ("torch", False)):
        with compute.override(cpu_attention=value):
            assert cpu_attention.varlen_preferred() is want, value


@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H", [(1, 16), (37, 384), (300, 1024), (5, 4096)])
def test_add_layer_norm_equals_torch(dtype, T, H):
    """layer_norm(x + y) in one pass: fp32 within float rounding; bf16 the sum rounded as torch's
    `x + y` is, then at most one bf16 step from torch's result."""
    g = torch.Generator().manual_seed(T * H)
    x, y = (3 * torch.randn(T, H, generator=g)).to(dtype), torch.randn(T, H, generator=g).to(dtype)
    w, b = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype), (0.1 * torch.randn(H, generator=g)).to(dtype)
    ours = cpu_attention.add_layer_norm(x, y, w, b, 1e-12)
    ref = torch.nn.functional.layer_norm(x + y, (H,), w, b, 1e-12)
    assert ours.dtype == dtype and ours.shape == (T, H)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    else:
        exact = torch.nn.functional.layer_norm((x + y).double(), (H,), w.double(), b.double(), 1e-12)
        assert (ours.double() - exact).abs().max() <= (ref.double() - exact).abs().max() * 2 + 1e-2
        assert (ours != ref).float().mean() < 0.01            # torch's result in all but a few


def test_add_layer_norm_refuses_what_it_cannot_run():
    x = torch.randn(4, 8)
    assert not cpu_attention.add_layer_norm_supports(x, x.half(), torch.ones(8), torch.zeros(8))
    assert not cpu_attention.add_layer_norm_supports(x, x, torch.ones(7), torch.zeros(7))
    assert not cpu_attention.add_layer_norm_supports(torch.randn(2, 5000), torch.randn(2, 5000),
                                                     torch.ones(5000), torch.zeros(5000))
    if WHY is None:
        with pytest.raises(ValueError, match="H <= 4096"):
            cpu_attention.add_layer_norm(x, x, torch.ones(7), torch.zeros(7), 1e-5)



# ---- the decoder's glue kernels: the torch ops they replace (LlamaModel.forward's torch path)

def _torch_rms(x, w, eps):
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * w


@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H", [(1, 576), (16, 576), (300, 960), (3, 7)])
def test_rms_norm_with_and_without_the_residual_equals_torch(dtype, T, H):
    g = torch.Generator().manual_seed(T + H)
    x, r = (4 * torch.randn(T, H, generator=g)).to(dtype), torch.randn(T, H, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(H, generator=g)).to(dtype)
    ref_sum = x + r
    ref = _torch_rms(ref_sum, w, 1e-5)
    stream = x.clone()
    out = cpu_attention.rms_norm(stream, w, 1e-5, r)
    assert torch.equal(stream, ref_sum)                   # the residual add, in place, rounded as torch's
    plain = cpu_attention.rms_norm(x.clone(), w, 1e-5)
    wide = torch.cat([r, torch.zeros_like(r)], dim=1)[:, :H]            # a non-contiguous residual view
    assert torch.equal(cpu_attention.rms_norm(x.clone(), w, 1e-5, wide), out)
    tol = 2e-6 if dtype == torch.float32 else 0
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        torch.testing.assert_close(plain, _torch_rms(x, w, 1e-5), rtol=tol, atol=tol)
    else:                                                 # bf16: torch's result but for a rare last bit
        assert (out != ref).float().mean() < 0.01 and (out.float() - ref.float()).abs().max() <= 0.07 * ref.abs().max()
        assert (plain != _torch_rms(x, w, 1e-5)).float().mean() < 0.01


@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
@pytest.mark.parametrize("dtype,kv_dtype", _PAIRS)
def test_rope_store_equals_rope_then_store_kv(dtype, kv_dtype):
    from embedserve.models.attention_dispatch import store_kv
    nh, kvh, hd, T, bs = 9, 3, 64, 21, 16
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(T, (nh + 2 * kvh) * hd, generator=g).to(dtype)
    pos = torch.randint(0, 4000, (T,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    freqs = pos.float()[:, None] * inv_freq[None, :]
    slots = torch.randperm(8 * bs, generator=g)[:T]
    kc, vc = torch.zeros(8, bs, kvh, hd, dtype=kv_dtype), torch.zeros(8, bs, kvh, hd, dtype=kv_dtype)
    q = cpu_attention.rope_store_kv(qkv, freqs.cos(), freqs.sin(), kc, vc, slots, nh, kvh)
    # the torch path: rotate-half RoPE in float32, rounded once; K/V stored by slot
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    xf = qkv[:, : (nh + kvh) * hd].view(T, nh + kvh, hd).float()
    rot = torch.cat((-xf[..., hd // 2:], xf[..., : hd // 2]), -1)
    qk = (xf * cos + rot * sin).to(dtype)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    store_kv(qk[:, nh:], qkv[:, (nh + kvh) * hd:].view(T, kvh, hd), kr, vr, slots)
    tol = 1e-6 if dtype == torch.float32 else 0
    torch.testing.assert_close(q, qk[:, :nh], rtol=tol, atol=tol * 10)
    if kv_dtype == dtype:
        torch.testing.assert_close(kc, kr, rtol=tol, atol=tol * 10)
    else:   # k rotated in float32 then rounded to the cache once: torch's float32 k may sit 1 ulp away,
        # so at most one unit of the cache's last place differs, on few values
        differ = kc != kr
        assert differ.float().mean() < 0.01
        torch.testing.assert_close(kc.float(), kr.float(), rtol=2 ** -7 if kv_dtype == torch.bfloat16 else 2 ** -10,
                                   atol=1e-6)
    assert torch.equal(vc, vr)                   # v rounded to the cache's dtype as torch rounds it
    assert cpu_attention.decoder_glue_supports(torch.zeros(3, 576, dtype=dtype), kc)
    assert not cpu_attention.decoder_glue_supports(torch.zeros(3, 576, dtype=dtype), torch.zeros(2, bs, 1, 512, dtype=dtype))
    assert not cpu_attention.decoder_glue_supports(torch.zeros(3, 576, dtype=torch.bfloat16), kc.half())
    assert not cpu_attention.decoder_glue_supports(torch.zeros(3, 576, dtype=torch.float16), kc.half())
    with pytest.raises(RuntimeError, match="slot outside the cache"):
        cpu_attention.rope_store_kv(qkv, freqs.cos(), freqs.sin(), kc, vc, slots + 8 * bs, nh, kvh)


@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,I", [(1, 1536), (40, 300)])
def test_silu_mul_equals_torch(dtype, T, I):
    g = torch.Generator().manual_seed(T * I)
    gu = (3 * torch.randn(T, 2 * I, generator=g)).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    ours = cpu_attention.silu_mul(gu)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    else:
        assert (ours != ref).float().mean() < 0.01
        torch.testing.assert_close(ours.float(), ref.float(), rtol=1e-2, atol=1e-2)


def _prefill_then_decode(model, dtype):
    """A prefill of two sequences (20 and 30 tokens, 50 rows) and five decode steps (2 rows each):
    the hidden states of each forward and the KV caches."""
    from embedserve.models.attention_dispatch import AttentionMetadata
    cfg, bs = model.cfg, 16
    tables = [[0, 1], [2, 3, 4]]
    bt = torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32)

    def slot(i, p):
        return tables[i][p // bs] * bs + p % bs

    kv = [(torch.zeros(8, bs, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype),
           torch.zeros(8, bs, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype))
          for _ in range(cfg.num_hidden_layers)]
    g = torch.Generator().manual_seed(1)
    lens = [20, 30]
    meta = AttentionMetadata(torch.tensor([slot(0, p) for p in range(20)] + [slot(1, p) for p in range(30)]), bt,
                             torch.tensor(lens, dtype=torch.int32), torch.tensor([0, 20, 50], dtype=torch.int32),
                             0, lens, [20, 30])
    outs = [model.forward(torch.randint(0, 5000, (50,), generator=g), torch.tensor([*range(20), *range(30)]), kv, meta)]
    for step in range(5):
        c = [21 + step, 31 + step]
        meta = AttentionMetadata(torch.tensor([slot(0, c[0] - 1), slot(1, c[1] - 1)]), bt,
                                 torch.tensor(c, dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
                                 2, c, [1, 1])
        outs.append(model.forward(torch.randint(0, 5000, (2,), generator=g), torch.tensor(c) - 1, kv, meta))
    return outs, kv


@pytest.mark.model
@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decoder_with_the_glue_kernels_equals_its_torch_path(monkeypatch, dtype):
    """SmolLM2, a prefill of two sequences and five decode steps: the same hidden states as the
    torch ops (fp32 to float rounding; bf16 within a few of its steps), the same K/V cache."""
    from embedserve.models.llama import LlamaModel
    from embedserve.models.registry import resolve_generate_model

    model = LlamaModel.from_dir(resolve_generate_model("SmolLM2-135M-Instruct")[1], dtype)

    def run(glue):
        monkeypatch.setattr(cpu_attention, "decoder_glue_supports", lambda x, k: glue)
        return _prefill_then_decode(model, dtype)

    (glue, kv_glue), (ref, kv_ref) = run(True), run(False)
    for a, b in zip(glue, ref):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        else:
            assert (a.float() - b.float()).abs().max() <= 0.03 * b.float().abs().max()
    torch.testing.assert_close(kv_glue[-1][0].float(), kv_ref[-1][0].float(),
                               rtol=1e-4 if dtype == torch.float32 else 0.05, atol=1e-4 if dtype == torch.float32 else 0.1)


@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
@pytest.mark.parametrize("M", [1, 5, 8, 32])
@pytest.mark.parametrize("N,K", [(960, 576), (576, 1536), (13, 37), (8, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_gemv_equals_a_float64_linear(M, N, K, bias):
    """Row blocks of 8 with a tail (N = 13), K not a multiple of the vector width (37), one row to
    GEMV_MAX_ROWS; against F.linear in float64, and against F.linear in float32 to its rounding."""
    g = torch.Generator().manual_seed(M * N + K)
    w, x = torch.randn(N, K, generator=g) * 0.05, torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    assert cpu_attention.gemv_supports(x, w)
    out = cpu_attention.gemv(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == torch.float32 and out.shape == (M, N)
    assert float((out.double() - ref).abs().max()) < 1e-5 * max(1.0, float(ref.abs().max())) * K ** 0.5
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # a non-contiguous input (a column slice) is read as its values
    wide = torch.randn(M, K + 3, generator=g)
    torch.testing.assert_close(cpu_attention.gemv(wide[:, 3:], w, b), F.linear(wide[:, 3:], w, b), rtol=1e-5, atol=1e-5)


def test_gemv_takes_only_a_few_float32_rows_against_a_contiguous_weight():
    w, x = torch.randn(16, 24), torch.randn(4, 24)
    if WHY is None:
        assert cpu_attention.gemv_supports(x, w)
    assert not cpu_attention.gemv_supports(x.bfloat16(), w.bfloat16())
    assert not cpu_attention.gemv_supports(torch.randn(cpu_attention.GEMV_MAX_ROWS + 1, 24), w)
    assert not cpu_attention.gemv_supports(x, torch.randn(24, 16).T)                 # not contiguous
    assert not cpu_attention.gemv_supports(torch.randn(4, 23), w)                     # K differs


@pytest.mark.model
@pytest.mark.skipif(WHY is not None, reason=f"the C kernel does not build here: {WHY}")
def test_the_decoder_with_gemv_equals_its_packed_matmul_path(monkeypatch):
    """SmolLM2 in fp32: its decode steps (2 rows) take `gemv` on the row-major weights, the 50-row
    prefill the packed matmul; with `gemv` off every forward takes the packed matmul. The same
    hidden states and KV cache to float rounding; the tied head's row-major matrix is the
    embedding table itself (no copy)."""
    from embedserve.models import linear
    from embedserve.models.llama import LlamaModel
    from embedserve.models.registry import resolve_generate_model

    model = LlamaModel.from_dir(resolve_generate_model("SmolLM2-135M-Instruct")[1], torch.float32)
    assert model.tied and model.lm_head.rows_weight is model.embed
    assert all(layer[k].rows_weight is not None for layer in model.layers for k in ("wqkv", "wo", "wgu", "wd"))
    calls = []
    real = cpu_attention.gemv
    monkeypatch.setattr(cpu_attention, "gemv", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with compute.override(fused_decode=False):             # the per-op path (the one-call step: test_decode_int8)
        (fast, kv_fast) = _prefill_then_decode(model, torch.float32)
    assert calls and set(calls) == {2}                          # the decode steps' rows only, 4 linears x 30 layers x 5
    assert len(calls) == 5 * 4 * model.cfg.num_hidden_layers
    monkeypatch.setattr(linear, "GEMV_MAX_ROWS", 0)
    calls.clear()
    with compute.override(fused_decode=False):
        (ref, kv_ref) = _prefill_then_decode(model, torch.float32)
    assert not calls
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_fast[-1][0], kv_ref[-1][0], rtol=1e-4, atol=1e-4)
    h = fast[-1]
    torch.testing.assert_close(model.logits(h), F.linear(h, model.embed), rtol=1e-4, atol=1e-4)
