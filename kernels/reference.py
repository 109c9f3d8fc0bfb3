"""Plain-torch definitions of the paged-KV-cache functions (also the CPU serving path).

The contract between the decode engine and the kernels (vLLM / nano-vllm layout):

    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]   (one pair per layer)
    slot             : block_id * block_size + offset      (a token's place in the cache)
    block_tables     : int32 [num_seqs, max_blocks_per_seq]   (-1 or any value past the
                       sequence's blocks is never read)
    context_lens     : int32 [num_seqs]   tokens of each sequence in the cache, this step's included

          block_tables[s] = [7, 2, 9]           block_size = 4, context_len = 10
          tokens 0-3 -> block 7, 4-7 -> block 2, 8-9 -> block 9 (offsets 0, 1)
"""

from __future__ import annotations

import torch


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value `[T, num_kv_heads, head_dim]` into the caches at `slot_mapping` `[T]`
    (int64; a negative slot means "skip this token", e.g. padding)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])                # (num_blocks * block_size, kvh, hd)
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat[slots] = key[keep].to(k_cache.dtype)
    v_flat[slots] = value[keep].to(v_cache.dtype)


def _gather(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` tokens of one sequence from the paged cache -> (n, kvh, hd)."""
    bs = cache.shape[1]
    nblocks = (n + bs - 1) // bs
    return cache[table[:nblocks].long()].reshape(-1, *cache.shape[2:])[:n]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence: q `[B, num_heads, head_dim]` attends to its sequence's
    `context_lens[b]` cached tokens (its own included) -> `[B, num_heads, head_dim]`.
    GQA: query head h reads kv head h // (num_heads // num_kv_heads)."""
    B, nh, hd = q.shape
    kvh = k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(B):
        n = int(context_lens[b])
        k = _gather(k_cache, block_tables[b], n).float()               # (n, kvh, hd)
        v = _gather(v_cache, block_tables[b], n).float()
        k = k.repeat_interleave(nh // kvh, dim=1)                      # (n, nh, hd)
        v = v.repeat_interleave(nh // kvh, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale        # (nh, n)
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk of new tokens per sequence, packed: q `[T, num_heads, head_dim]`, sequence b's
    tokens are rows `cu_seqlens_q[b]:cu_seqlens_q[b+1]` and are the LAST q_len of its
    `context_lens[b]` cached tokens (their K/V already stored; earlier ones come from a prefix
    cache hit or earlier chunks). Causal: query i sees cache positions <= context_len - q_len + i."""
    T, nh, hd = q.shape
    kvh = k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(len(context_lens)):
        s0, s1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ql, n = s1 - s0, int(context_lens[b])
        if ql == 0:
            continue
        k = _gather(k_cache, block_tables[b], n).float().repeat_interleave(nh // kvh, dim=1)  # (n, nh, hd)
        v = _gather(v_cache, block_tables[b], n).float().repeat_interleave(nh // kvh, dim=1)
        s = torch.einsum("qhd,nhd->hqn", q[s0:s1].float(), k) * scale   # (nh, ql, n)
        qpos = torch.arange(n - ql, n, device=q.device)[:, None]          # (ql, 1)
        kpos = torch.arange(n, device=q.device)[None, :]                  # (1, n)
        s = s.masked_fill(kpos > qpos, float("-inf"))
        out[s0:s1] = torch.einsum("hqn,nhd->qhd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out
