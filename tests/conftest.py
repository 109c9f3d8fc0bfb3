"""Shared fixtures: the real bundled models, loaded once per session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"
BGE_M3_DIR = FIXTURES / "tiny-bge-m3"

# Tests share two cores with nothing else; one intra-op pool sized to them.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TEXTS_EN_ZH_FR = [
    "The quick brown fox jumps over the lazy dog.",
    "How much protein should a female eat per day?",
    "Retrieval-augmented generation grounds a language model's answer in documents fetched from an index.",
    "Paris",
    "北京是中华人民共和国的首都。",
    "量子计算利用叠加和纠缠等量子力学现象来进行计算，有望在某些问题上远超经典计算机。",
    "我今天很开心",
    "La tour Eiffel est une tour de fer puddlé de 330 mètres de hauteur située à Paris.",
    "Où se trouve la gare la plus proche ?",
    "Le chat dort sur le canapé depuis ce matin.",
    "FAISS is a library for efficient similarity search and clustering of dense vectors. " * 6,
]


@pytest.fixture(scope="session")
def e5_dir() -> Path:
    from embedserve.models.registry import resolve_model
    return resolve_model("multilingual-e5-small")[1]


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    from embedserve.models.registry import resolve_model
    return resolve_model("all-MiniLM-L6-v2")[1]


@pytest.fixture(scope="session")
def e5_model(e5_dir):
    from embedserve.models.embedding_model import EmbeddingModel
    return EmbeddingModel(e5_dir, name="multilingual-e5-small", dtype="float32")


@pytest.fixture(scope="session")
def minilm_model(minilm_dir):
    from embedserve.models.embedding_model import EmbeddingModel
    return EmbeddingModel(minilm_dir, name="all-MiniLM-L6-v2", dtype="float32")


@pytest.fixture(scope="session")
def bgem3_model():
    from embedserve.models.embedding_model import EmbeddingModel
    return EmbeddingModel(BGE_M3_DIR, name="tiny-bge-m3", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from embedserve.models.registry import resolve_generate_model
    return resolve_generate_model("SmolLM2-135M-Instruct")[1]


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(our LlamaModel fp32, HF tokenizer) for the bundled SmolLM2."""
    from transformers import AutoTokenizer

    from embedserve.models.llama import LlamaModel
    return LlamaModel.from_dir(smollm2_dir), AutoTokenizer.from_pretrained(str(smollm2_dir))


def make_decode_engine(smollm2, **kw):
    """A DecodeEngine on the shared SmolLM2 weights (each engine has its own KV pool)."""
    from embedserve.config import DecodeConfig
    from embedserve.engine.decode_engine import DecodeEngine
    model, tok = smollm2
    cfg = dict(block_size=16, max_model_len=2048, max_num_batched_tokens=512,
               max_num_seqs=64, enable_prefix_caching=True, enable_chunked_prefill=True)
    cfg.update(kw)
    num_blocks = cfg.pop("num_blocks", 512)
    return DecodeEngine(model, tok, DecodeConfig(**cfg), num_blocks=num_blocks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, base: str, timeout: float, output, interval: float = 0.3) -> None:
    """Return once `base`/ready answers 200; RuntimeError with the server's `output()` if the
    process exits first or the deadline passes (the process is killed then)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + output())
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    proc.kill()
    raise RuntimeError("server never became ready:\n" + output())


@pytest.fixture(scope="session")
def server_index_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("server-indexes")


@pytest.fixture(scope="session")
def server(e5_dir, server_index_dir):
    """The real server on a free port with the default models (float32: tests compare with fp32
    references), shared by the SDK, client, compatibility and examples tests."""
    port = _free_port()
    env = dict(os.environ, EMBEDSERVE_THREADS="2")
    proc = subprocess.Popen([sys.executable, "-m", "embedserve.cli", "serve", "--port", str(port),
                             "--dtype", "float32", "--max-batch-tokens", "4096", "--log-level", "warning",
                             "--kv-cache-memory", "300000000", "--max-model-len", "2048",
                             "--index-dir", str(server_index_dir)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base, 180, lambda: proc.stdout.read() if proc.poll() is not None else "")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
