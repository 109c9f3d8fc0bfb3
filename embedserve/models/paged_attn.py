"""Attention over the paged KV cache, as the decode model calls it.

On a GPU this dispatches to the Triton kernels (`kernels.attention_backend()`); on a CPU it
runs a vectorized torch path — one gather of each sequence's cached K/V through its block
table and one `scaled_dot_product_attention` for all decoding sequences, one per prefill
chunk — that `tests/test_paged_attn.py` checks against `kernels.reference`.

The batch is ordered decodes first (one query token each), then prefill chunks:

    q rows:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      cu_seqlens_q = [0, 1, 2, 3, 7, 9]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """(B, max_len, kvh, hd) view of each sequence's first max_len cached tokens."""
    bs = cache.shape[1]
    pos = torch.arange(max_len, device=cache.device)
    blocks = block_tables[:, pos // bs].long().clamp_min(0)            # (B, max_len)
    slots = blocks * bs + pos % bs
    return cache.view(-1, *cache.shape[2:])[slots]


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
    out = torch.empty_like(q)
    D = meta.num_decodes
    if D:
        ctx = meta.context_lens[:D]
        L = max(meta.context_lens_list[:D])
        k = _gather(k_cache, meta.block_tables[:D], L).transpose(1, 2)     # (D, kvh, L, hd)
        v = _gather(v_cache, meta.block_tables[:D], L).transpose(1, 2)
        mask = (torch.arange(L, device=q.device)[None, :] < ctx[:, None])[:, None, None, :]  # (D,1,1,L)
        o = F.scaled_dot_product_attention(q[:D, :, None, :].to(k.dtype), k, v, attn_mask=mask,
                                           scale=scale, enable_gqa=True)  # (D, nh, 1, hd)
        out[:D] = o[:, :, 0, :].to(q.dtype)
    starts = meta.cu_seqlens_q.tolist()
    for b in range(D, len(meta.context_lens_list)):
        s0, s1 = starts[b], starts[b + 1]
        ql, n = s1 - s0, meta.context_lens_list[b]
        k = _gather(k_cache, meta.block_tables[b:b + 1], n).transpose(1, 2)  # (1, kvh, n, hd)
        v = _gather(v_cache, meta.block_tables[b:b + 1], n).transpose(1, 2)
        qpos = torch.arange(n - ql, n, device=q.device)[:, None]
        mask = (torch.arange(n, device=q.device)[None, :] <= qpos)[None, None]  # (1,1,ql,n)
        o = F.scaled_dot_product_attention(q[s0:s1].transpose(0, 1)[None].to(k.dtype), k, v,
                                           attn_mask=mask, scale=scale, enable_gqa=True)  # (1, nh, ql, hd)
        out[s0:s1] = o[0].transpose(0, 1).to(q.dtype)
    return out
