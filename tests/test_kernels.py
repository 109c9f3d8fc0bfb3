"""The Triton paged-KV kernels against kernels.reference, on fresh random inputs.

Without a GPU the kernels run in Triton's interpreter on the CPU: TRITON_INTERPRET=1 must be
set before triton is first imported (it is read as `@triton.jit` decorates triton's own
library functions too), so this module sets it before importing anything that imports
triton. If something in this process imported triton earlier, the kernels cannot run here:
one test then reruns this file in a fresh Python and the others skip. With a GPU the same
tests run the compiled kernels on it (the `device` parameter).

The interpreter runs the kernels as Python, so it cannot catch what only the compiler sees;
without a GPU one test therefore compiles them for sm_90 (ptxas ships with triton) and checks
that they build without register spills.

Shapes stay small (the interpreter runs each program in numpy) but cover what the kernels
branch on: GQA 8/2, 4/4, 8/1; block sizes 16 and 32; context lengths 1, on a block boundary,
and longer than one key tile (so the online softmax rescales); split-K and not; packed
prefill chunks with and without an earlier prefix, a one-token chunk and an empty one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import JITFunction  # noqa: E402

import kernels  # noqa: E402
from kernels import compute  # noqa: E402
from kernels import triton_attention as pa  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.store_kv import store_kv  # noqa: E402

# Triton imported before this module without the interpreter: its library is compiled-only.
STALE_TRITON = not CUDA and isinstance(tl.max, JITFunction)
DEVICES = ["cuda"] if CUDA else ["cpu"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GQA = [(8, 2), (4, 4), (8, 1)]                   # (query heads, kv heads)

# Tolerances, as max |out - ref| / max |ref| over the whole output:
# - fp32 1e-5: both compute in fp32 but sum in another order (tiles of keys with an online
#   rescale vs one softmax); rounding over a few hundred keys stays near 1e-6.
# - fp16 2e-3: the kernel rounds the probabilities to fp16 before P.V (2^-11 relative) and
#   both round the output to fp16.
# - bf16 1e-2: the same with bf16's 8-bit mantissa (2^-9 per rounding, a few roundings).
# Caches in fp8 are read identically (exact widening) by both, so q's dtype decides.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _needs_fresh_triton(request):
    if STALE_TRITON and request.node.name != "test_in_fresh_process":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; test_in_fresh_process runs these")


def test_in_fresh_process():
    if not STALE_TRITON:
        pytest.skip("triton is usable in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]


@pytest.fixture
def poison(monkeypatch):
    """Outputs (and split-K partials) the kernels allocate start as NaN: an element the kernel
    forgets to write, or a partial it reads but never wrote, fails the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan(empty_like(*a, **k)))


