"""The memory plan, computed from config files before any weight is loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ServerConfig
from .errors import ConfigError
from .models.embedding_model import fast_bf16_available
from .models.encoder import EncoderConfig, activation_bytes, model_weight_bytes


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


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype in ("float32", "fp32"):
        return "float32"
    if dtype in ("bfloat16", "bf16"):
        return "bfloat16"
    return "bfloat16" if fast_bf16_available(torch.device(device)) else "float32"


def embed_memory_plan(model_dir: Path, config: ServerConfig) -> MemoryPlan:
    """Plan for `model_dir` under `config`; raises ConfigError when it cannot fit."""
    cfg = EncoderConfig.from_dir(model_dir)
    max_len = config.check_model_limits(cfg.max_input_length)
    dtype = resolve_dtype(config.dtype, config.device)
    bpe = 2 if dtype == "bfloat16" else 4
    plan = MemoryPlan(dtype=dtype, weights=model_weight_bytes(model_dir, bpe),
                      activations=activation_bytes(cfg, config.max_batch_tokens, max_len, bpe),
                      available=available_memory(config.device))
    if plan.headroom < 0:
        raise ConfigError("; ".join(plan.lines()) + " -- does not fit: lower --max-batch-tokens, "
                          "use --dtype bfloat16, or pick a smaller model")
    return plan
