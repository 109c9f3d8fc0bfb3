"""The command line as a user runs it: plan without loading, refusals with the reason."""

import subprocess
import sys


def _run(*args):
    return subprocess.run([sys.executable, "-m", "embedserve.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_plan_prints_embed_and_kv_plans():
    r = _run("plan", "--max-model-len", "2048", "--kv-cache-memory", "100000000")
    assert r.returncode == 0, r.stderr
    assert "memory plan (float32): weights" in r.stdout and "headroom" in r.stdout
    assert "46080 bytes/token" in r.stdout                      # 2 × 30 layers × 3 kv heads × 64 × 4 B
    assert "KV cache blocks: 135 of 16 tokens = 2160 tokens" in r.stdout   # 1e8 // (16 × 46080)
    assert "Maximum concurrency for 2048 tokens per request: 1.05x" in r.stdout


def test_impossible_settings_are_refused_with_the_flag_to_change():
    r = _run("plan", "--model", "all-MiniLM-L6-v2", "--generate-model", "none", "--max-batch-tokens", "128")
    assert r.returncode == 2 and "--max-batch-tokens" in r.stderr and "512" in r.stderr
    r = _run("plan", "--generate-model", "none", "--kv-cache-dtype", "fp8")
    assert r.returncode == 0                                      # no decoder: nothing to refuse
    r = _run("plan", "--kv-cache-dtype", "fp8")
    assert r.returncode == 2 and "compute capability" in r.stderr
    r = _run("plan", "--kv-cache-memory", "1000")
    assert r.returncode == 2 and "--kv-cache-memory" in r.stderr
    r = _run("serve", "--model", "/nonexistent/model")
    assert r.returncode == 2 and "neither a bundled model" in r.stderr


def test_bench_help_belongs_to_the_benchmark():
    r = _run("bench", "--help")
    assert r.returncode == 0 and "--bf16-texts" in r.stdout
