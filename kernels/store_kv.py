"""Triton `store_kv`: write this step's keys and values into the paged cache by slot.

One program per token copies that token's [num_kv_heads, head_dim] rows of K and of V to
its slot; a negative slot (padding) writes nothing.

    key[t]  (kvh x hd, row stride free)  ──▶  k_cache[slot // block_size, slot % block_size]

A token's K/V is a few KB at most, one contiguous row in the cache, so a program per token
already issues full-width vector stores; the copy is bound by bandwidth, not by tiling.
Cache offsets are computed in int64: a large cache passes 2**31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (check_activation, check_index, check_kv_caches,
                      check_runnable, check_same_device, check_slots, next_pow2)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,                 # key / value [T, kvh, hd]
    stride_kcb, stride_kcs, stride_kch,                         # k_cache [blocks, block_size, kvh, hd]
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, NUM_KV_HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, NUM_KV_HEADS_P2)[:, None]
    d = tl.arange(0, HEAD_DIM_P2)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)



def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value `[T, num_kv_heads, head_dim]` into the caches at `slot_mapping` `[T]`
    (int64 or int32; a negative slot means "skip this token"). See kernels.reference.store_kv."""
    num_blocks, block_size, kvh, hd = check_kv_caches(k_cache, v_cache)
    layout = "[T, num_kv_heads, head_dim]"
    for name, t in (("key", key), ("value", value)):
        check_activation(name, t, layout, {1: ("num_kv_heads", kvh), 2: ("head_dim", hd)})
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    check_index("slot_mapping", slot_mapping, (torch.int64, torch.int32), (key.shape[0],), "[T] (one slot per key row)")
    device = check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_runnable(_store_kv_kernel, device)
    check_slots(slot_mapping, num_blocks, block_size)
    if key.shape[0] == 0:
        return
    _store_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=kvh, NUM_KV_HEADS_P2=next_pow2(kvh), HEAD_DIM=hd, HEAD_DIM_P2=next_pow2(hd),
        BLOCK_SIZE=block_size, num_warps=4,
    )
