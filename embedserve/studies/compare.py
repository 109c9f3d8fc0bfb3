"""`make bench`: embedserve side by side with the servers a user would pick instead, on this
machine, in one run, written to embedserve/studies/results/compare.{json,md} and BENCHMARKS.md.

Every served system is driven by the same load generator (`embedserve bench embed|generate`,
OpenAI-compatible HTTP only) with the same texts, model directory, precision and concurrency;
the offline peers (sentence-transformers `encode`, Hugging Face `generate` in static batches as
wide as the served runs' concurrency) run in this process on the same inputs. Medians of
`--runs` runs (default 3). Peers live in their own venvs under .bench-peers/ (the Makefile
builds them once); a peer that is not installed is reported as such, never estimated.

  embeddings  all-MiniLM-L6-v2 and multilingual-e5-small: embedserve, infinity-emb and
              sentence-transformers, each in fp32 and in its best precision here (ours: what
              `--dtype auto` picks; the peers: bf16 where the CPU has fast bf16, else fp32, run
              once); 1 text per request at 8 and 32 concurrent clients, 32 texts per request at
              8; a Poisson sweep to saturation for the best precisions
  generation  SmolLM2-135M-Instruct in the decoder's best precision on this machine (bf16 where
              the CPU has fast bf16, else fp32) on every side: embedserve vs vLLM (CPU) vs HF
              static batching at 1, 16 and 64 concurrent requests, 128-token prompts, outputs
              16..128 tokens, ignore_eos; and a RAG shape (a 1,000-token shared system prompt)
              with our prefix caching on and off
  ceiling     the encoder's FLOPs/token × our tokens/s against the FLOP/s of 4,096 tokens through
              its FFN up-projection (4096 × 384 × 1536 for these two encoders), and the
              decoder's weight bytes per step × steps/s against a copy's memory bandwidth; the
              encoder in process and the matmul rate are measured right after our served runs of
              the same precision (this machine's speed moves by 10-15 % within minutes)

    python -m embedserve.studies.compare            # what `make bench` runs (about 55 minutes on 2 AVX2 cores)
"""

from __future__ import annotations

import argparse
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
import numpy as np

from embedserve.bench import load

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / ".bench-peers"
RESULTS = ROOT / "embedserve" / "studies" / "results"
GEN_MODEL = "SmolLM2-135M-Instruct"
EMBED_MODELS = ("all-MiniLM-L6-v2", "multilingual-e5-small")
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
def served(name: str, cmd: list[str], port: int, ready: str, env: dict | None = None, timeout: float = 400):
    """A server subprocess, yielded once `ready` answers 200; its log in a temp file."""
    logf = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
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


def ours(model: str, dtype: str, generate: str = "none", extra: tuple = ()):
    port = _port()
    cmd = [sys.executable, "-m", "embedserve.cli", "serve", "--model", model, "--dtype", dtype, "--port", str(port),
           "--generate-model", generate, "--max-concurrent-requests", "4096", "--max-queued-tokens", "4000000",
           "--log-level", "warning", *extra]
    return served(f"embedserve-{dtype}", cmd, port, "/ready")


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
    exe = {"infinity": PEERS / "infinity" / "bin" / "infinity_emb", "vllm": PEERS / "vllm" / "bin" / "python"}[name]
    return None if exe.exists() else f"not installed ({exe} missing; `make bench-peers` builds it)"


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


# ============================================================================ embeddings
def corpus(n: int, seed: int = 0) -> list[str]:
    """Mixed-length English and Chinese paragraphs (a log-normal mix, median ≈ 40 words)."""
    rng = np.random.default_rng(seed)
    en = ("the index stores passages and the service embeds queries so that retrieval finds the closest "
          "documents about rivers cities history science music software databases and the weather in "
          "spring when the trains run late and the markets open early").split()
    zh = list("检索系统把文档切成段落并用向量表示查询找到最相近的内容城市历史科学音乐软件数据库天气")
    out = []
    for i in range(n):
        k = int(np.clip(rng.lognormal(np.log(40), 0.8), 3, 300))
        out.append(" ".join(rng.choice(en, size=k)) if i % 4 else "".join(rng.choice(zh, size=k)))
    return out


def write_jsonl(rows: list[dict], path: Path) -> Path:
    """`rows` as a JSONL file at `path` (the load generator's --dataset jsonl); returns `path`."""
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


