"""Triton paged attention: decode (one query token per sequence, split-K) and chunked prefill.

Same functions, signatures and results as `kernels.reference`; the cache layout is there:

    k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables[s] = [7, 2, 9, -1]   token t of sequence s lives in block block_tables[s, t // bs],
                                      row t % bs; its head h row (head_dim values) is contiguous

Decode: `paged_decode_attention`
--------------------------------
Decode reads every cached K/V byte once and does ~2 flops per byte: it is bound by memory
bandwidth, so the tiling serves that.

    grid = (num_seqs, num_kv_heads, num_splits)

    program (s, g, j) :  query heads g*G .. g*G+G-1 (G = num_heads / num_kv_heads, padded to 16)
                         x  keys [j*split_len, min((j+1)*split_len, context_len))
                         walking BLOCK_N keys per iteration:
        block ids  <- block_tables[s, t // bs]           (BLOCK_N int32, hits L1)
        K tile     <- [BLOCK_N, head_dim] gathered rows  (one contiguous row per token)
        scores     =  q_group @ K^T      [16, BLOCK_N]   (tensor cores; rows past G are zero)
        online softmax (running max m, sum l, in log2 units: exp2 is one instruction)
        acc        += P @ V tile         [16, head_dim]

- One program per *kv head*, not per query head: the G query heads that share a kv head
  (GQA) use one read of its K/V. Per query head, K/V would be read G times.
- The G query rows pad to 16, the smallest tensor-core tile; the padding is arithmetic, which
  decode has to spare, and costs no memory traffic.
- BLOCK_N keys per iteration make ~16 KB of K (and as much V) at 16 bits: 64 keys at
  head_dim 128, 128 at head_dim 64, 32 at head_dim 256 or in fp32 (an fp8 tile counts as
  16-bit: it is widened in registers). With num_stages=2 Triton prefetches the next K and V
  tiles with cp.async into shared memory while the current ones are used. Compiled for
  sm_90 (fp16, head_dim 128, 4 warps) that is 96 registers and 38 KB of shared memory per
  program, so 5 programs fit an SM, with ~32 KB of loads in flight each: ~160 KB per SM
  against the ~30 KB that HBM latency x bandwidth needs (~0.8 us x 36 GB/s per SM on an
  H200). Larger tiles would cut the programs per SM; smaller ones would make the
  per-iteration max/exp2/rescale and block-table lookups a larger share of the time.
- Split-K (flash-decoding): with few sequences x kv heads there are too few programs to
  keep the SMs' memory pipes full (batch 64 x 2 kv heads = 128 programs for 132 SMs: one
  32 KB stream per SM). `decode_num_splits` splits each context into as many pieces as keep
  the grid within PROGRAMS_PER_SM (4) programs per SM, one wave of the 5 that fit (a second,
  partial wave would only add a tail), and never below MIN_TOKENS_PER_SPLIT (512) keys per
  split: each split writes a partial (m, l, acc[head_dim]) in fp32 per query head, which
  must stay small next to the K/V it read (512 keys x head_dim 128 x fp16 x K+V = 256 KB
  read per 4 KB written at G = 8). Batch 64 x 8 kv heads (512 programs) is not split;
  64 x 2 at context >= 2048 is split 4 ways. A second kernel (grid num_seqs x num_heads)
  combines the partials: out = sum_j 2^(m_j - M) acc_j / sum_j 2^(m_j - M) l_j. With one
  split the main kernel normalizes and writes the output itself. The split length comes
  from the block table's width (host-known: no sync), the split count is a runtime
  argument (no recompilation as the batch changes), and splits past a sequence's context
  return at once, so a CUDA graph captured at one width serves any lengths up to it.

Prefill: `paged_prefill_attention`
----------------------------------
Flash-attention forward over a packed chunk (q rows of all sequences back to back), K/V read
through the block table. Queries of sequence b sit at cache positions
context_len - q_len + i, so earlier tokens (prefix-cache hits, earlier chunks) are keys too.

    grid = (ceil(T / BLOCK_Q) + num_seqs, num_kv_heads)

    program (i, g): BLOCK_Q query tokens x the G query heads of kv head g = BLOCK_M rows
                    (row r = token r // G_p2, head r % G_p2), so GQA heads share K/V tiles;
                    keys 0 .. (last query position of the tile), BLOCK_N per iteration,
                    masked causally (key pos <= query pos).

Sequence b's tiles are numbered from cu_seqlens_q[b] // BLOCK_Q + b (vLLM's trick), which
leaves room for every sequence's partial tiles without knowing q lengths on the host; a
program finds its sequence by binary search over cu_seqlens_q and returns if its tile is
past that sequence's queries. Key tiles wholly before the tile's first query position run
unmasked; only the diagonal (under BLOCK_Q + BLOCK_N keys) pays for the causal select.

Precision: scores, softmax statistics and accumulators are fp32; q.K and P.V take their
inputs in q's dtype (fp16/bf16 tensor cores, fp32 with "ieee" precision: no tf32). An fp8
cache (e4m3, scale 1.0) is widened to q's dtype on load.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ._common import (check_activation, check_gqa, check_index, check_kv_caches, check_runnable, check_same_device,
                      check_tables, compute_dtype, next_pow2)

LOG2E = math.log2(math.e)
PROGRAMS_PER_SM = 4          # decode programs per SM to aim for (5 fit at fp16 / head_dim 128 on sm_90)
MIN_TOKENS_PER_SPLIT = 512   # below this a split's partial write is no longer small next to its reads
MAX_SPLITS = 64


MASK_NONE = tl.constexpr(0)     # every key of every tile is visible to every row
MASK_END = tl.constexpr(1)      # keys at or past `hi` are hidden
MASK_CAUSAL = tl.constexpr(2)   # ... and keys past each row's query position


@triton.jit
def _attend(q, acc, m_i, l_i, q_pos, lo, hi, k_ptr, v_ptr, bt_row, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, scale_log2,
            HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            COMPUTE: tl.constexpr, PRECISION: tl.constexpr, MASK: tl.constexpr):
    """Online softmax of q's rows over keys [lo, hi), BLOCK_N per iteration, read through the
    block table; returns the updated (acc, m, l). Scores are in log2 units (exp2)."""
    offs_d = tl.arange(0, HEAD_DIM_P2)
    d_mask = offs_d < HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASK == MASK_NONE:
            block = tl.load(bt_row + offs_n // BLOCK_SIZE).to(tl.int64)
            kv_mask = d_mask[None, :]                           # all true unless head_dim is padded
        else:
            n_mask = offs_n < hi
            block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        row = offs_n % BLOCK_SIZE
        k = tl.load(k_ptr + (block * stride_kb + row * stride_kt + kv_head * stride_kh)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(COMPUTE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2          # [rows, BLOCK_N]
        if MASK == MASK_END:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        elif MASK == MASK_CAUSAL:
            s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        # Finite: callers give every row a visible key in its first tile.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (block * stride_vb + row * stride_vt + kv_head * stride_vh)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(COMPUTE)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    scale_log2, split_len, num_splits,
    stride_qs, stride_qh, stride_os, stride_oh,                 # q / out [num_seqs, num_heads, head_dim]
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    start = split * split_len
    if SPLIT_K:
        # Split 0 always runs so that a sequence with context 0 still leaves a (zero) partial.
        if (split > 0) & (start >= ctx):
            return
    end = tl.minimum(start + split_len, ctx)

    offs_g = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(COMPUTE)

    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], tl.float32)
    # (q_pos is unused without the causal mask)
    acc, m_i, l_i = _attend(q, acc, m_i, l_i, offs_g, start, end, k_ptr, v_ptr, bt_ptr + seq * stride_bt, kv_head,
                            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, scale_log2,
                            HEAD_DIM, HEAD_DIM_P2, BLOCK_SIZE, BLOCK_N, COMPUTE, PRECISION, MASK_END)

    if not SPLIT_K:
        # context 0 (e.g. CUDA-graph padding rows) gives 0, as the reference does.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        part = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split            # [GROUP_P2]
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P2 + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_reduce_kernel(
    ctx_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, split_len, num_splits, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, NUM_SPLITS_P2: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(ctx_ptr + seq)
    offs_s = tl.arange(0, NUM_SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    s_mask = offs_s < tl.maximum(tl.cdiv(ctx, split_len), 1)            # the splits that ran
    part = (seq * tl.num_programs(1) + head) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_P2 + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)   # context 0: no keys, l = acc = 0
    w = tl.exp2(m - m_max)
    denom = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, ctx_ptr, out_ptr, scale_log2, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,                 # q / out [T, num_heads, head_dim]
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The last sequence b whose first tile, cu_seqlens_q[b] // BLOCK_Q + b, is <= tile.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)                  # this program's tile within the sequence
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    tok = q_tile * BLOCK_Q + offs_m // GROUP_P2                 # query token within the sequence
    g = offs_m % GROUP_P2
    heads = kv_head * GROUP + g
    row_mask = (tok < q_len) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    rows_d_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=rows_d_mask, other=0.0).to(COMPUTE)
    q_pos = ctx - q_len + tok                                   # cache position of each row's query
    kv_end = ctx - q_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)   # past the tile's last query

    # Rows past q_len (or past G) compute on zeros and are not stored; every row sees key 0,
    # so the running max is finite after the first tile.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    bt_row = bt_ptr + seq * stride_bt
    # Keys before the tile's first query position are visible to all its rows: no mask.
    # The rest (the diagonal, < BLOCK_Q + BLOCK_N keys) is masked causally.
    full_end = (ctx - q_len + q_tile * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend(q, acc, m_i, l_i, q_pos, 0, full_end, k_ptr, v_ptr, bt_row, kv_head,
                            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, scale_log2,
                            HEAD_DIM, HEAD_DIM_P2, BLOCK_SIZE, BLOCK_N, COMPUTE, PRECISION, MASK_NONE)
    acc, m_i, l_i = _attend(q, acc, m_i, l_i, q_pos, full_end, kv_end, k_ptr, v_ptr, bt_row, kv_head,
                            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, scale_log2,
                            HEAD_DIM, HEAD_DIM_P2, BLOCK_SIZE, BLOCK_N, COMPUTE, PRECISION, MASK_CAUSAL)

    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rows_d_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the interpreter, which runs programs one by one."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per context for decode: as many as keep the grid within PROGRAMS_PER_SM
    programs per SM, none shorter than MIN_TOKENS_PER_SPLIT keys, at most MAX_SPLITS
    (see the module docstring)."""
    programs = max(1, num_seqs * num_kv_heads)
    return max(1, min(PROGRAMS_PER_SM * num_sms // programs, max_context // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


def decode_config(head_dim: int, cache_dtype: torch.dtype) -> dict[str, int]:
    """Tiling of the decode kernel: BLOCK_N keys for ~16 KB of K per iteration at 16 bits (an
    fp8 tile is widened in registers, so it counts as 16-bit), see the module docstring."""
    elem = max(2, cache_dtype.itemsize)
    block_n = min(128, max(32, 16384 // (next_pow2(head_dim, 16) * elem)))
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 2}


def prefill_config(head_dim: int, compute: tl.dtype) -> dict[str, int]:
    """Tiling of the prefill kernel: 64 x 64 score tiles at 4 warps, the FlashAttention-2
    Triton default; 32 x 32 at head_dim 256, whose q / K / V / accumulator tiles would spill
    at 64. fp32 ("ieee" dots run on the FMA units, with operands held in registers): 32 x 16
    at 8 warps, the largest tile sm_90 compiles without spilling (76 registers)."""
    if compute == tl.float32:
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    tile = 64 if next_pow2(head_dim, 16) <= 128 else 32
    return {"BLOCK_M": tile, "BLOCK_N": tile, "num_warps": 4, "num_stages": 2}


def _check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          context_lens: torch.Tensor, q_layout: str) -> tuple[int, int, int, int, int]:
    """Metadata checks shared by decode and prefill -> (num_blocks, block_size, kvh, head_dim, group)."""
    num_blocks, block_size, kvh, hd = check_kv_caches(k_cache, v_cache)
    check_activation("q", q, q_layout, {2: ("head_dim", hd)})
    group = check_gqa(q.shape[1], kvh)
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else None
    check_index("context_lens", context_lens, (torch.int32,), (num_seqs,), "int32 [num_seqs]")
    check_index("block_tables", block_tables, (torch.int32,), (num_seqs, None),
                "int32 [num_seqs, max_blocks_per_seq] (one row per context_lens entry)")
    return num_blocks, block_size, kvh, hd, group


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence: q `[B, num_heads, head_dim]` attends to its sequence's
    `context_lens[b]` cached tokens -> `[B, num_heads, head_dim]` (see kernels.reference)."""
    _, block_size, kvh, _, _ = _check_attention_args(q, k_cache, v_cache, block_tables, context_lens,
                                                     "[num_seqs, num_heads, head_dim]")
    if q.shape[0] != context_lens.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences but context_lens has {context_lens.shape[0]}")
    device = check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                               context_lens=context_lens)
    check_runnable(_decode_kernel, device)
    check_tables(block_tables, context_lens, k_cache.shape[0], block_size)
    splits = decode_num_splits(q.shape[0], kvh, block_tables.shape[1] * block_size, _num_sms(device))
    return decode_with_splits(q, k_cache, v_cache, block_tables, context_lens, scale, splits)


def decode_with_splits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, scale: float, num_splits: int) -> torch.Tensor:
    """The decode launch with an explicit split count (arguments already checked); tests and
    the benchmark call it to cover both paths whatever `decode_num_splits` would pick."""
    num_seqs, num_heads, hd = q.shape
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kvh
    hd_p2 = next_pow2(hd, 16)
    compute, precision = compute_dtype(q.dtype, k_cache.dtype, _decode_kernel)
    cfg = decode_config(hd, k_cache.dtype)
    block_n = cfg.pop("BLOCK_N")
    width = block_tables.shape[1] * block_size
    split_len = max(1, triton.cdiv(triton.cdiv(width, num_splits), block_n)) * block_n
    num_splits = max(1, triton.cdiv(width, split_len))         # rounding split_len up may need fewer
    out = torch.empty((num_seqs, num_heads, hd), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if num_splits > 1:
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_seqs, num_heads, num_splits, hd_p2), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out                       # not read: the kernel writes `out` itself
    _decode_kernel[(num_seqs, kvh, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_acc,
        scale * LOG2E, split_len, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_P2=next_pow2(group, 16), HEAD_DIM=hd, HEAD_DIM_P2=hd_p2,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT_K=num_splits > 1, COMPUTE=compute, PRECISION=precision,
        **cfg,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            context_lens, out, part_m, part_l, part_acc, split_len, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=hd, HEAD_DIM_P2=hd_p2, NUM_SPLITS_P2=next_pow2(num_splits),
            num_warps=4,
        )
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """A packed chunk of new tokens per sequence, q `[T, num_heads, head_dim]`, rows
    `cu_seqlens_q[b]:cu_seqlens_q[b+1]` being the last q_len of sequence b's `context_lens[b]`
    cached tokens; causal -> `[T, num_heads, head_dim]` (see kernels.reference)."""
    _, block_size, kvh, hd, group = _check_attention_args(q, k_cache, v_cache, block_tables, context_lens,
                                                          "[T, num_heads, head_dim]")
    num_seqs = context_lens.shape[0]
    check_index("cu_seqlens_q", cu_seqlens_q, (torch.int32,), (num_seqs + 1,), "int32 [num_seqs + 1]")
    device = check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                               cu_seqlens_q=cu_seqlens_q, context_lens=context_lens)
    check_runnable(_prefill_kernel, device)
    check_tables(block_tables, context_lens, k_cache.shape[0], block_size, cu_seqlens_q, q.shape[0])
    num_tokens, num_heads, _ = q.shape
    out = torch.empty((num_tokens, num_heads, hd), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    compute, precision = compute_dtype(q.dtype, k_cache.dtype, _prefill_kernel)
    cfg = prefill_config(hd, compute)
    group_p2 = next_pow2(group)
    block_q = max(1, cfg.pop("BLOCK_M") // group_p2)            # BLOCK_M = BLOCK_Q x GROUP_P2 rows
    hd_p2 = next_pow2(hd, 16)
    _prefill_kernel[(triton.cdiv(num_tokens, block_q) + num_seqs, kvh)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=hd, HEAD_DIM_P2=hd_p2, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, COMPUTE=compute, PRECISION=precision, **cfg,
    )
    return out
