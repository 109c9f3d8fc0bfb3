"""The CPU serving path of paged attention equals kernels.reference on ragged, GQA batches
that mix decodes and prefill chunks, with shuffled block tables: decodes through the C kernel
(where it builds) and through the torch path, prefill chunks through SDPA."""

import pytest
import torch

from embedserve.models import attention_dispatch
from embedserve.models.attention_dispatch import AttentionMetadata, paged_attention, store_kv
from kernels import cpu_attention, reference


@pytest.fixture(params=["c-kernel", "torch"])
def decode_path(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(attention_dispatch, "_cpu_kernel_runs", lambda q, k: False)
    elif cpu_attention.available() is not None:
        pytest.skip(f"the C kernel does not build here: {cpu_attention.available()}")
    return request.param


@pytest.mark.parametrize("block_size,nh,kvh", [(16, 8, 2), (32, 4, 4), (16, 9, 3)])
def test_cpu_path_equals_reference(block_size, nh, kvh, decode_path, monkeypatch):
    g = torch.Generator().manual_seed(block_size + nh)
    hd, num_blocks = 64, 64
    kc = torch.randn(num_blocks, block_size, kvh, hd, generator=g)
    vc = torch.randn(num_blocks, block_size, kvh, hd, generator=g)
    # (context length after this step, new tokens this step): decodes first, then chunks
    # ... and chunks past 256 tokens (SDPA with enable_gqa instead of folded query heads): one
    # after a cached prefix (masked), one a whole prompt (SDPA's own causal path)
    seqs = [(1, 1), (block_size * 2, 1), (77, 1), (50, 50), (block_size * 3, block_size), (90, 13), (300, 290),
            (270, 270)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, cu = [], [], [0]
    for n, ql in seqs:
        nb = -(-n // block_size)
        t, perm = perm[:nb], perm[nb:]
        tables.append(t + [-1] * (20 - nb))
        slots += [t[p // block_size] * block_size + p % block_size for p in range(n - ql, n)]
        cu.append(cu[-1] + ql)
    T = cu[-1]
    q = torch.randn(T, nh, hd, generator=g)
    k_new, v_new = torch.randn(T, kvh, hd, generator=g), torch.randn(T, kvh, hd, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
                             context_lens=torch.tensor([n for n, _ in seqs], dtype=torch.int32),
                             cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), num_decodes=3,
                             context_lens_list=[n for n, _ in seqs], q_lens_list=[ql for _, ql in seqs])
    kc2, vc2 = kc.clone(), vc.clone()
    store_kv(k_new, v_new, kc, vc, meta.slot_mapping)
    reference.store_kv(k_new, v_new, kc2, vc2, meta.slot_mapping)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    sdpa, causal_calls = attention_dispatch.F.scaled_dot_product_attention, []

    def counting(*args, **kwargs):
        causal_calls.append(kwargs.get("is_causal", False))
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(attention_dispatch.F, "scaled_dot_product_attention", counting)
    ours = paged_attention(q, kc, vc, meta, hd ** -0.5)
    assert causal_calls.count(True) == 1            # the whole 270-token prompt, and only it
    ref = reference.paged_prefill_attention(q, kc2, vc2, meta.block_tables, meta.cu_seqlens_q,
                                            meta.context_lens, hd ** -0.5)
    # fp32 both ways; different summation orders (SDPA vs einsum) -> ~1e-6
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    dec = reference.paged_decode_attention(q[:3], kc2, vc2, meta.block_tables[:3], meta.context_lens[:3], hd ** -0.5)
    torch.testing.assert_close(ours[:3], dec, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ql", [10, 300])
def test_no_mask_means_causal_from_the_first_key(ql):
    """`_gqa_sdpa` with mask None (a chunk with no cached prefix) equals the explicit lower
    triangle, on both of its paths (folded query heads up to 256 rows, enable_gqa past them)."""
    g = torch.Generator().manual_seed(ql)
    q = torch.randn(1, ql, 9, 64, generator=g)
    k, v = torch.randn(1, 3, ql + 6, 64, generator=g), torch.randn(1, 3, ql + 6, 64, generator=g)   # block padding
    tril = torch.ones(ql, ql + 6, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(attention_dispatch._gqa_sdpa(q, k, v, None, 0.125),
                               attention_dispatch._gqa_sdpa(q, k, v, tril, 0.125), rtol=1e-5, atol=1e-5)