EMBED_WORKLOADS = (("1 text/request, 8 clients", 1, 8, 192), ("1 text/request, 32 clients", 1, 32, 192),
                   ("32 texts/request, 8 clients", 32, 8, 12))


def embed_served(system: str, base: str, model: str, data: Path, runs: int) -> dict:
    """The three fixed workloads, `runs` times each; medians of texts/s and p50/p99 latency."""
    out = {}
    for label, per_req, conc, n in EMBED_WORKLOADS:
        rs = []
        for _ in range(runs):
            rs += drive("embed", base, model, data, "--batch-size", str(per_req), "--max-concurrency", str(conc),
                        "--num-requests", str(n), "--warmup", str(min(conc, n)))
        out[label] = {"texts_per_s": med([r["metrics"]["request_throughput"] * per_req for r in rs]),
                      "tokens_per_s": med([r["metrics"]["input_token_throughput"] for r in rs]),
                      "p50_ms": med([r["metrics"]["e2e_latency_ms"]["p50"] for r in rs]),
                      "p99_ms": med([r["metrics"]["e2e_latency_ms"]["p99"] for r in rs]),
                      "failed": sum(r["metrics"]["failed"] for r in rs)}
        log(f"  {system} {label}: {out[label]['texts_per_s']:.0f} texts/s, p99 {out[label]['p99_ms']:.0f} ms")
    return out


def embed_sweep(base: str, model: str, data: Path, saturation: float) -> list[dict]:
    """Poisson arrivals (1 text per request) at fractions of the measured saturation rate."""
    rates = [round(saturation * f, 1) for f in (0.25, 0.5, 0.75, 1.0, 1.25)]
    rs = drive("embed", base, model, data, "--batch-size", "1", "--num-requests", "128", "--warmup", "16",
               "--max-concurrency", "256", "--sweep", "rate=" + ",".join(map(str, rates)))
    return [{"rate": r["request_rate"], "texts_per_s": r["metrics"]["request_throughput"],
             "p50_ms": r["metrics"]["e2e_latency_ms"]["p50"], "p99_ms": r["metrics"]["e2e_latency_ms"]["p99"],
             "failed": r["metrics"]["failed"]} for r in rs]


def st_offline(path: Path, dtype: str, texts: list[str], runs: int) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(str(path), device="cpu")
    if dtype == "bfloat16":
        st = st.to(torch.bfloat16)
    st.encode(texts[:64], batch_size=32)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        st.encode(texts, batch_size=32)
        times.append(time.perf_counter() - t0)
    return {"texts_per_s": len(texts) / med(times)}


