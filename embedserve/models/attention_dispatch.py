"""Attention over the paged KV cache, as the decode model calls it.

On a GPU this dispatches to the Triton kernels (`kernels.attention_backend()`); on a CPU it
runs a vectorized torch path — one gather of each sequence's cached K/V through its block
table and one `scaled_dot_product_attention` for all decoding sequences, one per prefill
chunk — that `tests/test_attention_dispatch.py` checks against `kernels.reference`.

The batch is ordered decodes first (one query token each), then prefill chunks:

    q rows:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      cu_seqlens_q = [0, 1, 2, 3, 7, 9]
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    cache: dict = field(default_factory=dict)   # gather slots and masks, built once per step


def _slots(block_tables: torch.Tensor, block_size: int, max_len: int) -> torch.Tensor:
    """(B, max_len) cache slots of each sequence's first max_len tokens."""
    pos = torch.arange(max_len, device=block_tables.device)
    blocks = block_tables[:, pos // block_size].long().clamp_min(0)
    return blocks * block_size + pos % block_size


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


def _plan(meta: AttentionMetadata, block_size: int) -> dict:
    """Slots and masks shared by every layer of the step."""
    if meta.cache:
        return meta.cache
    dev = meta.block_tables.device
    D = meta.num_decodes
    if D:
        L = max(meta.context_lens_list[:D])
        meta.cache["decode"] = (
            _slots(meta.block_tables[:D], block_size, L),
            (torch.arange(L, device=dev)[None, :] < meta.context_lens[:D, None])[:, None, None, :])  # (D,1,1,L)
    starts = meta.cache["starts"] = meta.cu_seqlens_q.tolist()
    for b in range(D, len(meta.context_lens_list)):
        ql, n = starts[b + 1] - starts[b], meta.context_lens_list[b]
        qpos = torch.arange(n - ql, n, device=dev)[:, None]
        meta.cache[b] = (_slots(meta.block_tables[b:b + 1], block_size, n),
                         (torch.arange(n, device=dev)[None, :] <= qpos)[None, None])     # (1,1,ql,n)
    return meta.cache


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """(B, L, kvh, hd) -> transposed (B, kvh, L, hd) for SDPA."""
    return cache.view(-1, *cache.shape[2:])[slots].transpose(1, 2)


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
    plan = _plan(meta, k_cache.shape[1])
    D = meta.num_decodes
    if D:
        slots, mask = plan["decode"]
        o = F.scaled_dot_product_attention(q[:D, :, None, :].to(k_cache.dtype), _gather(k_cache, slots),
                                           _gather(v_cache, slots), attn_mask=mask, scale=scale,
                                           enable_gqa=True)                    # (D, nh, 1, hd)
        out[:D] = o[:, :, 0, :].to(q.dtype)
    starts = plan["starts"]
    for b in range(D, len(meta.context_lens_list)):
        s0, s1 = starts[b], starts[b + 1]
        slots, mask = plan[b]
        o = F.scaled_dot_product_attention(q[s0:s1].transpose(0, 1)[None].to(k_cache.dtype),
                                           _gather(k_cache, slots), _gather(v_cache, slots),
                                           attn_mask=mask, scale=scale, enable_gqa=True)  # (1, nh, ql, hd)
        out[s0:s1] = o[0].transpose(0, 1).to(q.dtype)
    return out
