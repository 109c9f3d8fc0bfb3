"""What a 16-bit KV cache costs a float32 decoder in accuracy, against a float32 cache, for native
and weight-only int8 weights (`--kv-cache-dtype auto` gives a float32 decoder on a CPU a float16
cache: kernels.check_kv_cache_dtype):

* held-out perplexity: int8_gate's texts (never used to quantize), each in one prefill whose
  attention reads K/V back from a cache of the dtype under test;
* greedy continuations of int8_gate's prompts (`new_tokens` each, EOS ignored) through the engine
  over each cache, against the float32 cache's: how many prompts give the same tokens, and where
  one parts, the float32 cache's logit gap between the two candidates (a near-tie when small).

    python -m embedserve.studies.kv_cache_accuracy [--model SmolLM2-135M-Instruct] [--new-tokens 32]

Seconds on 2 cores; the result beside the other studies' (results/kv_cache_accuracy.{json,md}).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from embedserve.studies import write_results

RESULTS = Path(__file__).with_name("results")
KV_DTYPES = ("float32", "float16", "bfloat16")


def study(model_name: str, new_tokens: int) -> dict:
    from transformers import AutoTokenizer

    from embedserve.models import int8_gate
    from embedserve.models.llama import LlamaModel
    from embedserve.models.registry import resolve_generate_model
    from embedserve.precision import cpu_flags

    path = resolve_generate_model(model_name)[1]
    tok = AutoTokenizer.from_pretrained(str(path))
    prompts = [tok(p).input_ids for p in int8_gate.PROMPTS]
    texts = [tok(t).input_ids for t in int8_gate.TEXTS]
    t0 = time.perf_counter()
    rows = []
    for weights in ("native", "int8"):
        model = LlamaModel.from_dir(path, torch.float32, linear_weights=weights)
        ref = int8_gate.greedy(model, tok, prompts, new_tokens, kv_cache_dtype="float32")
        ppl_ref = None
        for kv in KV_DTYPES:
            ppl = int8_gate.perplexity(model, texts, kv_dtype=getattr(torch, kv))
            ppl_ref = ppl_ref or ppl
            got = ref if kv == "float32" else int8_gate.greedy(model, tok, prompts, new_tokens, kv_cache_dtype=kv)
            # the gap by the model over its own (float32) cache
            parts = [{"step": part[0], "gap": part[1]} for p, a, b in zip(prompts, ref, got)
                     if (part := int8_gate.first_parting(model, p, a, b)) is not None]
            rows.append({"weights": weights, "kv_cache_dtype": kv, "perplexity": ppl,
                         "perplexity_change_pct": 100 * (ppl / ppl_ref - 1), "prompts": len(prompts),
                         "same_tokens": len(prompts) - len(parts), "parts": parts})
    return {"model": model_name, "new_tokens": new_tokens, "rows": rows, "seconds": time.perf_counter() - t0,
            "date": time.strftime("%Y-%m-%d"),
            "cpu_flags": sorted(f for f in cpu_flags() if f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16")),
            "command": "python -m embedserve.studies.kv_cache_accuracy"}


def markdown(res: dict) -> str:
    out = [f"{res['model']}, float32 activations, {res['new_tokens']} greedy tokens per prompt; "
           f"{res['date']}, CPU flags {' '.join(res['cpu_flags'])}, {res['seconds']:.0f} s",
           "", "| weights | KV cache | held-out perplexity | vs float32 cache | greedy = float32 cache's | "
           "where they part: float32-cache logit gap |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        gaps = ", ".join(f"step {p['step']}: {p['gap']:.3g}" for p in r["parts"]) or "–"
        out.append(f"| {r['weights']} | {r['kv_cache_dtype']} | {r['perplexity']:.4f} | "
                   f"{r['perplexity_change_pct']:+.3f} % | {r['same_tokens']} of {r['prompts']} | {gaps} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="bundled decoder name or a local Llama directory")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS / "kv_cache_accuracy.json")
    args = ap.parse_args(argv)
    if args.new_tokens < 1:
        ap.error("--new-tokens must be at least 1")
    res = study(args.model, args.new_tokens)
    write_results(args.out, res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