def encoder_in_process(path: Path, name: str, dtype: str, texts: list[str], runs: int) -> dict:
    """Encoder alone, in process, same texts and precision: ours (length-sorted batches under a
    4,096-token budget, as the server forms them) vs Hugging Face transformers' AutoModel
    (length-sorted batches of 32, padded per batch, SDPA), timed alternately. Tokens/s of real
    tokens, medians."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from embedserve.embedders import token_batches
    from embedserve.models.embedding_model import EmbeddingModel
    ours_model = EmbeddingModel(path, name=name, dtype=dtype)
    ids = [ours_model.truncate(x) for x in ours_model.tokenize(texts)]
    tokens = sum(len(x) for x in ids)
    order = sorted(ids, key=len, reverse=True)
    batches = [[order[i] for i in b] for b in token_batches([len(x) for x in order], 4096)]

    def run_ours():
        for b in batches:
            ours_model.embed(b, {"dense"})

    # transformers in the precision our activations run in (int8's are bf16 only where bf16 is fast)
    tdtype = torch.bfloat16 if ours_model.precision != "float32" and peer_precision() == "bfloat16" else torch.float32
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModel.from_pretrained(str(path), dtype=tdtype, attn_implementation="sdpa").eval()
    sorted_texts = [texts[i] for i in sorted(range(len(texts)), key=lambda i: -len(ids[i]))]
    enc = [tok(sorted_texts[i:i + 32], padding=True, truncation=True, max_length=512, return_tensors="pt")
           for i in range(0, len(texts), 32)]

    def run_hf():
        with torch.inference_mode():
            for e in enc:
                hf(**e)

    out = {}
    sides = (("ours", run_ours), ("transformers", run_hf))
    for _, fn in sides:
        fn()                                                      # warm-up
    # alternated, ours then transformers, `runs` + 2 times: the machine's speed drifts by 10-25 %
    # within minutes, and one side timed in a block of its own would take a slow phase alone
    times: dict[str, list[float]] = {label: [] for label, _ in sides}
    for _ in range(runs + 2):
        for label, fn in sides:
            t0 = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t0)
    for label, _ in sides:
        out[label] = {"tokens_per_s": tokens / med(times[label])}
    out["precision"] = {"ours": ours_model.precision, "transformers": str(tdtype).removeprefix("torch.")}
    out["ratio"] = out["ours"]["tokens_per_s"] / out["transformers"]["tokens_per_s"]
    log(f"  in process {out['precision']}: ours {out['ours']['tokens_per_s']:.0f} tokens/s, transformers "
        f"{out['transformers']['tokens_per_s']:.0f} ({out['ratio']:.2f}x)")
    return out


def bench_embeddings(runs: int, work: Path) -> dict:
    from embedserve.models.registry import resolve_model
    texts = corpus(768)
    data = write_jsonl([{"text": t} for t in texts], work / "corpus.jsonl")
    result = {}
    for model in EMBED_MODELS:
        name, path = resolve_model(model)
        res: dict = {"ours": {}, "infinity": {}, "sentence_transformers": {}, "sweep": {}, "in_process": {}}
        for dtype in ("auto", "float32"):
            if dtype == "float32" and "float32" in res["ours"]:
                break                                     # auto picked fp32 here: run once
            with ours(model, dtype) as base:
                resolved = httpx.get(base + "/v1/models").json()["data"][0]["dtype"]
                key = "float32" if resolved == "float32" else f"best ({resolved})"
                res["ours"][key] = embed_served(f"embedserve {resolved}", base, name, data, runs)
                if dtype == "auto":
                    sat = res["ours"][key]["1 text/request, 32 clients"]["texts_per_s"]
                    res["sweep"]["ours"] = embed_sweep(base, name, data, sat)
            # the encoder in process and the matmul rate right after the served runs of the same
            # precision: this shared machine's speed moves by 10-15 % within minutes, and these
            # three are compared with one another (server share, fraction of the ceiling)
            ip_key = "float32" if resolved == "float32" else "auto"
            res["in_process"][ip_key] = encoder_in_process(path, name, dtype, texts[:384], runs)
            prec = res["in_process"][ip_key]["precision"]["ours"]
            shape = ceiling_shape(path)
            res["in_process"][ip_key]["matmul_shape"] = list(shape)
            res["in_process"][ip_key]["matmul_gflops"] = matmul_flops(prec, shape) / 1e9
            # the 2048^3 square earlier runs used as the ceiling, beside it for comparison
            res["in_process"][ip_key]["square_matmul_gflops"] = matmul_flops(prec, (2048, 2048, 2048)) / 1e9
            log(f"  matmul {prec}: {res['in_process'][ip_key]['matmul_gflops']:.0f} GFLOP/s at {shape}, "
                f"{res['in_process'][ip_key]['square_matmul_gflops']:.0f} at 2048^3")
        best = peer_precision()
        peer_dtypes = ("float32", best) if best != "float32" else ("float32",)
        missing = peer_missing("infinity")
        for dtype in peer_dtypes:
            if missing:
                res["infinity"] = {"not_run": missing}
                break
            with infinity(path, name, dtype) as base:
                key = "float32" if dtype == "float32" else f"best ({dtype})"
                res["infinity"][key] = embed_served(f"infinity {dtype}", base, name, data, runs)
                if dtype == best:
                    sat = res["infinity"][key]["1 text/request, 32 clients"]["texts_per_s"]
                    res["sweep"]["infinity"] = embed_sweep(base, name, data, sat)
        for dtype in peer_dtypes:
            key = "float32" if dtype == "float32" else f"best ({dtype})"
            res["sentence_transformers"][key] = st_offline(path, dtype, texts[:384], runs)
            log(f"  sentence-transformers {dtype}: {res['sentence_transformers'][key]['texts_per_s']:.0f} texts/s")
        result[model] = res
    return result


# ============================================================================ generation
def gen_dataset(tok, n: int, prompt_len: int, out_lo: int, out_hi: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = ("the system retrieves passages from an index and the model answers questions about history "
             "science cities rivers music and software engineering with short sentences").split()
    rows = []
    for _ in range(n):
        ids = tok(" ".join(rng.choice(words, size=prompt_len * 2))).input_ids[:prompt_len]
        rows.append({"prompt": tok.decode(ids), "output_len": int(rng.integers(out_lo, out_hi + 1))})
    return rows


GEN_SHAPES = ((1, 6), (16, 32), (64, 64))            # (concurrency, requests)


def gen_served(system: str, base: str, datasets: dict, runs: int, shapes=GEN_SHAPES) -> dict:
    out = {}
    for conc, n in shapes:
        rs = []
        for _ in range(runs):
            rs += drive("generate", base, GEN_MODEL, datasets[conc], "--max-concurrency", str(conc),
                        "--num-requests", str(n), "--warmup", str(min(conc, 4)), "--ignore-eos")
        m = [r["metrics"] for r in rs]
        out[str(conc)] = {"output_tokens_per_s": med([x["output_token_throughput"] for x in m]),
                          "ttft_p50_ms": med([x["ttft_ms"]["p50"] for x in m]),
                          "tpot_p50_ms": med([x["tpot_ms"]["p50"] for x in m]),
                          "itl_p99_ms": med([x["itl_ms"]["p99"] for x in m]),
                          "failed": sum(x["failed"] for x in m)}
        log(f"  {system} @{conc}: {out[str(conc)]['output_tokens_per_s']:.0f} output tokens/s")
    return out


def hf_static(path: Path, dtype: str, rows_by_conc: dict, runs: int, shapes=GEN_SHAPES) -> dict:
    """HF `generate`, greedy, static batches as wide as the concurrency, prompts padded on the
    left; every sequence of a batch runs to the batch's longest output (min_new_tokens =
    max_new_tokens, HF's ignore_eos); useful tokens = each request's own output length."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    out = {}
    for conc, n in shapes:
        rows = rows_by_conc[conc][:n]
        useful = sum(r["output_len"] for r in rows)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            for i in range(0, n, conc):
                batch = rows[i:i + conc]
                enc = tok([r["prompt"] for r in batch], return_tensors="pt", padding=True)
                longest = max(r["output_len"] for r in batch)
                with torch.no_grad():
                    model.generate(**enc, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                                   pad_token_id=tok.pad_token_id)
            times.append(time.perf_counter() - t0)
        out[str(conc)] = {"output_tokens_per_s": useful / med(times)}
        log(f"  hf static {dtype} @{conc}: {out[str(conc)]['output_tokens_per_s']:.0f} output tokens/s")
    return out


