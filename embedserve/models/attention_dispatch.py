"""Attention over the paged KV cache, as the decode model calls it.

On a GPU this dispatches to the Triton kernels (`kernels.attention_backend()`). On a CPU the
decoding sequences go to the C kernel `kernels.cpu_attention` where it builds (K/V read in
place through the block table), else to one `scaled_dot_product_attention` over their K/V
blocks gathered through the block tables (the query heads of a KV head folded into the query
rows); each prefill chunk gets one SDPA. `tests/test_attention_dispatch.py` checks both paths
against `kernels.reference`.

The batch is ordered decodes first (one query token each), then prefill chunks:

    q rows:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      cu_seqlens_q = [0, 1, 2, 3, 7, 9]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import cpu_attention


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors the model runner builds (layout in kernels/reference.py)."""

    slot_mapping: torch.Tensor       # int64 [T]
    block_tables: torch.Tensor       # int32 [B, max_blocks]
    context_lens: torch.Tensor       # int32 [B]   cached tokens after this step's are stored
    cu_seqlens_q: torch.Tensor       # int32 [B + 1]
    num_decodes: int                 # the first num_decodes sequences have exactly one query token
    context_lens_list: list[int]
    q_lens_list: list[int]
    cache: dict = field(default_factory=dict)   # gather slots and masks, built once per step


def _blocks(block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """(B, num_blocks) int64 block ids; padding entries (-1) read block 0 and are masked."""
    return block_tables[:, :num_blocks].long().clamp_min(0)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write this step's K/V into the cache by slot."""
    if k_cache.is_cuda:
        from kernels import attention_backend
        attention_backend().store_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    kf.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    vf.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _plan(meta: AttentionMetadata, block_size: int, decodes: bool) -> dict:
    """Block ids and masks shared by every layer of the step (keys padded to whole blocks);
    `decodes`: also those of the decoding sequences (the torch path). A whole prompt past 256
    tokens (no cached prefix) gets no mask: SDPA's own causal path (`_gqa_sdpa`)."""
    if meta.cache:
        return meta.cache
    dev = meta.block_tables.device
    D = meta.num_decodes
    if D and decodes:
        nb = -(-max(meta.context_lens_list[:D]) // block_size)
        keys = torch.arange(nb * block_size, device=dev)
        meta.cache["decode"] = (_blocks(meta.block_tables[:D], nb),
                                (keys[None, :] < meta.context_lens[:D, None])[:, None, None, :])  # (D,1,1,L)
    starts = meta.cache["starts"] = meta.cu_seqlens_q.tolist()
    for b in range(D, len(meta.context_lens_list)):
        ql, n = starts[b + 1] - starts[b], meta.context_lens_list[b]
        nb = -(-n // block_size)
        if ql == n and ql > 256:
            meta.cache[b] = (_blocks(meta.block_tables[b:b + 1], nb), None)
            continue
        qpos = torch.arange(n - ql, n, device=dev)[:, None]
        meta.cache[b] = (_blocks(meta.block_tables[b:b + 1], nb),
                         (torch.arange(nb * block_size, device=dev)[None, :] <= qpos)[None, None])  # (1,1,ql,L)
    return meta.cache


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Whole blocks of each sequence, (B, nb) ids -> (B, kvh, nb * block_size, hd) for SDPA
    (a block is one contiguous row of the cache seen as 2-D: `index_select` on rows is ~6x
    faster on the CPU than advanced indexing, and far cheaper than gathering token rows)."""
    B, nb = blocks.shape
    rows = cache.view(cache.shape[0], -1).index_select(0, blocks.reshape(-1))
    return rows.view(B, nb * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def _gqa_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """Grouped-query attention with each KV head's query heads folded into the query length:
    q (B, ql, nh, hd), k/v (B, kvh, L, hd), mask (B, 1, ql, L) -> (B, ql, nh, hd). mask None:
    causal from the first key (query i sees keys 0..i: a chunk with no cached prefix).

    One SDPA over (B, kvh) with g * ql query rows instead of `enable_gqa` over (B, nh) with ql
    rows: for a decode (ql = 1) the CPU kernel is ~5x faster so, for chunks up to a few hundred
    tokens ~10 % faster; past 256 rows `enable_gqa` is. Query head h reads KV head h // g, as in
    HF's repeat_kv."""
    B, ql, nh, hd = q.shape
    kvh = k.shape[1]
    g = nh // kvh
    if q.dtype == torch.float32 and k.dtype != q.dtype:     # a 16-bit cache under a float32 decoder:
        k, v = k.float(), v.float()                         # SDPA in float32 (the gather copied them anyway)
    if ql > 256:                    # long chunks: enable_gqa is ~7 % faster there (1000 x 1000)
        # is_causal: SDPA's flash kernel skips the blocks above the diagonal, which a mask makes
        # it compute (2,000 x 2,000, 9 heads, fp32, 2 threads: 43 vs 79 ms; the same outputs)
        o = F.scaled_dot_product_attention(q.transpose(1, 2).to(k.dtype), k, v, attn_mask=mask, scale=scale,
                                           is_causal=mask is None, enable_gqa=True)         # (B, nh, ql, hd)
        return o.transpose(1, 2)
    if mask is None:
        mask = torch.ones(ql, k.shape[2], dtype=torch.bool, device=q.device).tril()[None, None]
    qg = q.view(B, ql, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(B, kvh, g * ql, hd)
    if ql > 1:
        mask = mask[:, :, None].expand(B, 1, g, ql, mask.shape[-1]).reshape(B, 1, g * ql, mask.shape[-1])
    o = F.scaled_dot_product_attention(qg.to(k.dtype), k, v, attn_mask=mask, scale=scale)   # (B, kvh, g*ql, hd)
    return o.view(B, kvh, g, ql, hd).permute(0, 3, 1, 2, 4).reshape(B, ql, nh, hd)


def _cpu_kernel_runs(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return cpu_attention.supports(q, k_cache) and cpu_attention.available() is None


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q (T, nh, hd) -> (T, nh, hd), reading K/V of every sequence from the paged cache."""
    if q.is_cuda:
        from kernels import attention_backend
        be = attention_backend()
        if meta.num_decodes == len(meta.context_lens_list):
            return be.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        return be.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                          meta.context_lens, scale)
    D = meta.num_decodes
    kernel = D and _cpu_kernel_runs(q, k_cache)
    if kernel and D == len(meta.context_lens_list):                   # a decode-only step: no copy
        return cpu_attention.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    out = torch.empty_like(q)
    plan = _plan(meta, k_cache.shape[1], decodes=not kernel)
    if kernel:
        out[:D] = cpu_attention.paged_decode_attention(q[:D], k_cache, v_cache, meta.block_tables[:D],
                                                       meta.context_lens[:D], scale)
    elif D:
        blocks, mask = plan["decode"]
        out[:D] = _gqa_sdpa(q[:D, None], _gather(k_cache, blocks), _gather(v_cache, blocks), mask, scale)[:, 0]
    starts = plan["starts"]
    for b in range(D, len(meta.context_lens_list)):
        s0, s1 = starts[b], starts[b + 1]
        blocks, mask = plan[b]
        out[s0:s1] = _gqa_sdpa(q[None, s0:s1], _gather(k_cache, blocks), _gather(v_cache, blocks), mask, scale)[0]
    return out