def _gen(request) -> torch.Generator:
    """A generator seeded from the test's id: fresh data per case, reproducible per case."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _randn(gen, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=gen).to(dtype).to(device)


def _paged(gen, context_lens, block_size, kvh, hd, dtype, device, spare_blocks=3):
    """Random caches, and block tables that scatter each sequence over shuffled blocks; one
    spare -1 column and random data in unused blocks and past each context, never to be read."""
    need = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(need) + spare_blocks
    k_cache = _randn(gen, num_blocks, block_size, kvh, hd, dtype=dtype, device=device)
    v_cache = _randn(gen, num_blocks, block_size, kvh, hd, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(context_lens), max(need) + 1), -1, dtype=torch.int32)
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return k_cache, v_cache, tables.to(device), torch.tensor(context_lens, dtype=torch.int32, device=device)


def _assert_close(out, expected, tol):
    assert not out.isnan().any(), "the kernel left elements unwritten (NaN)"
    err = (out.float() - expected.float()).abs().max().item() / expected.float().abs().max().item()
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


# ---------------------------------------------------------------------------------- store_kv

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_writes_exactly_its_slots(request, device, dtype, block_size):
    gen = _gen(request)
    num_blocks, kvh, hd, T = 6, 2, 64, 9
    src_dtype = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype
    # key/value as views of a fused qkv projection: row stride is not kvh * hd
    qkv = _randn(gen, T, 3 * kvh, hd, dtype=src_dtype, device=device)
    key, value = qkv[:, kvh:2 * kvh], qkv[:, 2 * kvh:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[3] = -1                                               # padding: writes nothing
    slots = slots.to(device)
    k_cache = torch.full((num_blocks, block_size, kvh, hd), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kv(key, value, k_cache, v_cache, slots)
    ref.store_kv(key, value, k_ref, v_ref, slots)

    written = sorted(s for s in slots.tolist() if s >= 0)
    for cache, expected in ((k_cache, k_ref), (v_cache, v_ref)):
        flat = cache.float().view(-1, kvh * hd)
        changed = (~flat.isnan()).all(1).nonzero().flatten().tolist()
        assert changed == written, "store_kv wrote other slots than slot_mapping names"
        assert flat.isnan().any(1).sum() == flat.shape[0] - len(written), "a slot was written in part"
        if dtype == torch.float8_e4m3fn and device == "cpu":
            # Triton 3.9's interpreter rounds to fp8 wrongly (no carry into the exponent:
            # 1.99 -> 1.0), so only the compiled kernel's fp8 values can be checked.
            continue
        # a copy with one round-to-nearest-even cast: bit-exact
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


# ---------------------------------------------------------------------------------- decode

def _decode_case(request, device, dtype, heads, block_size, context_lens, hd=64, cache_dtype=None):
    gen = _gen(request)
    nh, kvh = heads
    k_cache, v_cache, tables, ctx = _paged(gen, context_lens, block_size, kvh, hd, cache_dtype or dtype, device)
    q = _randn(gen, len(context_lens), nh, hd, dtype=dtype, device=device)
    return q, k_cache, v_cache, tables, ctx, hd ** -0.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(request, poison, device, dtype, heads, block_size):
    # 1 token; exactly two blocks; several key tiles (BLOCK_N is 64 or 128 here); ragged
    args = _decode_case(request, device, dtype, heads, block_size, [1, 2 * block_size, 290, 77])
    expected = ref.paged_decode_attention(*args)
    _assert_close(pa.paged_decode_attention(*args), expected, TOL[dtype])
    # split-K with ragged lengths: sequences shorter than a split leave later splits empty
    _assert_close(pa.decode_with_splits(*args, num_splits=3), expected, TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("context_lens", [[5], [1, 16, 32, 48, 33, 200, 64]], ids=["batch1", "batch7"])
def test_decode_batch_sizes(request, poison, device, context_lens):
    args = _decode_case(request, device, torch.float32, (8, 2), 16, context_lens)
    _assert_close(pa.paged_decode_attention(*args), ref.paged_decode_attention(*args), TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hd", [128, 96])                       # 96: padded to 128 with a mask
def test_decode_head_dims(request, poison, device, hd):
    args = _decode_case(request, device, torch.bfloat16, (8, 2), 16, [1, 64, 150], hd=hd)
    expected = ref.paged_decode_attention(*args)
    _assert_close(pa.paged_decode_attention(*args), expected, TOL[torch.bfloat16])
    _assert_close(pa.decode_with_splits(*args, num_splits=2), expected, TOL[torch.bfloat16])


@pytest.mark.parametrize("device", DEVICES)
def test_decode_fp8_cache(request, poison, device):
    args = _decode_case(request, device, torch.bfloat16, (8, 2), 16, [1, 40, 130], cache_dtype=torch.float8_e4m3fn)
    _assert_close(pa.paged_decode_attention(*args), ref.paged_decode_attention(*args), TOL[torch.bfloat16])


@pytest.mark.parametrize("device", DEVICES)
def test_decode_empty_context_gives_zeros(request, poison, device):
    # CUDA-graph padding rows have context 0; the reference gives 0 there
    # (a 200-token neighbour makes the table 224 tokens wide: two splits of 128 at BLOCK_N 64)
    q, k_cache, v_cache, tables, ctx, scale = _decode_case(request, device, torch.float32, (4, 2), 16, [0, 200, 0])
    for out in (pa.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale),
                pa.decode_with_splits(q, k_cache, v_cache, tables, ctx, scale, num_splits=2)):
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
        _assert_close(out[1:2], ref.paged_decode_attention(q[1:2], k_cache, v_cache, tables[1:2], ctx[1:2], scale),
                      TOL[torch.float32])


def test_decode_num_splits_rule():
    # H200: 132 SMs; the grid stays within 4 programs per SM, splits hold >= 512 keys
    assert pa.decode_num_splits(64, 2, 2048, 132) == 4          # 128 programs -> 512
    assert pa.decode_num_splits(32, 2, 8192, 132) == 8          # 64 -> 512
    assert pa.decode_num_splits(32, 8, 8192, 132) == 2          # 256 -> 512
    assert pa.decode_num_splits(64, 8, 8192, 132) == 1          # 512 already
    assert pa.decode_num_splits(8, 1, 300, 132) == 1            # too short to split
    assert pa.decode_num_splits(1, 1, 10**6, 132) == pa.MAX_SPLITS


# ---------------------------------------------------------------------------------- prefill

# (q_len, context_len): whole prompt; a chunk after a long prefix (unmasked tiles, then the
# diagonal; several query tiles); one token; an empty chunk; a chunk ending on a block boundary
PREFILL_SEQS = [(20, 20), (70, 150), (1, 33), (0, 10), (16, 64)]


def _prefill_case(request, device, dtype, heads, block_size, seqs=PREFILL_SEQS, hd=64, cache_dtype=None):
    gen = _gen(request)
    nh, kvh = heads
    k_cache, v_cache, tables, ctx = _paged(gen, [n for _, n in seqs], block_size, kvh, hd, cache_dtype or dtype,
                                           device)
    cu = torch.tensor([0] + [sum(ql for ql, _ in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    # q as a view of a fused qkv projection (row stride (nh + 2 kvh) * hd)
    qkv = _randn(gen, int(cu[-1]), nh + 2 * kvh, hd, dtype=dtype, device=device)
    return qkv[:, :nh], k_cache, v_cache, tables, cu.to(device), ctx, hd ** -0.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_reference(request, poison, device, dtype, heads, block_size):
    args = _prefill_case(request, device, dtype, heads, block_size)
    _assert_close(pa.paged_prefill_attention(*args), ref.paged_prefill_attention(*args), TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_head_dim_128_and_fp8_cache(request, poison, device):
    args = _prefill_case(request, device, torch.bfloat16, (8, 2), 16, [(40, 100), (3, 3)], hd=128)
    _assert_close(pa.paged_prefill_attention(*args), ref.paged_prefill_attention(*args), TOL[torch.bfloat16])
    args = _prefill_case(request, device, torch.float16, (4, 2), 32, [(30, 90), (1, 1)],
                         cache_dtype=torch.float8_e4m3fn)
    _assert_close(pa.paged_prefill_attention(*args), ref.paged_prefill_attention(*args), TOL[torch.float16])


# ---------------------------------------------------------------------------------- compiled, without a GPU

# Compiles what the wrappers launch for sm_90 in a fresh process (no TRITON_INTERPRET): ptxas
# ships with triton, so GPU-only compile errors (the interpreter runs plain Python) and
# register spills show up on a CPU too. A stand-in driver reports an sm_90 target, and
# JITFunction._do_compile (triton 3.9's private hook) compiles and reports instead of loading.
_COMPILE_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

class Driver:
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return TARGET
    def is_active(self): return True

class NoLaunch:
    function = packed_metadata = None
    def launch_metadata(self, *args): return None
    def run(self, *args): pass

report = []
def compile_only(self, key, signature, device, constexprs, options, attrs, warmup):
    kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    report.append([self.fn.__name__, int(re.search(r"REG:(\d+)", usage)[1]), int(re.search(r"STACK:(\d+)", usage)[1])])
    return NoLaunch()

triton.runtime.driver.set_active(Driver())
JITFunction._do_compile = compile_only
import kernels.triton_attention as pa, kernels.store_kv as sk
pa.check_runnable = sk.check_runnable = lambda kernel, device: None   # CPU tensors stand in for CUDA ones
for cache_dtype, hd, (nh, kvh), bs in [(torch.float16, 128, (8, 2), 16), (torch.bfloat16, 64, (8, 1), 32),
                                        (torch.float8_e4m3fn, 128, (4, 4), 16)]:
    q_dtype = torch.bfloat16 if cache_dtype == torch.float8_e4m3fn else cache_dtype
    k = torch.zeros(64, bs, kvh, hd, dtype=cache_dtype)
    q = torch.zeros(4, nh, hd, dtype=q_dtype)
    tables, ctx = torch.zeros(4, 32, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    sk.store_kv(q[:, :kvh], q[:, :kvh], k, k.clone(), torch.zeros(4, dtype=torch.int64))
    pa.decode_with_splits(q, k, k, tables, ctx, 0.1, 1)
    pa.decode_with_splits(q, k, k, tables, ctx, 0.1, 4)
    pa.paged_prefill_attention(q, k, k, tables, torch.arange(5, dtype=torch.int32), ctx, 0.1)
print(json.dumps(report))
"""