def bench_generation(runs: int, work: Path) -> dict:
    from transformers import AutoTokenizer

    from embedserve.models.registry import resolve_generate_model
    _, path = resolve_generate_model(GEN_MODEL)
    tok = AutoTokenizer.from_pretrained(str(path))
    rows = {conc: gen_dataset(tok, n, 128, 16, 128, seed=conc) for conc, n in GEN_SHAPES}
    data = {conc: write_jsonl(r, work / f"gen-{conc}.jsonl") for conc, r in rows.items()}
    res: dict = {"ours": {}, "vllm": {}, "hf_static": {}}
    # the decoder's best precision here on every side (bf16 where the CPU has it fast)
    for dtype, shapes in ((peer_precision(), GEN_SHAPES),):
        with ours("all-MiniLM-L6-v2", dtype, generate=GEN_MODEL, extra=("--max-num-seqs", "64")) as base:
            res["ours"][dtype] = gen_served(f"embedserve {dtype}", base, data, runs, shapes)
        missing = peer_missing("vllm")
        if missing:
            res["vllm"] = {"not_run": missing}
        else:
            try:
                with vllm(path, dtype) as base:
                    res["vllm"][dtype] = gen_served(f"vllm {dtype}", base, data, runs, shapes)
            except RuntimeError as exc:
                res["vllm"][dtype] = {"not_run": str(exc).splitlines()[0]}
        res["hf_static"][dtype] = hf_static(path, dtype, rows, runs, shapes)
    res["rag_prefix_caching"] = bench_rag(tok, work, runs, dtype)
    return res


