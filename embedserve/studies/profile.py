"""Where the time of one decode step, or of one embedding batch, goes, by component.

    python -m embedserve.studies.profile decode --batch 16 --out embedserve/studies/results/profile_decode.json
    python -m embedserve.studies.profile embed --model all-MiniLM-L6-v2 --out embedserve/studies/results/profile_embed.json
    python -m embedserve.studies.profile served --model all-MiniLM-L6-v2 --out embedserve/studies/results/profile_served.json

`served`: our server under make bench's embedding workloads, where its CPU goes and how the model
runs inside it (profile_served.py).

`embed`: one batch of `--texts` texts from the make-bench corpus (English and Chinese, mixed
lengths) through the path a request takes: tokenize, pack (sort, attention plan, tensors), the
encoder forward by aten op family (as for decode), pooling and normalization, and the JSON
body (`encoding_format` float and base64), each timed on its own (medians of `--repeats`),
the forward also under the profiler.

`decode`:
Runs our engine in process on SmolLM2-135M-Instruct (`--dtype`, default the precision `auto`
picks here), `--batch` prompts of `--prompt-len` tokens decoding `--steps` tokens each with
`ignore_eos`, after a warm-up. The steady decode steps (prefill excluded) run under
`torch.profiler`; each engine phase and each model component is wrapped in a
`record_function` label by patching, so the engine's code is profiled as it ships. Reported
per step, in milliseconds and as a share of the step's wall time:

- phases: schedule, prepare inputs (ModelRunner's Python: slots, block tables, tensors),
  forward, logits (lm_head), sample, postprocess (detokenize, stop checks, events);
- inside forward, by aten op family: matmuls (linear/addmm/mm/bmm, oneDNN), attention (SDPA,
  or the C decode kernel, labelled by patching since it is not an aten op),
  K/V gather (index), K/V store (index_copy_), norms, RoPE, activations, dtype conversions,
  other ops — and "Python and dispatch": the forward's wall time no op accounts for.

Op self-times come from the profiler's CPU self time; the labels' wall times from their
record_function ranges. Profiling adds ~1-3 µs per op, said in the result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from embedserve.studies.profile_served import profile_served, render_served

# aten op -> component, first match wins (names as the profiler reports them)
FAMILIES = (
    ("matmul", ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear",
                "mkldnn", "onednn", "aten::_weight_int8pack_mm", "aten::_int_mm", "CompiledFunction",
                "Torch-Compiled Region")),
    ("attention (SDPA)", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
    ("K/V gather", ("aten::index", "aten::gather", "aten::index_select")),
    ("K/V store", ("aten::index_copy", "aten::index_put")),
    ("dtype conversion", ("aten::to", "aten::_to_copy", "aten::copy_")),
    ("activation", ("aten::silu", "aten::gelu", "aten::sigmoid")),
    ("norm", ("aten::rsqrt", "aten::pow", "aten::mean", "aten::layer_norm", "aten::native_layer_norm",
              "aten::rms_norm", "aten::_fused_rms_norm")),
    ("elementwise", ("aten::mul", "aten::add", "aten::cat", "aten::neg", "aten::cos", "aten::sin",
                     "aten::sub", "aten::div", "aten::where", "aten::lt", "aten::le", "aten::masked_fill")),
)
LABELS = ("es::schedule", "es::prepare_inputs", "es::forward", "es::logits", "es::sample", "es::postprocess")


def family(name: str) -> str:
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "other ops"


def _wrap(obj, attr: str, label: str, patches: list):
    fn = getattr(obj, attr)

    def wrapped(*a, **k):
        with torch.profiler.record_function(label):
            return fn(*a, **k)

    patches.append((obj, attr, fn))
    setattr(obj, attr, wrapped)


def _instrument(eng) -> list:
    """Label the engine's phases on this engine object; returns what to restore."""
    from embedserve.engine import decode_engine

    patches: list = []
    runner, model = eng.runner, eng.model
    _wrap(eng.scheduler, "schedule", "es::schedule", patches)
    _wrap(model, "forward", "es::forward", patches)
    _wrap(model, "logits", "es::logits", patches)
    _wrap(decode_engine, "sample", "es::sample", patches)
    # ModelRunner.run = prepare inputs + forward + logits: its remainder is the input preparation
    _wrap(runner, "run", "es::run", patches)
    from kernels import cpu_attention
    _wrap(cpu_attention, "paged_decode_attention", "es::cpu_attention", patches)   # not an aten op
    from kernels import cpu_decode
    _wrap(cpu_decode.DecodeLayers, "forward", "es::fused_step", patches)             # one C call: all layers
    return patches


