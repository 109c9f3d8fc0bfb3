"""The wiring: build the engines a `ServerConfig` asks for, attach them to the app's state,
and run the server. It sits above both the HTTP layer (`api/`) and the engines (`engine/`),
which know nothing of each other's construction."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import uvicorn
from fastapi import FastAPI

from kernels import check_kv_cache_dtype

from .api.app import create_app
from .api.state import AppState
from .config import ServerConfig
from .engine.decode_engine import DecodeEngine
from .engine.embed_engine import EmbedEngine
from .engine.generator import Generator
from .errors import ConfigError
from .memory_plan import KVCachePlan, decode_memory_plan
from .models.embedding_model import EmbeddingModel
from .models.llama import LlamaModel
from .models.registry import resolve_generate_model

logger = logging.getLogger(__name__)


def build_embed_engine(cfg: ServerConfig, model: EmbeddingModel, metrics=None) -> EmbedEngine:
    """Check the model against the limits, warm it up, and start its engine thread."""
    engine = EmbedEngine(model, cfg.embed, metrics)
    # a short and a long (cut to the limit, as requests are) input: every model, even a tiny one
    if model.spec.task == "rerank":
        pairs = model.pairs("warm-up", ["warm-up", "预热 " * 64], engine.max_input_length)
        model.embed(pairs.inputs, {"score"}, pairs.segments)
    else:
        warm = [model.truncate(ids, engine.max_input_length) for ids in model.tokenize(["warm-up", "预热 " * 64])]
        model.embed(warm, model.spec.embedding_types)
    engine.stall_after = cfg.http.stall_timeout
    engine.start()
    return engine


def attach_embedders(state: AppState, models: EmbeddingModel | list[EmbeddingModel]) -> None:
    """Start one embedding engine per model (they take turns on the cores: one compute lock)
    and mark the server ready."""
    for model in (models if isinstance(models, list) else [models]):
        engine = build_embed_engine(state.config, model, state.metrics)
        name = state.add_embedder(engine)
        what = "reranker" if model.spec.task == "rerank" else f"dim {model.spec.dim}"
        logger.info("model %s ready (%s, %s, max input %d tokens)", name, model.spec.dtype, what,
                    engine.max_input_length)
    state.ready = True


def attach_generator(state: AppState, gen: Generator) -> None:
    gen.engine.stall_after = state.config.http.stall_timeout
    gen.start(state.metrics)
    state.generator = gen


def build_app(config: ServerConfig, model: EmbeddingModel | list[EmbeddingModel] | None = None,
              loader: Callable[[], EmbeddingModel | list[EmbeddingModel]] | None = None,
              on_load_error: Callable[[BaseException], None] | None = None,
              generator: Generator | None = None, gen_loader: Callable[[], Generator] | None = None) -> FastAPI:
    """The server app. Pass a loaded `model` (and `generator`), or loaders run on a thread at
    start-up (the server answers /health at once; /ready turns 200 once all models are warm)."""

    def load(state: AppState) -> None:
        try:                            # a server told to stop meanwhile starts no engine
            if gen_loader is not None:
                gen = gen_loader()
                if state.draining:
                    return
                attach_generator(state, gen)
            models = loader()
            if not state.draining:
                attach_embedders(state, models)
        except BaseException as exc:  # reported through /ready and the callback
            logger.exception("model failed to load")
            state.load_error = f"{type(exc).__name__}: {exc}"
            if on_load_error:
                on_load_error(exc)

    def start(state: AppState) -> None:
        if generator is not None:
            attach_generator(state, generator)
        if model is not None:
            attach_embedders(state, model)
        elif loader is not None:
            state.loader = threading.Thread(target=load, args=(state,), name="model-loader", daemon=True)
            state.loader.start()

    return create_app(AppState(config=config), start)


def plan_generator(cfg: ServerConfig, embed_bytes: int = 0) -> tuple[str, Path, KVCachePlan]:
    """(name, path, plan) for the configured decoder, without loading weights."""
    try:
        check_kv_cache_dtype(cfg.decode.kv_cache_dtype, torch.device(cfg.compute.device))
    except ValueError as exc:
        raise ConfigError(f"--kv-cache-dtype: {exc}") from None
    name, path = resolve_generate_model(cfg.decode.generate_model)
    return name, path, decode_memory_plan(path, cfg, embed_bytes)


def load_generator(cfg: ServerConfig, name: str, path: Path, plan: KVCachePlan) -> Generator:
    """Load weights and tokenizer and build a (not yet started) decoder."""
    from transformers import AutoTokenizer

    dtype = torch.bfloat16 if plan.dtype == "bfloat16" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model, gate = load_decoder(path, dtype, cfg.compute.device, cfg.decode.decode_weights, tokenizer)
    # the section with the plan's model length (the model's own where no --max-model-len was given)
    engine = DecodeEngine(model, tokenizer, replace(cfg.decode, max_model_len=plan.max_model_len),
                          num_blocks=plan.num_blocks)
    logger.info("generation model %s loaded (%s, %s linear weights, %d KV blocks of %d tokens)", name, plan.dtype,
                model.linear_weights, plan.num_blocks, cfg.decode.block_size)
    return Generator(name=name, engine=engine, tokenizer=tokenizer, gate=gate)


def load_decoder(path: Path, dtype: torch.dtype, device: str, decode_weights: str, tokenizer):
    """(the LlamaModel, the int8 gate's report or None) for `--decode-weights`: native and int8 as
    asked (int8 where it cannot run is a ConfigError); auto: int8 where it runs here, the decoder's
    activations are float32 (where a decode step takes the one-call C path, measured faster; a
    bfloat16 decoder keeps its native weights under auto: with bf16 activations int8 is 2.5x
    faster at one sequence but 0.80x at 16 and 0.65x at 64 served, on a 2-core Zen 4, BENCHMARKS.md)
    and the model passes the gate (its report cached per model), else native."""
    from dataclasses import asdict

    from .models import int8_gate
    from .models.decode_int8 import int8_available
    from .models.llama import LlamaConfig, load_weights
    from .models.model_dir import fingerprint_dir
    from .paths import cache_dir

    why = int8_available(torch.device(device).type)
    if decode_weights == "int8" and why is not None:
        raise ConfigError(f"--decode-weights int8: {why}; use --decode-weights native")
    if decode_weights == "native" or (decode_weights == "auto" and (why is not None or dtype != torch.float32)):
        return LlamaModel.from_dir(path, dtype=dtype, device=device), None
    cfg, weights = LlamaConfig.from_dir(path), load_weights(path)
    int8 = LlamaModel(cfg, weights, dtype, device, linear_weights="int8")
    if decode_weights == "int8":
        return int8, None
    report = int8_gate.cached_gate(int8_gate.gate_path(cache_dir(), fingerprint_dir(path), dtype),
                                   lambda: LlamaModel(cfg, weights, dtype, device), int8, tokenizer)
    logger.info("decode weights auto: int8 gate %s (%s): %d/%d greedy continuations equal, %d part at near-ties "
                "(worst native gap %.3f), held-out perplexity %.3f vs %.3f native (x%.4f)",
                "passed" if report.passed else "failed", report.reason, report.equal, report.prompts, report.ties,
                report.worst_gap, report.ppl_int8, report.ppl_native, report.ppl_ratio)
    if report.passed:
        return int8, asdict(report)
    del int8
    return LlamaModel(cfg, weights, dtype, device), asdict(report)


class DrainingServer(uvicorn.Server):
    """uvicorn, stopping gracefully: the first SIGTERM (or Ctrl-C) turns the app to draining —
    `/ready` 503 at once, new requests 503 — lets the requests in flight finish for up to
    `timeout` seconds, then exits (engines stopped, indexes snapshotted) with status 0. A second
    signal stops at once."""

    def __init__(self, config: uvicorn.Config, state: AppState, timeout: float):
        super().__init__(config)
        self.state, self.timeout = state, timeout

    def handle_exit(self, sig, frame) -> None:
        if self.state.draining:                        # a second signal: stop now
            return super().handle_exit(sig, frame)
        self.state.draining = True
        logger.info("signal %d: draining %d requests in flight (up to %g s; new requests get 503)",
                    sig, self.state.inflight, self.timeout)
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.state.inflight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.state.inflight > 0:
            logger.warning("--shutdown-timeout reached: %d requests still in flight are cut off", self.state.inflight)
        self.should_exit = True