def bench_rag(tok, work: Path, runs: int, dtype: str) -> dict:
    """A 1,000-token shared system prompt + a 150-token document + a question, 16 output tokens,
    one at a time: TTFT with our prefix caching on and off. Every request of every run has a
    document of its own (the probe and warm-up included), so "on" measures the shared system
    prompt cached and the document computed, never a whole prompt seen before."""
    rng = np.random.default_rng(3)
    words = "retrieval passage source cite answer question context history river city science".split()
    system = tok.decode(tok(" ".join(rng.choice(words, size=2000))).input_ids[:1000])
    per_run = 8 + 2                                     # the probe, one warm-up, 8 measured
    files = []
    for r in range(runs):
        rows = [{"prompt": system + "\n\nDocument: " + tok.decode(tok(" ".join(rng.choice(words, size=300))).input_ids[:150])
                 + f"\n\nQuestion {r}.{i}: what does the document say?\nAnswer:", "output_len": 16}
                for i in range(per_run)]
        files.append(write_jsonl(rows, work / f"rag-{r}.jsonl"))
    out: dict = {"dtype": dtype}
    for label, flag in (("on", "--enable-prefix-caching"), ("off", "--no-enable-prefix-caching")):
        with ours("all-MiniLM-L6-v2", dtype, generate=GEN_MODEL, extra=(flag,)) as base:
            rs = []
            for data in files:
                rs += drive("generate", base, GEN_MODEL, data, "--max-concurrency", "1", "--num-requests", "8",
                            "--warmup", "1", "--ignore-eos")
            out[label] = {"ttft_p50_ms": med([r["metrics"]["ttft_ms"]["p50"] for r in rs]),
                          "e2e_p50_ms": med([r["metrics"]["e2e_latency_ms"]["p50"] for r in rs])}
            log(f"  RAG prefix caching {label}: TTFT p50 {out[label]['ttft_p50_ms']:.0f} ms")
    return out


# ============================================================================ ceiling
# the ceiling's matmul, as the near-the-limit issue defines it: a 4,096-token batch through the
# encoder's FFN up-projection (4096 x 384 x 1536 for MiniLM and e5-small: K = 384 is where these
# encoders' matmuls live, and it runs slower than a large square product)
CEILING_ROWS = 4096


def matmul_flops(dtype: str, shape: tuple[int, int, int] = (CEILING_ROWS, 384, 1536), reps: int = 20) -> float:
    """The machine's matmul FLOP/s in `dtype` for an (m x k) @ (k x n) product: the faster of
    `a @ b` and a linear packed for oneDNN (what our encoder runs; in fp32 it is ~2x MKL's `a @ b`
    on these CPUs); int8 on the matmul the encoder's int8 takes here (`_int_mm` with VNNI, fbgemm
    without). The best of `reps` timed calls after two warm-ups: a ceiling, and on a shared
    machine interference only slows a call down (5 calls once read 82 GFLOP/s where 129 held)."""
    import torch

    from embedserve.models.linear import Linear
    m, k, n = shape
    if dtype == "int8":
        from embedserve.models.int8 import int8_kernel
        if int8_kernel() == "fbgemm":       # what the encoder's int8 runs on here (no VNNI)
            import warnings
            from embedserve.models.int8 import FBGEMM_W_LEVELS
            w = torch.randint(-FBGEMM_W_LEVELS, FBGEMM_W_LEVELS + 1, (n, k), dtype=torch.int8)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                packed_q = torch.ops.quantized.linear_prepack(torch._make_per_channel_quantized_tensor(
                    w, torch.ones(n, dtype=torch.double), torch.zeros(n, dtype=torch.long), 0), None)
            x = torch.randint(-127, 128, (m, k)).float()
            fns = [lambda: torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, 1.0, 128, packed_q)]
        else:
            a = torch.randint(-100, 100, (m, k), dtype=torch.int8)
            b = torch.randint(-100, 100, (k, n), dtype=torch.int8)
            fns = [lambda: torch._int_mm(a, b)]
    else:
        a = torch.randn(m, k, dtype=getattr(torch, dtype))
        b = torch.randn(k, n, dtype=getattr(torch, dtype))
        packed = Linear(b.T.contiguous())
        fns = [lambda: a @ b, lambda: packed(a)]
    best = float("inf")
    with torch.inference_mode():
        for fn in fns:
            fn()
            fn()
            best = min(best, *(_timed(fn) for _ in range(reps)))
    return 2 * m * k * n / best


