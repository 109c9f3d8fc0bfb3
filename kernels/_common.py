"""Plumbing shared by the Triton kernels: the argument checks, and where a kernel may run.

Where kernels run. A `@triton.jit` kernel runs compiled on CUDA tensors. On a CPU it runs only
under Triton's interpreter, which `TRITON_INTERPRET=1` selects when `@triton.jit` decorates,
for triton's own library functions (`tl.max`, `tl.sum`, ...) as well as ours: the variable
must be set before triton is first imported (tests/test_kernels.py and kernels/bench.py do
that when there is no GPU). `check_runnable` turns the two ways this goes wrong into a clear
ValueError instead of a failure inside Triton.

Checks. They raise ValueError naming the argument and what is wrong. Shape, dtype, stride
and device checks read only tensor metadata. The value checks (block ids inside the cache,
context lengths inside the block table, slots inside the cache, cu_seqlens_q consistent) read
the index tensors, one device sync per call; every layer of a step passes the same index
tensors, so the last tensors that passed are remembered (by identity and `_version`, which
in-place writes bump) and one check serves the whole step. Value checks are skipped during
CUDA-graph capture, where a sync is not allowed, and do not see writes made by kernels
(which do not bump `_version`).
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl
from triton.runtime import JITFunction

ACTIVATION_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# fp8 caches are stored as e4m3 with a per-tensor scale of 1.0 (values cast as they are);
# the kernels widen them on load.
CACHE_DTYPES = {**ACTIVATION_DTYPES, torch.float8_e4m3fn: tl.float8e4nv}
MAX_HEAD_DIM = 256          # one head's row stays in registers; past this the tiles spill


def check_runnable(kernel: object, device: torch.device) -> None:
    """`kernel` (a `@triton.jit` object) can run on tensors of `device` in this process."""
    if device.type == "cuda" and not interpreted(kernel):
        return
    if not interpreted(kernel):
        raise ValueError(f"the Triton kernels got {device} tensors: they run on CUDA, or on the CPU under "
                         "Triton's interpreter only (set TRITON_INTERPRET=1 before triton is first imported), "
                         "or use the reference backend")
    if isinstance(tl.max, JITFunction):
        raise ValueError("TRITON_INTERPRET=1 was set after triton was imported: triton's library functions "
                         "(tl.max, ...) are compiled-only; set it before the first `import triton`")


def next_pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def interpreted(kernel: object) -> bool:
    """Whether `kernel` runs in Triton's interpreter rather than compiled."""
    return not isinstance(kernel, JITFunction)


def compute_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype, kernel: object) -> tuple[tl.dtype, str]:
    """(dtype the dot products read, their input precision). q's dtype when the cache holds
    the same or fp8 (widened on load); fp32 when they differ otherwise, so that neither side is
    narrowed. fp32 dots use "ieee": tf32 would cost the ~1e-3 relative error fp32 callers do
    not expect. Triton 3.9's interpreter multiplies bf16 operands as their raw uint16 bits, so
    there bf16 dots run in fp32 (loads, stores and the softmax are unchanged)."""
    if cache_dtype in (q_dtype, torch.float8_e4m3fn):
        t = ACTIVATION_DTYPES[q_dtype]
    else:
        t = tl.float32
    if t == tl.bfloat16 and interpreted(kernel):
        t = tl.float32
    return t, ("ieee" if t == tl.float32 else "tf32")


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """-> (num_blocks, block_size, num_kv_heads, head_dim)."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], "
                             f"got shape {tuple(c.shape)}")
        if c.dtype not in CACHE_DTYPES:
            raise ValueError(f"{name} dtype {_dt(c)} is not supported: use float16, bfloat16, "
                             "float32 or float8_e4m3fn")
        if c.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1), "
                             f"got strides {c.stride()}")
        if c.device.type not in ("cuda", "cpu"):
            raise ValueError(f"{name} is on {c.device}: the kernels run on CUDA (or interpreted on CPU)")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache ({_dt(k_cache)}) and v_cache ({_dt(v_cache)}) differ in dtype")
    if (k_cache.dtype == torch.float8_e4m3fn and k_cache.is_cuda
            and torch.cuda.get_device_capability(k_cache.device) < (8, 9)):
        raise ValueError(f"an fp8 (float8_e4m3fn) cache needs compute capability >= 8.9; {k_cache.device} has "
                         "{}.{}".format(*torch.cuda.get_device_capability(k_cache.device)))
    num_blocks, block_size, kvh, hd = k_cache.shape
    if min(num_blocks, block_size, kvh, hd) < 1:
        raise ValueError(f"k_cache has an empty dimension: shape {tuple(k_cache.shape)}")
    if hd > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {hd} is more than the kernels support ({MAX_HEAD_DIM})")
    return num_blocks, block_size, kvh, hd


def check_activation(name: str, t: torch.Tensor, layout: str, dims: dict[int, tuple[str, int]]) -> None:
    """`t` is 3-D `layout` with dims[i] = (what, size) fixed, a float dtype and stride(-1) == 1."""
    if t.dim() != 3:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    for i, (what, size) in dims.items():
        if t.shape[i] != size:
            raise ValueError(f"{name} {tuple(t.shape)} must be {layout}: its {what} is {t.shape[i]}, "
                             f"the cache's is {size}")
    if t.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{name} dtype {_dt(t)} is not supported: use float16, bfloat16 or float32")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1), got strides {t.stride()}")


def check_gqa(num_heads: int, num_kv_heads: int) -> int:
    """-> query heads per kv head."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads // num_kv_heads


