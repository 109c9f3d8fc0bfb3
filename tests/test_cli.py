"""The command line as a user runs it: plan without loading, refusals with the reason."""

import os
import subprocess
import sys

import httpx
import pytest

from helpers import spawn_server


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "embedserve.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.model
def test_plan_prints_embed_and_kv_plans():
    r = _run("plan", "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory", "100000000",
             "--kv-cache-dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "memory plan (float32): weights" in r.stdout and "headroom" in r.stdout
    assert "(float32, 46080 bytes/token)" in r.stdout            # 2 × 30 layers × 3 kv heads × 64 × 4 B
    assert "KV cache blocks: 135 of 16 tokens = 2160 tokens" in r.stdout   # 1e8 // (16 × 46080)
    assert "Maximum concurrency for 2048 tokens per request: 1.05x" in r.stdout
    # auto under a float32 decoder on a CPU where the C kernels run: a float16 cache, twice the tokens
    r = _run("plan", "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory", "100000000")
    assert r.returncode == 0, r.stderr
    assert "(float16, 23040 bytes/token)" in r.stdout
    assert "KV cache blocks: 271 of 16 tokens = 4336 tokens" in r.stdout   # 1e8 // (16 × 23040)


@pytest.mark.model
@pytest.mark.server
def test_impossible_settings_are_refused_with_the_flag_to_change():
    r = _run("plan", "--model", "all-MiniLM-L6-v2", "--generate-model", "none", "--max-batch-tokens", "128")
    assert r.returncode == 2 and "--max-batch-tokens" in r.stderr and "512" in r.stderr
    r = _run("plan", "--generate-model", "none", "--kv-cache-dtype", "fp8")
    assert r.returncode == 0                                      # no decoder: nothing to refuse
    r = _run("plan", "--kv-cache-dtype", "fp8")
    assert r.returncode == 2 and "compute capability" in r.stderr
    r = _run("plan", "--kv-cache-memory", "1000")
    assert r.returncode == 2 and "--kv-cache-memory" in r.stderr
    srv = spawn_server("--model", "/nonexistent/model", ready=False)
    assert srv.proc.wait(120) == 2 and "neither a bundled model" in srv.output()


def test_bench_help_belongs_to_the_benchmark():
    """`bench --help` lists the two load generators and says where `make bench`'s study is; each
    one's --help is its own flags (argparse's, not the top-level parser's); `bench` alone, an
    unknown name or the study's old name (`compare`) is refused with the list."""
    r = _run("bench", "--help")
    assert r.returncode == 0 and all(w in r.stdout for w in ("embed", "generate", "embedserve.studies.compare"))
    r = _run("bench", "embed", "--help")
    assert r.returncode == 0 and "--request-rate" in r.stdout and "--max-concurrency" in r.stdout
    r = subprocess.run([sys.executable, "-m", "embedserve.studies.compare", "--help"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "infinity" in r.stdout
    for argv in (("bench",), ("bench", "serve"), ("bench", "compare")):
        r = _run(*argv)
        assert r.returncode == 2 and "choose `embed`" in r.stderr and "make bench" in r.stderr


@pytest.mark.server
def test_plan_names_the_dtype_serve_loads(tmp_path, minilm_dir, monkeypatch):
    """Before the probe has run, plan says so; once its outcome is cached, plan and a real
    server agree on the precision (read back from /v1/models)."""
    from embedserve import precision
    from embedserve.models.embedding_model import fingerprint_dir
    from kernels import compute

    monkeypatch.setenv("EMBEDSERVE_HOME", str(tmp_path))
    monkeypatch.setenv("EMBEDSERVE_FAST_BF16", "1")              # the plans and servers this starts read it,
    monkeypatch.setattr(compute, "_current", compute.ComputePaths(fast_bf16="1"))  # and so does this process
    env = dict(os.environ)
    args = ("--model", "all-MiniLM-L6-v2", "--generate-model", "none", "--dtype", "auto")
    r = _run("plan", *args, env=env)
    assert r.returncode == 0 and "whichever passes its accuracy probe" in r.stdout, r.stdout + r.stderr
    # the outcome a probe on this machine would store (bf16 passing and fastest)
    precision.store_probe(fingerprint_dir(minilm_dir), "cpu", precision.ProbeResult(
        min_cosine={"bfloat16": 0.9999, "int8": 0.996},
        tokens_per_s={"float32": 1000.0, "bfloat16": 3000.0, "int8": 3100.0}))
    r = _run("plan", *args, env=env)
    assert r.returncode == 0 and "memory plan (bfloat16)" in r.stdout, r.stdout + r.stderr
    with spawn_server(*args, "--log-level", "warning", timeout=120) as srv:
        models = httpx.get(f"{srv.base}/v1/models", timeout=10).json()["data"]
        assert models and models[0]["dtype"] == "bfloat16", models


@pytest.mark.model
def test_environment_fallbacks_yield_to_flags_and_bad_values_name_the_variable():
    """EMBEDSERVE_<NAME> sets a default, the flag overrides it; a value that does not convert is
    refused at start-up naming the variable (never a traceback, never a silent default)."""
    env = dict(os.environ, EMBEDSERVE_MAX_MODEL_LEN="1024", EMBEDSERVE_KV_CACHE_MEMORY="100000000",
               EMBEDSERVE_DTYPE="float32", EMBEDSERVE_KV_CACHE_DTYPE="float32")
    r = _run("plan", env=env)
    assert r.returncode == 0, r.stderr
    assert "Maximum concurrency for 1024 tokens per request: 2.11x" in r.stdout     # 2160 / 1024
    assert "memory plan (float32)" in r.stdout
    r = _run("plan", "--max-model-len", "2048", env=env)
    assert r.returncode == 0 and "Maximum concurrency for 2048 tokens per request: 1.05x" in r.stdout
    for var, value, needle in (("EMBEDSERVE_MAX_MODEL_LEN", "lots", "not a whole number"),
                               ("EMBEDSERVE_SHUTDOWN_TIMEOUT", "30s", "not a number"),
                               ("EMBEDSERVE_ENABLE_PREFIX_CACHING", "flase", "not a boolean")):
        r = _run("plan", env=dict(env, **{var: value}))
        assert r.returncode == 2 and f"{var}={value!r}" in r.stderr and needle in r.stderr, r.stderr
        assert "Traceback" not in r.stderr



def test_boolean_environment_values(monkeypatch):
    from embedserve.cli import build_parser
    for raw, want in (("off", False), ("0", False), ("No", False), ("on", True), ("TRUE", True), ("1", True)):
        monkeypatch.setenv("EMBEDSERVE_ENABLE_PREFIX_CACHING", raw)
        assert build_parser().parse_args(["serve"]).enable_prefix_caching is want, raw
    assert build_parser().parse_args(["serve", "--no-enable-prefix-caching"]).enable_prefix_caching is False


@pytest.mark.model
def test_generate_model_none_as_a_flag_plans_no_decoder():
    r = _run("plan", "--dtype", "float32", "--generate-model", "none")
    assert r.returncode == 0, r.stderr
    assert "memory plan (float32)" in r.stdout and "KV cache" not in r.stdout, r.stdout


def test_plan_names_the_index_backend_without_its_password(tmp_path):
    r = _run("plan", "--dtype", "float32", "--generate-model", "none", "--index-dir", str(tmp_path / "ix"))
    assert r.returncode == 0 and f"index backend: local ({tmp_path / 'ix'})" in r.stdout, r.stdout + r.stderr
    # the database need not be up to plan (or to start: index requests are 503 until it is)
    r = _run("plan", "--dtype", "float32", "--generate-model", "none",
             "--index-url", "postgresql://app:s3cret@db.internal:5432/rag", "--index-schema", "rag_prod")
    assert r.returncode == 0, r.stderr
    assert "index backend: postgres (postgresql://app:***@db.internal:5432/rag, schema rag_prod" in r.stdout
    assert "s3cret" not in r.stdout + r.stderr
    for bad, says in ((("--index-url", "mysql://x/y"), "PostgreSQL URL"),
                      (("--index-url", "postgresql://h/d", "--index-schema", "Bad-Name"), "--index-schema")):
        r = _run("plan", "--generate-model", "none", *bad)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_commands_that_need_no_model_answer_without_importing_torch(tmp_path):
    """`index list|history`, `reindex` of an index that is not there and a bad `serve` flag read
    files and settings only: they answer without importing torch (~1.5-3 s a command)."""
    probe = ("import sys\nfrom embedserve.cli import main\nrc = main(sys.argv[1:])\n"
             "print('torch' in sys.modules, rc)\n")
    ix = str(tmp_path / "ix")
    for argv, rc in ((["index", "list", "--index-dir", ix], 0),
                     (["reindex", "--index", "nope", "--to-model", "multilingual-e5-small", "--index-dir", ix], 1),
                     (["serve", "--max-batch-tokens", "-5"], 2)):
        r = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120)
        assert r.stdout.split()[-2:] == ["False", str(rc)], (argv, r.stdout, r.stderr)


@pytest.mark.parametrize("level", ["info", "debug"])
def test_the_faiss_loaders_info_lines_are_quiet_below_debug(level):
    # faiss-cpu's loader logs "Could not load library with AVX2 support ... No module named
    # 'faiss.swigfaiss_avx2'" at INFO on every start where its wheel ships one library; serve and
    # reindex show it only at --log-level debug
    code = f"from embedserve.cli.logs import setup_logging; setup_logging({level!r}); import faiss"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if "faiss.loader" in x]
    if level == "debug":
        assert lines, r.stderr           # the loader does log, and this test would see it
    else:
        assert lines == [], lines
