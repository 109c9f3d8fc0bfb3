"""The systems `make bench` runs side by side: each server started in a subprocess (ours, and the
peers from their venvs under .bench-peers/), driven by the load generator, and what every part of
the comparison shares (the models, the best precision here, medians, the log)."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from embedserve.bench import load

ROOT = Path(__file__).resolve().parents[3]
PEERS = ROOT / ".bench-peers"
RESULTS = Path(__file__).resolve().parents[1] / "results"
GEN_MODEL = "SmolLM2-135M-Instruct"
EMBED_MODELS = ("all-MiniLM-L6-v2", "multilingual-e5-small")
# the words the generation prompts are drawn from (the served shapes and the single stream)
GEN_WORDS = ("the system retrieves passages from an index and the model answers questions about history "
             "science cities rivers music and software engineering with short sentences").split()
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_TARGET_DEVICE": "cpu"}


def peer_precision() -> str:
    """The peers' best precision here (and the decoder's on every side): bf16 only where the
    CPU multiplies it fast; on an AVX2-only CPU torch emulates it at a fraction of fp32's speed."""
    from embedserve.precision import fast_bf16_available
    return "bfloat16" if fast_bf16_available("cpu") else "float32"


def best_of(runs: dict) -> dict:
    """A system's results in its best precision: the `best (...)` entry, else float32 (the best
    precision is fp32 itself, run once)."""
    return next((v for k, v in runs.items() if k.startswith("best")), runs.get("float32"))


def best_dtype(runs: dict) -> str:
    return next((k.split("(")[1].rstrip(")") for k in runs if k.startswith("best")), "float32")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(name: str, cmd: list[str], port: int, ready: str, env: dict | None = None, timeout: float = 400,
           cwd: Path | None = None):
    """A server subprocess, yielded once `ready` answers 200; its log in a temp file."""
    logf = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while True:
            if proc.poll() is not None:
                logf.seek(0)
                raise RuntimeError(f"{name} exited during start-up:\n{logf.read()[-3000:]}")
            try:
                if httpx.get(base + ready, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > timeout:
                raise RuntimeError(f"{name} not ready in {timeout:.0f} s")
            time.sleep(0.5)
        log(f"{name} ready in {time.time() - t0:.0f} s")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ours(model: str, dtype: str, generate: str = "none", extra: tuple = (), cwd: Path | None = None):
    """Our server (`python -m embedserve.cli`, so the package of `cwd` where given: another tree's)."""
    port = _port()
    cmd = [sys.executable, "-m", "embedserve.cli", "serve", "--model", model, "--dtype", dtype, "--port", str(port),
           "--generate-model", generate, "--max-concurrent-requests", "4096", "--max-queued-tokens", "4000000",
           "--log-level", "warning", *extra]
    return served(f"embedserve-{dtype}", cmd, port, "/ready", cwd=cwd)


def infinity(model_dir: Path, name: str, dtype: str):
    exe = PEERS / "infinity" / "bin" / "infinity_emb"
    port = _port()
    cmd = [str(exe), "v2", "--model-id", str(model_dir), "--served-model-name", name, "--engine", "torch",
           "--device", "cpu", "--no-bettertransformer", "--dtype", dtype, "--port", str(port), "--url-prefix", "/v1"]
    return served(f"infinity-{dtype}", cmd, port, "/v1/models")


def vllm(model_dir: Path, dtype: str, extra: tuple = ()):
    port = _port()
    cmd = [str(PEERS / "vllm" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", GEN_MODEL, "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
           "--max-model-len", "2048", "--max-num-seqs", "64", *extra]
    return served(f"vllm-{dtype}", cmd, port, "/v1/models", env=VLLM_ENV, timeout=600)


def peer_missing(name: str) -> str | None:
    exe = {"infinity": PEERS / "infinity" / "bin" / "infinity_emb", "vllm": PEERS / "vllm" / "bin" / "python",
           "llamacpp": PEERS / "llamacpp" / "bin" / "python"}[name]
    ok = exe.parent.parent / ".ok"                  # the venv is whole only once its target finished
    if not exe.exists() or (name == "llamacpp" and not ok.exists()):
        return f"not installed ({ok if exe.exists() else exe} missing; `make bench-peers` builds it)"
    return None


def drive(kind: str, base: str, model: str, dataset: Path, *flags: str) -> list[dict]:
    """One `embedserve bench` invocation; its runs."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    argv = [kind, "--base-url", base, "--model", model, "--dataset", "jsonl", "--dataset-path", str(dataset),
            "--out", out, *flags]
    if load.main(argv) != 0:
        raise RuntimeError(f"embedserve bench {' '.join(argv)} failed")
    return json.loads(Path(out).read_text())["runs"]


def med(values: list[float]) -> float:
    return float(statistics.median(values))

def write_jsonl(rows: list[dict], path: Path) -> Path:
    """`rows` as a JSONL file at `path` (the load generator's --dataset jsonl); returns `path`."""
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path
