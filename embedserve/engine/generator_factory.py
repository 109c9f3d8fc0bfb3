"""Build the generation side from a ServerConfig: resolve, plan, load, wire the engine."""

from __future__ import annotations

import logging

import torch

from kernels import check_kv_cache_dtype

from ..config import ServerConfig
from ..errors import ConfigError
from ..models.llama import LlamaModel
from ..models.registry import resolve_generate_model
from ..plan import KVCachePlan, decode_memory_plan
from .decode_engine import DecodeEngine, DecodeEngineConfig

logger = logging.getLogger(__name__)


def plan_generator(cfg: ServerConfig, embed_bytes: int = 0):
    """(name, path, plan) for the configured decoder, without loading weights."""
    try:
        check_kv_cache_dtype(cfg.kv_cache_dtype, torch.device(cfg.device))
    except ValueError as exc:
        raise ConfigError(f"--kv-cache-dtype: {exc}") from None
    name, path = resolve_generate_model(cfg.generate_model)
    return name, path, decode_memory_plan(path, cfg, embed_bytes)


def load_generator(cfg: ServerConfig, name: str, path, plan: KVCachePlan):
    """Load weights and tokenizer and build a (not yet started) DecodeEngine."""
    from transformers import AutoTokenizer

    from ..api.generate_routes import Generator

    dtype = torch.bfloat16 if plan.dtype == "bfloat16" else torch.float32
    model = LlamaModel.from_dir(path, dtype=dtype, device=cfg.device)
    kv_dtype = check_kv_cache_dtype(cfg.kv_cache_dtype, torch.device(cfg.device), dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    engine = DecodeEngine(model, tokenizer, DecodeEngineConfig(
        num_blocks=plan.num_blocks, block_size=cfg.block_size, max_model_len=plan.max_model_len,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
        enable_prefix_caching=cfg.enable_prefix_caching, enable_chunked_prefill=cfg.enable_chunked_prefill,
        kv_cache_dtype=kv_dtype))
    logger.info("generation model %s loaded (%s, %d KV blocks of %d tokens)", name, plan.dtype,
                plan.num_blocks, cfg.block_size)
    return Generator(name=name, engine=engine, tokenizer=tokenizer)