def ceiling_shape(model_dir: Path) -> tuple[int, int, int]:
    """The ceiling's matmul for this encoder: 4,096 tokens through its FFN up-projection."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return CEILING_ROWS, cfg["hidden_size"], cfg["intermediate_size"]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_bandwidth(mib: int = 512, reps: int = 5) -> float:
    import torch
    src = torch.empty(mib * 2 ** 20, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * src.numel() / best                    # read + write


def encoder_flops_per_token(model_dir: Path, avg_len: float) -> float:
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    dense = layers * (4 * h * h + 2 * h * inter)          # Q, K, V, O and the two FFN matrices
    attention = layers * 2 * h * avg_len                  # QK^T and PV per token
    return 2 * (dense + attention)


def bench_ceiling(emb: dict, gen: dict) -> dict:
    import torch

    from embedserve.models.registry import resolve_generate_model, resolve_model
    out = {"threads": torch.get_num_threads()}
    for model in EMBED_MODELS:
        _, path = resolve_model(model)
        best = best_of(emb[model]["ours"])["32 texts/request, 8 clients"]
        fp32 = emb[model]["ours"]["float32"]["32 texts/request, 8 clients"]
        avg_len = best["tokens_per_s"] / max(best["texts_per_s"], 1e-9)
        fpt = encoder_flops_per_token(path, avg_len)
        dtype = best_dtype(emb[model]["ours"])
        ip = emb[model].get("in_process", {})
        # the rate measured beside the runs it is compared with (else measured now)
        ip_auto = ip.get("auto", ip.get("float32", {}))     # auto picked fp32: the one fp32 run
        shape = ceiling_shape(path)
        peak = ip_auto.get("matmul_gflops", 0) * 1e9 or matmul_flops(dtype, shape)
        peak32 = ip.get("float32", {}).get("matmul_gflops", 0) * 1e9 or matmul_flops("float32", shape)
        square = ip_auto.get("square_matmul_gflops", 0)
        square32 = ip.get("float32", {}).get("square_matmul_gflops", 0)
        ip_best = ip_auto.get("ours", {}).get("tokens_per_s", 0.0)
        ip_fp32 = ip.get("float32", {}).get("ours", {}).get("tokens_per_s", 0.0)
        out[model] = {"flops_per_token": fpt, "avg_tokens_per_text": avg_len,
                      "best": {"dtype": dtype, "tokens_per_s": best["tokens_per_s"],
                               "achieved_gflops": fpt * best["tokens_per_s"] / 1e9, "matmul_gflops": peak / 1e9,
                               "matmul_shape": list(shape), "square_matmul_gflops": square,
                               "fraction": fpt * best["tokens_per_s"] / peak,
                               "in_process_tokens_per_s": ip_best, "in_process_fraction": fpt * ip_best / peak},
                      "float32": {"tokens_per_s": fp32["tokens_per_s"],
                                  "achieved_gflops": fpt * fp32["tokens_per_s"] / 1e9, "matmul_gflops": peak32 / 1e9,
                                  "matmul_shape": list(shape), "square_matmul_gflops": square32,
                                  "fraction": fpt * fp32["tokens_per_s"] / peak32,
                                  "in_process_tokens_per_s": ip_fp32, "in_process_fraction": fpt * ip_fp32 / peak32}}
    _, gpath = resolve_generate_model(GEN_MODEL)
    from safetensors import safe_open
    params = 0
    for f in gpath.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                params += int(np.prod(st.get_slice(k).get_shape()))
    bw = copy_bandwidth()
    gdtype = next(iter(gen["ours"]))
    width = 2 if gdtype in ("bfloat16", "float16") else 4
    alone = gen["ours"][gdtype]["1"]["output_tokens_per_s"]
    out["decoder"] = {"params": params, "dtype": gdtype, "bytes_per_step": width * params, "steps_per_s_alone": alone,
                      "achieved_gb_per_s": width * params * alone / 1e9, "copy_gb_per_s": bw / 1e9,
                      "fraction": width * params * alone / bw}
    return out


# ============================================================================ report
def _x(a, b) -> str:
    return f"{a / b:.2f}×" if a and b else "—"


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"Run {res['date']} with `{res['command']}` on {m.get('cpu_model', m.get('cpu', '?'))}, "
             f"{m.get('cores')} cores, CPU flags {', '.join(res['cpu_flags'])}; medians of {res['runs']} runs; "
             f"{res['minutes']:.1f} minutes in all.", ""]
    for model, r in res["embeddings"].items():
        lines += [f"### Embeddings, {model} (texts/s, p99 ms)", "",
                  "| system | precision | 1/req × 8 | 1/req × 32 | 32/req × 8 | p99 1/req × 32 |", "|---|---|---|---|---|---|"]
        for system in ("ours", "infinity"):
            if "not_run" in r[system]:
                lines.append(f"| {system} | — | {r[system]['not_run']} | | | |")
                continue
            for prec, w in r[system].items():
                cells = [f"{w[label]['texts_per_s']:.0f}" for label, *_ in EMBED_WORKLOADS]
                lines.append(f"| {'embedserve' if system == 'ours' else 'infinity-emb 0.0.78'} | {prec} | "
                             + " | ".join(cells) + f" | {w['1 text/request, 32 clients']['p99_ms']:.0f} |")
        for prec, w in r["sentence_transformers"].items():
            lines.append(f"| sentence-transformers (offline, batch 32) | {prec} | | | {w['texts_per_s']:.0f} | |")
        ob = best_of(r["ours"])
        if "not_run" not in r["infinity"]:
            ib = best_of(r["infinity"])
            lines += ["", "Ratio ours/infinity, best precision each: "
                      + ", ".join(f"{label} {_x(ob[label]['texts_per_s'], ib[label]['texts_per_s'])}"
                                  for label, *_ in EMBED_WORKLOADS)
                      + "; fp32 each: " + ", ".join(
                          f"{label} {_x(r['ours']['float32'][label]['texts_per_s'], r['infinity']['float32'][label]['texts_per_s'])}"
                          for label, *_ in EMBED_WORKLOADS) + "."]
        for dtype, ip in r.get("in_process", {}).items():
            served = (r["ours"]["float32"] if dtype == "float32" else best_of(r["ours"]))["32 texts/request, 8 clients"]
            lines += ["", f"In process, {ip['precision']['ours']} (transformers {ip['precision']['transformers']}), "
                      f"the same texts: ours {ip['ours']['tokens_per_s']:.0f} tokens/s (4,096-token batches) vs "
                      f"transformers {ip['transformers']['tokens_per_s']:.0f} (sorted batches of 32) = "
                      f"{_x(ip['ours']['tokens_per_s'], ip['transformers']['tokens_per_s'])}; our server at 32 texts/request "
                      f"× 8 clients reaches {served['tokens_per_s']:.0f} tokens/s = "
                      f"{100 * served['tokens_per_s'] / ip['ours']['tokens_per_s']:.0f} % of in process."]
        lines.append("")
        for system, pts in r["sweep"].items():
            lines.append(f"Poisson sweep, {system} (best precision): " + "; ".join(
                f"{p['rate']}/s → {p['texts_per_s']:.0f} texts/s, p50 {p['p50_ms']:.0f} ms, p99 {p['p99_ms']:.0f} ms"
                for p in pts))
        lines.append("")
    g = res["generation"]
    lines += ["### Generation, SmolLM2-135M-Instruct (output tokens/s; TTFT p50 ms)", "",
              "| precision | concurrency | embedserve | vLLM CPU 0.32 | HF static (same width) | ours/vLLM | ours/HF |",
              "|---|---|---|---|---|---|---|"]
    for dtype in g["ours"]:
        for conc in g["ours"][dtype]:                     # the shapes run in that precision
            o = g["ours"][dtype][conc]
            v = g["vllm"].get(dtype, {}).get(conc) if "not_run" not in g["vllm"] else None
            h = g["hf_static"][dtype][conc]
            vcell = (f"{v['output_tokens_per_s']:.0f} (TTFT {v['ttft_p50_ms']:.0f})" if v
                     else (g["vllm"].get("not_run") or g["vllm"].get(dtype, {}).get("not_run", "—")))
            lines.append(f"| {dtype} | {conc} | {o['output_tokens_per_s']:.0f} (TTFT {o['ttft_p50_ms']:.0f}) | {vcell} | "
                         f"{h['output_tokens_per_s']:.0f} | {_x(o['output_tokens_per_s'], v['output_tokens_per_s'] if v else None)} | "
                         f"{_x(o['output_tokens_per_s'], h['output_tokens_per_s'])} |")
    rag = g["rag_prefix_caching"]
    lines += ["", f"RAG shape (1,000-token shared system prompt, 150-token document, 16 output tokens, one at a "
              f"time, {rag.get('dtype', 'bfloat16')}): TTFT p50 {rag['on']['ttft_p50_ms']:.0f} ms with prefix caching, "
              f"{rag['off']['ttft_p50_ms']:.0f} ms without ({_x(rag['off']['ttft_p50_ms'], rag['on']['ttft_p50_ms'])}).", ""]
    c = res["ceiling"]
    lines += ["### How close to the machine's limit", "",
              "The encoder's FLOPs × tokens/s against the measured matmul rate in the same precision, for our "
              "server over HTTP (32 texts/request × 8 clients) and for the encoder in process (the same texts "
              "in 4,096-token batches), the three measured back to back. The ceiling is the issue's: 4,096 "
              "tokens through the model's FFN up-projection (4096 × 384 × 1536 here), the packed oneDNN "
              "linear or `a @ b`, whichever is faster; the 2048³ square that earlier runs used is in brackets.", "",
              "| model | precision | FLOPs/token | matmul GFLOP/s (same precision) [2048³] | server tokens/s | "
              "achieved GFLOP/s | fraction | in process tokens/s | fraction |",
              "|---|---|---|---|---|---|---|---|---|"]
    for model in EMBED_MODELS:
        for key in (("float32", "best") if c[model]["best"]["dtype"] != "float32" else ("best",)):
            x = c[model][key]
            prec = "float32" if key == "float32" else x["dtype"]
            sq = f" [{x['square_matmul_gflops']:.0f}]" if x.get("square_matmul_gflops") else ""
            lines.append(f"| {model} | {prec} | {c[model]['flops_per_token'] / 1e6:.1f} M | {x['matmul_gflops']:.0f}{sq} | "
                         f"{x['tokens_per_s']:.0f} | {x['achieved_gflops']:.0f} | {100 * x['fraction']:.0f} % | "
                         f"{x.get('in_process_tokens_per_s', 0):.0f} | {100 * x.get('in_process_fraction', 0):.1f} % |")
    d = c["decoder"]
    lines += ["", f"Decoder alone ({d.get('dtype', 'bfloat16')}, one sequence): {d['params'] / 1e6:.0f} M parameters = "
              f"{d.get('bytes_per_step', d.get('bytes_per_step_bf16', 0)) / 1e6:.0f} MB read per step × {d['steps_per_s_alone']:.0f} steps/s = "
              f"{d['achieved_gb_per_s']:.1f} GB/s against {d['copy_gb_per_s']:.1f} GB/s measured copy bandwidth "
              f"({100 * d['fraction']:.0f} %).", ""]
    return "\n".join(lines)


def update_benchmarks_md(md: str) -> None:
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text()
    begin, end = "<!-- make-bench:begin -->", "<!-- make-bench:end -->"
    if begin in text:
        text = text[:text.index(begin) + len(begin)] + "\n" + md + "\n" + text[text.index(end):]
        path.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", choices=("embeddings", "generation"), default=None)
    ap.add_argument("--out", default=str(RESULTS / "compare.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("EMBEDSERVE_THREADS", str(os.cpu_count() or 1))
    from embedserve.precision import cpu_flags
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="bench-"))
    res = {"command": "make bench", "date": time.strftime("%Y-%m-%d"), "runs": args.runs,
           "machine": load.machine_info(),
           "cpu_flags": sorted(f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni",
                                                                "amx_bf16", "amx_int8"))}
    if args.only in (None, "embeddings"):
        log("embeddings")
        res["embeddings"] = bench_embeddings(args.runs, work)
    if args.only in (None, "generation"):
        log("generation")
        res["generation"] = bench_generation(args.runs, work)
    if args.only is None:
        log("ceiling")
        res["ceiling"] = bench_ceiling(res["embeddings"], res["generation"])
    res["minutes"] = (time.time() - t0) / 60
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    if args.only is None:
        md = markdown(res)
        Path(args.out).with_suffix(".md").write_text(md + "\n")
        update_benchmarks_md(md)
        print(md)
    log(f"done in {res['minutes']:.1f} minutes; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
