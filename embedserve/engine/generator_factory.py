"""Build the generation side from a ServerConfig: resolve, plan, load, wire the engine."""

from __future__ import annotations

import logging

import torch

from ..config import ServerConfig
from ..errors import ConfigError
from ..models.llama import LlamaModel
from ..models.registry import resolve_generate_model
from ..plan import KVCachePlan, decode_memory_plan
from .decode_engine import DecodeEngine, DecodeEngineConfig

logger = logging.getLogger(__name__)


def check_kv_cache_dtype(kv_cache_dtype: str, device: str) -> None:
    """fp8 KV needs a GPU of compute capability >= 8.9 (as vLLM requires); refuse elsewhere."""
    if kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16", "fp8"):
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype!r}: choose auto, float32, bfloat16, float16 or fp8")
    if kv_cache_dtype == "fp8":
        if not (device.startswith("cuda") and torch.cuda.is_available()):
            raise ConfigError("--kv-cache-dtype fp8 needs a CUDA GPU with compute capability >= 8.9; "
                              "this server runs on the CPU")
        if torch.cuda.get_device_capability() < (8, 9):
            raise ConfigError("--kv-cache-dtype fp8 needs compute capability >= 8.9; this GPU has "
                              f"{torch.cuda.get_device_capability()}")
        raise ConfigError("--kv-cache-dtype fp8 is not wired into the decode engine yet; use auto")


def plan_generator(cfg: ServerConfig, embed_bytes: int = 0):
    """(name, path, plan) for the configured decoder, without loading weights."""
    check_kv_cache_dtype(cfg.kv_cache_dtype, cfg.device)
    name, path = resolve_generate_model(cfg.generate_model)
    return name, path, decode_memory_plan(path, cfg, embed_bytes)


def load_generator(cfg: ServerConfig, name: str, path, plan: KVCachePlan):
    """Load weights and tokenizer and build a (not yet started) DecodeEngine."""
    from transformers import AutoTokenizer

    from ..api.generate_routes import Generator

    dtype = torch.bfloat16 if plan.dtype == "bfloat16" else torch.float32
    model = LlamaModel.from_dir(path, dtype=dtype, device=cfg.device)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    engine = DecodeEngine(model, tokenizer, DecodeEngineConfig(
        num_blocks=plan.num_blocks, block_size=cfg.block_size, max_model_len=plan.max_model_len,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
        enable_prefix_caching=cfg.enable_prefix_caching, enable_chunked_prefill=cfg.enable_chunked_prefill))
    logger.info("generation model %s loaded (%s, %d KV blocks of %d tokens)", name, plan.dtype,
                plan.num_blocks, cfg.block_size)
    return Generator(name=name, engine=engine, tokenizer=tokenizer)
