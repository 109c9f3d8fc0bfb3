"""Triton kernels for the paged KV cache (`triton_attention`, `store_kv`), each beside the plain-torch
reference that defines it (`reference`); `attention_backend()` picks one. The cache layout is
drawn in `reference.py`."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from . import compute

if TYPE_CHECKING:                    # torch is imported where it is used: `kernels.compute` (the
    import torch                     # compute-path switches every CLI command reads) stays light

logger = logging.getLogger(__name__)

BACKENDS = ("triton", "reference")


@dataclass(frozen=True)
class AttentionBackend:
    """The three paged-KV functions of one implementation (signatures in kernels/reference.py)."""

    name: str
    store_kv: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]


def attention_backend(name: str | None = None) -> AttentionBackend:
    """The Triton kernels when a CUDA GPU is there, the torch reference otherwise.

    `name` ("triton", "reference" or "auto"), else the `attention_backend` compute path
    (`kernels.compute`: --attention-backend, EMBEDSERVE_ATTENTION_BACKEND), overrides the choice. "triton" without a GPU runs the kernels
    in Triton's interpreter, which needs TRITON_INTERPRET=1 set before triton is first
    imported (tests do this); triton is imported only when this backend is chosen."""
    import torch

    chosen = (name or compute.current().attention_backend).strip().lower()
    if chosen == "auto":
        chosen = "triton" if torch.cuda.is_available() else "reference"
    if chosen not in BACKENDS:
        source = "argument" if name else "--attention-backend"
        raise ValueError(f"unknown attention backend {chosen!r} (from the {source}): "
                         f"choose one of {', '.join(BACKENDS)} or auto")
    return _load(chosen)


@functools.cache
def _load(name: str) -> AttentionBackend:
    """Import a backend once (the engine asks on every layer of every step)."""
    import torch

    if name == "reference":
        from . import reference as impl
        store = impl.store_kv
    else:
        from . import triton_attention as impl
        from .store_kv import store_kv as store
        if not torch.cuda.is_available():
            logger.warning("triton attention backend without a CUDA GPU: the kernels run in Triton's "
                           "interpreter (TRITON_INTERPRET=1), for tests only")
    logger.info("attention backend: %s", name)
    return AttentionBackend(name, store, impl.paged_decode_attention, impl.paged_prefill_attention)


_KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", "fp8")       # fp8: torch.float8_e4m3fn


def _cpu_kernels_run() -> bool:
    """Whether the C decode kernels run here (they read a float16 cache under float32 activations;
    the torch path would widen the whole gathered cache every step)."""
    from . import cpu_attention
    return cpu_attention.available() is None


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device,
                         model_dtype: torch.dtype | None = None) -> torch.dtype:
    """The torch dtype of the KV cache for the `--kv-cache-dtype` setting, or ValueError why not.

    "auto" is the model's dtype when given, except a float32 decoder on a CPU where the C kernels
    run: float16 there (as llama.cpp keeps it), read by the decode kernel at half the bytes (a
    single stream at 2,000 tokens of context, int8 weights, 2 AVX2 cores: 1.18-1.48x the decode
    tokens/s over a float32 cache, BENCHMARKS.md) and twice the tokens in the same memory; K/V
    rounded once to 11 significant bits (SmolLM2: greedy output equal to float32's on
    tests/test_generate_equivalence.py's 20 prompts, held-out perplexity +0.004 %). Without a
    model dtype: bfloat16 on a GPU that has it (compute capability >= 8.0), float16 on an older
    GPU, float32 on a CPU. "fp8" is e4m3
    (torch.float8_e4m3fn) with a per-tensor scale of 1.0: K/V are cast as they are, which
    keeps them within e4m3's range (|x| <= 448) for the models this serves, at ~2 significant
    digits; it needs compute capability >= 8.9 (Ada, Hopper and later), the first with fp8
    conversion instructions, as vLLM requires."""
    import torch

    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    where = f"{device} has compute capability {capability[0]}.{capability[1]}" if capability else f"device is {device}"
    if kv_cache_dtype == "auto":
        if model_dtype == torch.float32 and device.type == "cpu" and _cpu_kernels_run():
            return torch.float16
        if model_dtype is not None:
            return model_dtype
        if capability is None:
            return torch.float32
        return torch.bfloat16 if capability >= (8, 0) else torch.float16
    if kv_cache_dtype not in _KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of auto, {', '.join(_KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "fp8" and (capability is None or capability < (8, 9)):
        raise ValueError(f"kv_cache_dtype fp8 needs a CUDA GPU with compute capability >= 8.9 "
                         f"(Ada/Hopper or later); the {where}")
    if kv_cache_dtype == "bfloat16" and capability is not None and capability < (8, 0):
        raise ValueError(f"kv_cache_dtype bfloat16 needs compute capability >= 8.0 on a GPU; the {where}")
    return torch.float8_e4m3fn if kv_cache_dtype == "fp8" else getattr(torch, kv_cache_dtype)
