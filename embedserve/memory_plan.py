"""The memory plan, computed from config files before any weight is loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ServerConfig
from .errors import ConfigError
from .models.embedding_model import fingerprint_dir
from .models.encoder import EncoderConfig, activation_bytes, model_weight_bytes
from .precision import decoder_precision, encoder_precision


@dataclass(slots=True)
class MemoryPlan:
    """Bytes the embed engine will need at its configured limits."""

    dtype: str
    weights: int
    activations: int
    available: int

    @property
    def total(self) -> int:
        return self.weights + self.activations

    @property
    def headroom(self) -> int:
        return self.available - self.total

    def lines(self) -> list[str]:
        gib = 1 << 30
        return [f"memory plan ({self.dtype}): weights {self.weights / gib:.2f} GiB + activation peak "
                f"{self.activations / gib:.2f} GiB = {self.total / gib:.2f} GiB; available "
                f"{self.available / gib:.2f} GiB; headroom {self.headroom / gib:.2f} GiB"]


def available_memory(device: str) -> int:
    """Free bytes: GPU memory on a GPU, MemAvailable from /proc/meminfo on the CPU."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def embed_memory_plan(model_dir: Path, config: ServerConfig) -> MemoryPlan:
    """Plan for `model_dir` under `config`; raises ConfigError when it cannot fit."""
    cfg = EncoderConfig.from_dir(model_dir)
    max_len = config.embed.input_limit(cfg.max_input_length)
    device = config.compute.device
    precision = encoder_precision(config.compute.dtype, device, fingerprint_dir(model_dir))
    bpe = 2 if precision.planning_dtype == "bfloat16" else 4
    plan = MemoryPlan(dtype=precision.describe(), weights=model_weight_bytes(model_dir, bpe),
                      activations=activation_bytes(cfg, config.embed.max_batch_tokens, max_len, bpe),
                      available=available_memory(device))
    if plan.headroom < 0:
        raise ConfigError("; ".join(plan.lines()) + " -- does not fit: lower --max-batch-tokens, "
                          "use --dtype bfloat16, or pick a smaller model")
    return plan


@dataclass(slots=True)
class KVCachePlan:
    """The decode model's memory: weights, a paged KV pool, activations at the step budget."""

    dtype: str
    weights: int
    kv_budget: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    activations: int
    max_model_len: int
    kv_dtype: str = ""

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        return self.kv_tokens / self.max_model_len

    def lines(self) -> list[str]:
        gib = 1 << 30
        return [f"decode plan ({self.dtype}): weights {self.weights / gib:.2f} GiB, activations "
                f"{self.activations / gib:.2f} GiB, KV cache {self.num_blocks * self.block_size * self.kv_bytes_per_token / gib:.2f} GiB "
                f"({self.kv_dtype + ', ' if self.kv_dtype else ''}{self.kv_bytes_per_token} bytes/token)",
                f"KV cache blocks: {self.num_blocks} of {self.block_size} tokens = {self.kv_tokens} tokens",
                f"Maximum concurrency for {self.max_model_len} tokens per request: {self.max_concurrency:.2f}x"]


def decode_memory_plan(model_dir: Path, config: ServerConfig, embed_bytes: int = 0) -> KVCachePlan:
    """Blocks = KV budget / (block_size × 2 × layers × kv_heads × head_dim × bytes per element)."""
    from .models.llama import LlamaConfig

    cfg = LlamaConfig.from_dir(model_dir)
    dc, device = config.decode, config.compute.device
    dtype = decoder_precision(config.compute.dtype, device)
    bpe = 2 if dtype == "bfloat16" else 4
    kv_dtype = dc.kv_cache_dtype
    if kv_dtype == "auto":                  # what the engine will pick (kernels.check_kv_cache_dtype)
        import torch

        from kernels import check_kv_cache_dtype
        kv_dtype = str(check_kv_cache_dtype("auto", torch.device(device), getattr(torch, dtype))).removeprefix("torch.")
    kv_bpe = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}[kv_dtype]
    max_len = dc.max_model_len or min(cfg.max_position_embeddings, 8192)
    if max_len > cfg.max_position_embeddings:
        raise ConfigError(f"--max-model-len {max_len} exceeds the model's {cfg.max_position_embeddings} positions")
    dc.check_model_len(max_len)
    weights = model_weight_bytes(model_dir, bpe)
    T = dc.max_num_batched_tokens
    activations = T * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * 4 + dc.max_num_seqs * cfg.vocab_size * 4 * 2
    available = available_memory(device)
    free = available - embed_bytes - weights - activations
    if dc.kv_cache_memory:
        budget = dc.kv_cache_memory
    elif dc.memory_utilization:
        budget = int(available * dc.memory_utilization) - weights - activations
    else:
        budget = min(2 << 30, int(0.1 * available))
    per_token = cfg.kv_bytes_per_token(kv_bpe)
    blocks = max(0, budget) // (dc.block_size * per_token)
    plan = KVCachePlan(dtype=dtype, weights=weights, kv_budget=budget, kv_bytes_per_token=per_token,
                       block_size=dc.block_size, num_blocks=int(blocks), activations=activations,
                       max_model_len=max_len, kv_dtype=kv_dtype)
    if budget > free:
        raise ConfigError(f"the KV cache budget {budget / (1 << 30):.2f} GiB exceeds free memory "
                          f"{max(free, 0) / (1 << 30):.2f} GiB after weights and activations; lower "
                          "--kv-cache-memory or --memory-utilization")
    if plan.kv_tokens < max_len:
        raise ConfigError(f"the KV cache holds {plan.kv_tokens} tokens, fewer than one request of "
                          f"--max-model-len {max_len}; raise --kv-cache-memory or lower --max-model-len")
    return plan
