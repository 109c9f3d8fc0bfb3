"""Generation benchmark on SmolLM2-135M-Instruct, ours vs Hugging Face `generate`, one run:

  (a) throughput: 64 requests (128-token prompts), output lengths mixed 16..256 —
      our engine (continuous batching, paged KV) vs HF `generate` in static batches of 16;
  (b) RAG shape: a 1,000-token shared system prompt + a document + a short question —
      time to first token with prefix caching on vs off, and the cache hit rate;
  (c) KV memory per token against the formula, and the waste (allocated, unused slots).
  --precision: only our engine in float32 vs bfloat16 weights (16 × 128-token prompts -> 64
      tokens with ignore_eos, 16 at once and 1 alone; runs interleaved, median of 3), which
      decides `--dtype auto` for the decoder (embedserve.precision.DECODER_BF16_FASTER_ON_CPU).

    python -m embedserve.studies.decode_bench --out embedserve/studies/results/decode.json
    python -m embedserve.studies.decode_bench --precision --out embedserve/studies/results/decode_precision.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch


def random_prompts(tok, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` token ids each, made of random words drawn with `seed`."""
    rng = np.random.default_rng(seed)
    words = ("the system retrieves passages from an index and the model answers questions about "
             "history science cities rivers music and software engineering with short sentences").split()
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(words, size=length * 2))
        out.append(tok(text).input_ids[:length])
    return out


def bench_throughput(eng, hf, prompts, lengths) -> dict:
    from embedserve.engine.sequence import SamplingParams
    useful = int(sum(lengths))
    t0 = time.perf_counter()
    seqs = eng.generate(prompts, [SamplingParams(temperature=0, max_tokens=int(L), ignore_eos=True) for L in lengths])
    ours = time.perf_counter() - t0
    assert sum(len(s.completion_ids) for s in seqs) == useful
    t0 = time.perf_counter()
    hf_tokens = 0
    for i in range(0, len(prompts), 16):
        batch, lens = prompts[i:i + 16], lengths[i:i + 16]
        ids = torch.tensor(batch)                   # equal-length prompts: no padding needed
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(max(lens)),
                              do_sample=False, pad_token_id=0)
        hf_tokens += sum(min(int(L), out.shape[1] - ids.shape[1]) for L in lens)
    hf_s = time.perf_counter() - t0
    return {"requests": len(prompts), "useful_output_tokens": useful,
            "ours_s": ours, "ours_tokens_per_s": useful / ours,
            "hf_static16_s": hf_s, "hf_tokens_per_s": hf_tokens / hf_s,
            "ratio": (useful / ours) / (hf_tokens / hf_s)}


def bench_rag_ttft(make_engine, tok, n: int) -> dict:
    from embedserve.engine.sequence import SamplingParams
    rng = np.random.default_rng(1)
    system = tok(("You answer questions using only the documents below. " * 120)).input_ids[:1000]
    doc = tok("Document 1: The Danube flows through ten countries and four capitals. " * 12).input_ids[:200]
    questions = [tok(f"Question {i}: which river flows through Vienna and Budapest?").input_ids for i in range(n)]
    res = {}
    for caching in (True, False):
        eng = make_engine(enable_prefix_caching=caching)
        ttfts = []
        for q in questions:
            t0 = time.perf_counter()
            eng.generate([system + doc + q], SamplingParams(temperature=0, max_tokens=1))
            ttfts.append(time.perf_counter() - t0)
        res["on" if caching else "off"] = {
            "ttft_first_ms": 1000 * ttfts[0], "ttft_median_rest_ms": 1000 * statistics.median(ttfts[1:]),
            "hit_rate": eng.bm.prefix_hits / max(eng.bm.prefix_queries, 1)}
    res["prompt_tokens"] = len(system) + len(doc) + len(questions[0])
    res["speedup"] = res["off"]["ttft_median_rest_ms"] / res["on"]["ttft_median_rest_ms"]
    _ = rng
    return res