@pytest.mark.skipif(CUDA, reason="a GPU compiles them for real in the tests above")
def test_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.splitlines()[-1])
    names = [name for name, _, _ in report]
    assert names.count("_decode_kernel") == 6 and names.count("_prefill_kernel") == 3, names
    assert "_decode_reduce_kernel" in names and "_store_kv_kernel" in names, names
    # Spilled registers go to local memory: the decode kernel's loads must not compete with them.
    spills = [(name, regs, stack) for name, regs, stack in report if stack > 16]
    assert not spills, f"kernels spill on sm_90 (name, registers, stack bytes): {spills}"


# ---------------------------------------------------------------------------------- errors

@pytest.fixture
def small(request):
    device = DEVICES[0]
    q, k_cache, v_cache, tables, ctx, scale = _decode_case(request, device, torch.float16, (4, 2), 16, [3, 20])
    return q, k_cache, v_cache, tables, ctx, scale


def test_error_bad_shapes(small):
    q, k_cache, v_cache, tables, ctx, scale = small
    with pytest.raises(ValueError, match=r"q .* must be \[num_seqs, num_heads, head_dim\]: its head_dim is 32"):
        pa.paged_decode_attention(q[..., :32], k_cache, v_cache, tables, ctx, scale)
    with pytest.raises(ValueError, match="num_heads 3 is not a multiple of num_kv_heads 2"):
        pa.paged_decode_attention(q[:, :3], k_cache, v_cache, tables, ctx, scale)
    with pytest.raises(ValueError, match=r"k_cache must be \[num_blocks, block_size, num_kv_heads, head_dim\]"):
        pa.paged_decode_attention(q, k_cache[0], v_cache, tables, ctx, scale)
    with pytest.raises(ValueError, match="k_cache .* and v_cache .* differ in shape"):
        pa.paged_decode_attention(q, k_cache, v_cache[:-1], tables, ctx, scale)
    with pytest.raises(ValueError, match=r"block_tables must be int32 \[num_seqs, max_blocks_per_seq\]"):
        pa.paged_decode_attention(q, k_cache, v_cache, tables[:1], ctx, scale)
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        pa.paged_decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k_cache, v_cache, tables, ctx,
                                  scale)
    key = torch.zeros(4, 2, 64, dtype=torch.float16, device=q.device)
    with pytest.raises(ValueError, match=r"slot_mapping must be \[T\]"):
        store_kv(key, key, k_cache, v_cache, torch.zeros(3, dtype=torch.int64, device=q.device))