def _restore(patches: list) -> None:
    for obj, attr, fn in reversed(patches):
        setattr(obj, attr, fn)


def decoding_engine(model, tok, batch: int, prompt_len: int, max_tokens: int, warm: int):
    """A DecodeEngine in steady decode: a 4-token warm-up generation, then `batch` greedy
    sequences of `prompt_len`-token prompts (`max_tokens` each, ignore_eos) queued, their prefill
    run and `warm` decode steps taken. What `profile_decode` and `cpu_paths.decoder` time."""
    from embedserve.config import DecodeConfig
    from embedserve.engine.decode_engine import DecodeEngine
    from embedserve.engine.sequence import SamplingParams
    from embedserve.studies.decode_bench import random_prompts

    eng = DecodeEngine(model, tok, DecodeConfig(block_size=16, max_model_len=2048, max_num_batched_tokens=2048,
                                                max_num_seqs=max(64, batch)), num_blocks=1024)
    prompts = random_prompts(tok, batch, prompt_len, seed=3)
    eng.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))   # warm-up
    eng.enqueue(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(warm):
        eng.step()
    return eng


def profile_decode(dtype: str, batch: int, prompt_len: int, steps: int, warm: int = 8,
                   decode_weights: str = "native") -> dict:
    from transformers import AutoTokenizer

    from embedserve.models.llama import LlamaModel
    from embedserve.models.registry import resolve_generate_model
    from embedserve.precision import cpu_flags, decoder_precision

    _, path = resolve_generate_model("SmolLM2-135M-Instruct")
    tok = AutoTokenizer.from_pretrained(str(path))
    tdtype = getattr(torch, decoder_precision(dtype, "cpu"))
    model = LlamaModel.from_dir(path, dtype=tdtype, linear_weights=decode_weights)
    # the prefill and `warm` decode steps unprofiled
    eng = decoding_engine(model, tok, batch, prompt_len, warm + steps + 1, warm)
    # unprofiled steady steps: the wall time per step without profiler overhead
    plain = []
    for _ in range(steps // 2):
        t0 = time.perf_counter()
        eng.step()
        plain.append(time.perf_counter() - t0)
    patches = _instrument(eng)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            walls = []
            for _ in range(steps - steps // 2):
                with torch.profiler.record_function("es::step"):
                    t0 = time.perf_counter()
                    eng.step()
                    walls.append(time.perf_counter() - t0)
    finally:
        _restore(patches)
    while eng.scheduler.has_work():
        eng.step()
    n = len(walls)
    events = prof.events()
    label_ms: dict[str, float] = defaultdict(float)
    for e in events:
        if e.name.startswith("es::"):
            label_ms[e.name] += (e.time_range.end - e.time_range.start) / 1e3 / n
    fam_ms, op_ms, op_calls = _ops_by_family(events, "es::forward", n)
    if label_ms["es::cpu_attention"]:
        fam_ms["attention (C kernel)"] = label_ms["es::cpu_attention"]
    if label_ms["es::fused_step"]:
        fam_ms["the layers in one C call (linears, attention, glue)"] = label_ms["es::fused_step"]
    step_ms = statistics.median(walls) * 1e3
    plain_ms = statistics.median(plain) * 1e3
    fwd = label_ms["es::forward"]
    ops_total = sum(fam_ms.values())
    fam_ms["Python and dispatch (forward wall − op self time)"] = max(fwd - ops_total, 0.0)
    run = label_ms["es::run"]
    phases = {
        "schedule": label_ms["es::schedule"],
        "prepare inputs": max(run - fwd - label_ms["es::logits"], 0.0),
        "forward": fwd,
        "logits (lm_head)": label_ms["es::logits"],
        "sample": label_ms["es::sample"],
        "postprocess (detokenize, stop checks, events)": max(
            label_ms["es::step"] - run - label_ms["es::schedule"] - label_ms["es::sample"], 0.0),
    }
    top = sorted(op_ms.items(), key=lambda kv: -kv[1])[:12]
    return {
        "what": f"decode step, {batch} sequences, prompt {prompt_len} tokens, {steps} steps profiled, {decode_weights} weights",
        "model": "SmolLM2-135M-Instruct", "dtype": str(tdtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx2"))),
        "step_ms_unprofiled": plain_ms, "step_ms_profiled": step_ms,
        "tokens_per_s_unprofiled": batch / (plain_ms / 1e3),
        "phases_ms": phases, "forward_ms": fam_ms,
        "top_ops_ms": [{"op": k, "ms": v, "calls_per_step": op_calls[k] / n} for k, v in top],
    }


def _ops_by_family(events, label: str, n: int) -> tuple[dict, dict, dict]:
    """Self time (ms per run) of the aten ops inside `label`'s ranges, by family and by op."""
    import bisect

    ranges = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == label)
    starts = [r[0] for r in ranges]
    fam_ms: dict[str, float] = defaultdict(float)
    op_ms: dict[str, float] = defaultdict(float)
    op_calls: dict[str, int] = defaultdict(int)
    for e in events:
        if e.name.startswith("es::"):
            continue
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        if i < 0 or not ranges[i][0] <= e.time_range.start <= ranges[i][1]:
            continue
        ms = e.self_cpu_time_total / 1e3 / n
        fam_ms[family(e.name)] += ms
        op_ms[e.name] += ms
        op_calls[e.name] += 1
    return fam_ms, op_ms, op_calls


def profile_embed(model_name: str, dtype: str, num_texts: int, repeats: int = 5) -> dict:
    from embedserve.api.embeddings import EmbeddingRequest, render_embeddings
    from embedserve.studies.compare import corpus
    from embedserve.engine.batch_queue import EmbedRequest
    from embedserve.models.embedding_model import EmbeddingModel
    from embedserve.models.encoder import AttentionPlan
    from embedserve.models.registry import resolve_model
    from embedserve.precision import cpu_flags

    name, path = resolve_model(model_name)
    model = EmbeddingModel(path, name=name, dtype=dtype)
    texts = corpus(num_texts, seed=11)
    want = {"dense"}

    def timed(fn, *a):
        times, out = [], None
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            out = fn(*a)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:]) * 1e3, out

    tok_ms, ids = timed(model.tokenize, texts)
    ids = [model.truncate(x) for x in ids]

    def pack(batch):
        order = sorted(range(len(batch)), key=lambda i: -len(batch[i]))
        lengths = [len(batch[i]) for i in order]
        plan = AttentionPlan.build(lengths)
        flat = torch.tensor([t for i in order for t in batch[i]], dtype=torch.long)
        pos = torch.cat([torch.arange(L) for L in lengths])
        return flat, pos, plan, lengths

    pack_ms, (flat, pos, plan, lengths) = timed(pack, ids)
    with torch.inference_mode():
        fwd_ms, h = timed(model.encoder, flat, pos, plan)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        pool_ms, _ = timed(model.pool, h, lengths, starts)
        embed_ms, (outs, computed) = timed(model.embed, ids, want)
        from kernels import cpu_attention
        patches: list = []
        _wrap(cpu_attention, "varlen_attention", "es::cpu_attention", patches)   # not aten ops
        _wrap(cpu_attention, "add_layer_norm", "es::cpu_add_layer_norm", patches)
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(repeats):
                    with torch.profiler.record_function("es::forward"):
                        model.encoder(flat, pos, plan)
        finally:
            _restore(patches)
    events = prof.events()
    fam_ms, op_ms, op_calls = _ops_by_family(events, "es::forward", repeats)
    for label, family in (("es::cpu_attention", "attention (C kernel)"),
                          ("es::cpu_add_layer_norm", "residual add + layer norm (C kernel)")):
        kernel_ms = sum(e.time_range.end - e.time_range.start for e in events if e.name == label) / 1e3 / repeats
        if kernel_ms:
            fam_ms[family] = kernel_ms
    # the remainder against the forward's wall time under the profiler (op self times are inflated by it)
    fwd_prof_ms = sum(e.time_range.end - e.time_range.start for e in events if e.name == "es::forward") / 1e3 / repeats
    fam_ms["Python and dispatch (forward wall − op self time)"] = max(fwd_prof_ms - sum(fam_ms.values()), 0.0)
    req = EmbedRequest(inputs=ids, want=frozenset(want), on_done=lambda r: None)
    req.outputs, req.num_tokens = outs, sum(lengths)
    json_float_ms, body = timed(render_embeddings, req, EmbeddingRequest(input=texts), name, [])
    json_b64_ms, body64 = timed(render_embeddings, req, EmbeddingRequest(input=texts, encoding_format="base64"), name, [])
    tokens = sum(lengths)
    phases = {"tokenize": tok_ms, "pack (sort, attention plan, tensors)": pack_ms, "forward": fwd_ms,
              "pooling + normalize": pool_ms,
              "JSON body, encoding_format=float": json_float_ms, "JSON body, encoding_format=base64": json_b64_ms}
    top = sorted(op_ms.items(), key=lambda kv: -kv[1])[:10]
    return {
        "what": f"embedding batch, {num_texts} texts, {tokens} tokens ({computed} computed with attention padding)",
        "model": name, "dtype": model.precision, "threads": torch.get_num_threads(),
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx2"))),
        "tokens": tokens, "forward_tokens_per_s": tokens / (fwd_ms / 1e3),
        "model_embed_ms": embed_ms, "body_bytes": {"float": len(body), "base64": len(body64)},
        "phases_ms": phases, "forward_ms": fam_ms,
        "top_ops_ms": [{"op": k, "ms": v, "calls_per_step": op_calls[k] / repeats} for k, v in top],
    }


def _forward_tables(res: dict, fwd: float, title: str, per: str) -> list[str]:
    """The forward by op family (share of `fwd`) and the top ops, as markdown rows."""
    lines = ["", f"| {title} | ms{per} | share of forward |", "|---|---|---|"]
    lines += [f"| {k} | {v:.2f} | {100 * v / fwd:.0f}% |"
              for k, v in sorted(res["forward_ms"].items(), key=lambda kv: -kv[1])]
    lines += ["", f"| top ops (self time) | ms{per} | calls{per} |", "|---|---|---|"]
    lines += [f"| `{o['op']}` | {o['ms']:.2f} | {o['calls_per_step']:.0f} |" for o in res["top_ops_ms"]]
    return lines


def render_embed(res: dict) -> str:
    total = sum(v for k, v in res["phases_ms"].items() if "base64" not in k)
    lines = [f"**{res['what']}**, {res['model']} {res['dtype']}, {res['threads']} threads: forward "
             f"{res['forward_tokens_per_s']:,.0f} tokens/s; the request path (float JSON) {total:.1f} ms.", "",
             "| phase | ms | share |", "|---|---|---|"]
    lines += [f"| {k} | {v:.2f} | {100 * v / total:.0f}% |" for k, v in res["phases_ms"].items()]
    lines += _forward_tables(res, sum(res["forward_ms"].values()), "inside forward (under the profiler)", "")
    return "\n".join(lines) + "\n"


def render(res: dict) -> str:
    step = res["step_ms_profiled"]
    lines = [f"**{res['what']}**, {res['model']} {res['dtype']}, {res['threads']} threads: "
             f"{res['step_ms_unprofiled']:.1f} ms/step unprofiled ({res['tokens_per_s_unprofiled']:.0f} tokens/s), "
             f"{step:.1f} ms profiled.", "", "| phase | ms/step | share |", "|---|---|---|"]
    lines += [f"| {k} | {v:.2f} | {100 * v / step:.0f}% |" for k, v in res["phases_ms"].items()]
    lines += _forward_tables(res, res["phases_ms"]["forward"], "inside forward", "/step")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m embedserve.studies.profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("decode", "embed", "served"))
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "int8"),
                    help="int8: embed only (the decoder has no int8 path)")
    ap.add_argument("--model", default="all-MiniLM-L6-v2", help="embed: the embedding model")
    ap.add_argument("--texts", type=int, default=64, help="embed: texts in the batch")
    ap.add_argument("--batch", type=int, default=16, help="decode: sequences in the batch")
    ap.add_argument("--decode-weights", default="native", choices=("native", "int8"),
                    help="decode: the linears' weights (int8: weight-only, embedserve.models.decode_int8)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.what == "embed":
        res = profile_embed(args.model, args.dtype, args.texts)
        text = render_embed(res)
    elif args.what == "served":
        res = profile_served(args.model, "float32" if args.dtype == "auto" else args.dtype)
        text = render_served(res)
    else:
        if args.dtype == "int8":
            ap.error("--dtype int8 applies to embed only (the decoder's int8 is --decode-weights int8)")
        res = profile_decode(args.dtype, args.batch, args.prompt_len, args.steps, decode_weights=args.decode_weights)
        text = render(res)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