def bench_precision(path, tok, repeats: int = 3) -> dict:
    """Our engine's decode throughput with float32 vs bfloat16 weights, same prompts and settings."""
    from embedserve.config import DecodeConfig
    from embedserve.engine.decode_engine import DecodeEngine
    from embedserve.engine.sequence import SamplingParams
    from embedserve.models.llama import LlamaModel
    from embedserve.precision import cpu_flags, fast_bf16_available

    prompts = random_prompts(tok, 16, 128, seed=2)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    engines = {}
    for dtype in ("float32", "bfloat16"):
        model = LlamaModel.from_dir(path, dtype=getattr(torch, dtype))
        engines[dtype] = DecodeEngine(model, tok, DecodeConfig(
            block_size=16, max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=64), num_blocks=512)
    times: dict[str, list[float]] = {f"{d}-{c}": [] for d in engines for c in (16, 1)}
    for _ in range(repeats + 1):                       # the first round warms up and is dropped
        for dtype, eng in engines.items():
            for conc in (16, 1):
                t0 = time.perf_counter()
                eng.generate(prompts[:conc], params)
                times[f"{dtype}-{conc}"].append(time.perf_counter() - t0)
    tps = {k: (64 * int(k.split("-")[1])) / statistics.median(v[1:]) for k, v in times.items()}
    return {"tokens_per_s": tps, "bf16_over_fp32_16": tps["bfloat16-16"] / tps["float32-16"],
            "bf16_over_fp32_1": tps["bfloat16-1"] / tps["float32-1"], "fast_bf16": fast_bf16_available("cpu"),
            "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx2")))}


def kv_memory(eng) -> dict:
    cfg = eng.model.cfg
    kc, vc = eng.runner.kv_caches[0]
    per_token_actual = (kc.element_size() * kc[0, 0].numel() * 2) * len(eng.runner.kv_caches)
    return {"bytes_per_token_formula": cfg.kv_bytes_per_token(kc.element_size()),
            "bytes_per_token_allocated": per_token_actual,
            "block_size": eng.config.block_size, "num_blocks": eng.num_blocks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="decode_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rag-requests", type=int, default=6)
    ap.add_argument("--out", default="embedserve/studies/results/decode.json")
    ap.add_argument("--precision", action="store_true", help="only float32 vs bfloat16 decoding (ours)")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from embedserve.config import DecodeConfig
    from embedserve.engine.decode_engine import DecodeEngine
    from embedserve.models.llama import LlamaModel
    from embedserve.models.registry import resolve_generate_model

    torch.set_num_threads(os.cpu_count() or 1)
    name, path = resolve_generate_model("SmolLM2-135M-Instruct")
    tok = AutoTokenizer.from_pretrained(str(path))
    if args.precision:
        res = {"model": name, "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M"),
               **bench_precision(path, tok)}
        print(json.dumps(res, indent=1))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
        return 0
    model = LlamaModel.from_dir(path)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def make_engine(**kw):
        cfg = dict(num_blocks=2048, block_size=16, max_model_len=2048, max_num_batched_tokens=512,
                   max_num_seqs=64)
        cfg.update(kw)
        num_blocks = cfg.pop("num_blocks")
        return DecodeEngine(model, tok, DecodeConfig(**cfg), num_blocks=num_blocks)

    lengths = np.random.default_rng(0).integers(16, 257, size=args.requests)
    prompts = random_prompts(tok, args.requests, 128, seed=0)
    eng = make_engine()
    peak = {"allocated": 0, "used": 0}
    step = eng.step

    def tracking_step():
        step()
        used = sum(s.num_tokens for s in eng.scheduler.running)
        alloc = sum(len(s.block_table) for s in eng.scheduler.running) * eng.config.block_size
        if alloc > peak["allocated"]:
            peak.update(allocated=alloc, used=used)

    eng.step = tracking_step
    result = {"model": name, "dtype": "float32", "threads": torch.get_num_threads(),
              "date": time.strftime("%Y-%m-%d %H:%M")}
    result["throughput"] = bench_throughput(eng, hf, prompts, lengths)
    print(json.dumps(result["throughput"], indent=1), flush=True)
    result["rag_ttft"] = bench_rag_ttft(make_engine, tok, args.rag_requests)
    print(json.dumps(result["rag_ttft"], indent=1), flush=True)
    kv = kv_memory(eng)
    kv.update(peak_allocated_slots=peak["allocated"], peak_used_slots=peak["used"],
              waste_fraction=1 - peak["used"] / max(peak["allocated"], 1))
    result["kv_memory"] = kv
    print(json.dumps(kv, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