def test_error_out_of_range_indices(small):
    q, k_cache, v_cache, tables, ctx, scale = small
    bad = tables.clone()
    bad[1, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match=rf"block_tables\[1, 1\] = {k_cache.shape[0]} is not a block of the cache"):
        pa.paged_decode_attention(q, k_cache, v_cache, bad, ctx, scale)
    bad[1, 1] = -1
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = -1 is not a block"):
        pa.paged_decode_attention(q, k_cache, v_cache, bad, ctx, scale)
    too_long = ctx.clone()
    too_long[0] = tables.shape[1] * 16 + 1
    with pytest.raises(ValueError, match=rf"context_lens\[0\] = {too_long[0]} does not fit block_tables: "
                                         rf"{tables.shape[1]} columns x block_size 16"):
        pa.paged_decode_attention(q, k_cache, v_cache, tables, too_long, scale)
    key = torch.zeros(2, 2, 64, dtype=torch.float16, device=q.device)
    slots = torch.tensor([5, k_cache.shape[0] * 16], device=q.device)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = \d+ is outside the cache"):
        store_kv(key, key, k_cache, v_cache, slots)
    cu = torch.tensor([0, 2, 7], dtype=torch.int32, device=q.device)        # 5 query tokens, context 20: fine
    qp = torch.zeros(7, 4, 64, dtype=torch.float16, device=q.device)
    with pytest.raises(ValueError, match=r"sequence 0 has 2 query tokens but context_lens\[0\] = 1"):
        pa.paged_prefill_attention(qp, k_cache, v_cache, tables, cu, torch.tensor([1, 20], dtype=torch.int32,
                                                                                 device=q.device), scale)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must rise from 0 to q.shape\[0\] = 8"):
        pa.paged_prefill_attention(torch.zeros(8, 4, 64, dtype=torch.float16, device=q.device),
                                   k_cache, v_cache, tables, cu, ctx, scale)