def check_index(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int | None, ...],
                layout: str) -> None:
    """An index tensor: dtype in `dtypes`, shape matching (None = any), innermost stride 1."""
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be {want}, got {_dt(t)}")
    if t.dim() != len(shape) or any(w is not None and s != w for s, w in zip(t.shape, shape)):
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {n: t.device for n, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise ValueError("tensors are on different devices: "
                         + ", ".join(f"{n} on {d}" for n, d in devices.items()))
    return first


# The last index tensors whose values passed, per check kind: (weakref, _version) per tensor.
_passed: dict[tuple, tuple[tuple[weakref.ref, int], ...]] = {}


def _value_check_needed(key: tuple, tensors: tuple[torch.Tensor, ...]) -> bool:
    if tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    seen = _passed.get(key)
    return seen is None or any(ref() is not t or t._version != ver for (ref, ver), t in zip(seen, tensors))


def _remember(key: tuple, tensors: tuple[torch.Tensor, ...]) -> None:
    _passed[key] = tuple((weakref.ref(t), t._version) for t in tensors)


def check_slots(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Every slot is negative (skip) or inside the cache."""
    key = ("slots", num_blocks, block_size)
    if slot_mapping.numel() == 0 or not _value_check_needed(key, (slot_mapping,)):
        return
    n = num_blocks * block_size
    if int(slot_mapping.max()) >= n:
        i = int(torch.nonzero(slot_mapping >= n)[0])
        raise ValueError(f"slot_mapping[{i}] = {int(slot_mapping[i])} is outside the cache "
                         f"(num_blocks {num_blocks} x block_size {block_size} = {n} slots)")
    _remember(key, (slot_mapping,))


def check_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int,
                 cu_seqlens_q: torch.Tensor | None = None, num_tokens: int = 0) -> None:
    """Value checks of one call's index tensors (see the module docstring); one sync.

    Every block a sequence reads (the first ceil(context_len / block_size) of its row) is a
    block of the cache; context lengths are >= 0 and fit the table's width; for prefill,
    cu_seqlens_q rises from 0 to num_tokens and no chunk is longer than its context."""
    tensors = (block_tables, context_lens) + (() if cu_seqlens_q is None else (cu_seqlens_q,))
    key = ("tables", num_blocks, block_size, num_tokens, cu_seqlens_q is None)
    if context_lens.numel() == 0 or not _value_check_needed(key, tensors):
        return
    width = block_tables.shape[1]
    ctx = context_lens.long()
    used = torch.arange(width, device=ctx.device)[None, :] < ((ctx + block_size - 1) // block_size)[:, None]
    bad_block = used & ((block_tables < 0) | (block_tables >= num_blocks))
    flags = [(ctx < 0).any(), (ctx > width * block_size).any(), bad_block.any()]
    if cu_seqlens_q is not None:
        cu = cu_seqlens_q.long()
        q_lens = cu[1:] - cu[:-1]
        flags += [(cu[0] != 0) | (cu[-1] != num_tokens) | (q_lens < 0).any(), (q_lens > ctx).any()]
    flags = torch.stack(flags).tolist()                        # the one sync
    if not any(flags):
        _remember(key, tensors)
        return
    if flags[0]:
        i = int(torch.nonzero(ctx < 0)[0])
        raise ValueError(f"context_lens[{i}] = {int(ctx[i])} is negative")
    if flags[1]:
        i = int(torch.nonzero(ctx > width * block_size)[0])
        raise ValueError(f"context_lens[{i}] = {int(ctx[i])} does not fit block_tables: {width} columns "
                         f"x block_size {block_size} = {width * block_size} tokens")
    if flags[2]:
        s, j = (int(x) for x in torch.nonzero(bad_block)[0])
        raise ValueError(f"block_tables[{s}, {j}] = {int(block_tables[s, j])} is not a block of the cache "
                         f"(num_blocks = {num_blocks}); sequence {s} reads its first "
                         f"{-(-int(ctx[s]) // block_size)} blocks (context_lens[{s}] = {int(ctx[s])})")
    if flags[3]:
        raise ValueError(f"cu_seqlens_q must rise from 0 to q.shape[0] = {num_tokens}, "
                         f"got {cu_seqlens_q.tolist()}")
    i = int(torch.nonzero(q_lens > ctx)[0])
    raise ValueError(f"sequence {i} has {int(q_lens[i])} query tokens but context_lens[{i}] = {int(ctx[i])}: "
                     "a chunk's tokens are the last of its context, already stored in the cache")