def test_error_wrong_dtypes(small):
    q, k_cache, v_cache, tables, ctx, scale = small
    with pytest.raises(ValueError, match="block_tables must be int32, got int64"):
        pa.paged_decode_attention(q, k_cache, v_cache, tables.long(), ctx, scale)
    with pytest.raises(ValueError, match="context_lens must be int32, got int64"):
        pa.paged_decode_attention(q, k_cache, v_cache, tables, ctx.long(), scale)
    with pytest.raises(ValueError, match="q dtype int32 is not supported"):
        pa.paged_decode_attention(q.int(), k_cache, v_cache, tables, ctx, scale)
    with pytest.raises(ValueError, match="k_cache dtype float64 is not supported"):
        pa.paged_decode_attention(q, k_cache.double(), v_cache.double(), tables, ctx, scale)
    with pytest.raises(ValueError, match=r"k_cache \(float16\) and v_cache \(float32\) differ in dtype"):
        pa.paged_decode_attention(q, k_cache, v_cache.float(), tables, ctx, scale)
    with pytest.raises(ValueError, match="slot_mapping must be int64 or int32, got float32"):
        store_kv(q[:, :2], q[:, :2], k_cache, v_cache, torch.zeros(2, device=q.device))


def test_value_checks_see_in_place_changes(small):
    # One check per step serves every layer; an in-place edit of the table is checked again.
    q, k_cache, v_cache, tables, ctx, scale = small
    pa.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    tables[0, 0] = k_cache.shape[0] + 5
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\]"):
        pa.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)


# ---------------------------------------------------------------------------------- backend switch

def test_backend_switch(monkeypatch):
    with compute.override(attention_backend="auto"):
        assert kernels.attention_backend().name == ("triton" if CUDA else "reference")
    assert kernels.attention_backend("reference").paged_decode_attention is ref.paged_decode_attention
    with compute.override(attention_backend="triton"):
        be = kernels.attention_backend()
        assert be.name == "triton" and be.paged_prefill_attention is pa.paged_prefill_attention
        assert be.store_kv is store_kv
        assert kernels.attention_backend("reference").name == "reference"       # the argument wins
    with pytest.raises(ValueError, match=r"--attention-backend 'cuda': choose auto \| triton \| reference"):
        compute.ComputePaths(attention_backend="cuda")
    with pytest.raises(ValueError, match=r"unknown attention backend 'cuda' \(from the argument"):
        kernels.attention_backend("cuda")


def test_backend_triton_runs_through_the_switch(request):
    args = _decode_case(request, DEVICES[0], torch.float32, (8, 2), 16, [9, 40])
    with compute.override(attention_backend="triton"):
        out = kernels.attention_backend().paged_decode_attention(*args)
    _assert_close(out, ref.paged_decode_attention(*args), TOL[torch.float32])


def test_check_kv_cache_dtype():
    cpu = torch.device("cpu")
    assert kernels.check_kv_cache_dtype("auto", cpu) == torch.float32
    assert kernels.check_kv_cache_dtype("auto", cpu, model_dtype=torch.bfloat16) == torch.bfloat16
    # a float32 decoder on a CPU: float16 where the C kernels read it, else its own dtype
    from kernels import compute, cpu_attention
    c_runs = cpu_attention.available() is None
    assert kernels.check_kv_cache_dtype("auto", cpu, model_dtype=torch.float32) == (torch.float16 if c_runs
                                                                                    else torch.float32)
    with compute.override(cpu_attention="torch"):
        assert kernels.check_kv_cache_dtype("auto", cpu, model_dtype=torch.float32) == torch.float32
    assert kernels.check_kv_cache_dtype("float32", cpu, model_dtype=torch.float32) == torch.float32
    assert kernels.check_kv_cache_dtype("float16", cpu) == torch.float16
    assert kernels.check_kv_cache_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="fp8 needs a CUDA GPU with compute capability >= 8.9.*device is cpu"):
        kernels.check_kv_cache_dtype("fp8", cpu)
    with pytest.raises(ValueError, match="'int8' is not one of auto, float32, bfloat16, float16, fp8"):
        kernels.check_kv_cache_dtype("int8", cpu)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_check_kv_cache_dtype_on_gpu():
    dev = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) >= (8, 9):
        assert kernels.check_kv_cache_dtype("fp8", dev) == torch.float8_e4m3fn
    else:
        with pytest.raises(ValueError, match=f"compute capability {major}.{minor}"):
            kernels.check_kv_cache_dtype("fp8", dev)
