"""Which CPU path is faster on this machine, measured side by side in one run: the int8 matmuls
(`torch._int_mm`, fbgemm) against the packed fp32 linear at the encoder's shapes, the encoder's
varlen C attention kernel against per-sequence SDPA (alone and in the whole encoder, fp32), the
encoder in process in fp32 and int8 and with its GELU the other way (a oneDNN post-op, or in
place after the matmul: `linear.fused_activation_preferred` times the two at start), and the
decoder's step as it runs against the same step with its `gemv` (steps of up to 32 sequences)
replaced by the packed matmul and with its C glue kernels replaced by the torch ops (fp32, 1 and
16 sequences, alternated blocks of steps in one engine), and the engine's batched sampler against
the per-row sort sampler it replaced; and the bf16 decoder's step with its GEMV (AVX512-BF16)
against oneDNN op by op, at 1-8 sequences; and the bf16 encoder attention on AMX tiles against the vector
kernel (alone and in the bf16 encoders). The choices `embedserve.models.int8`,
`kernels.cpu_attention.varlen_preferred`, `cpu_attention.decoder_glue_supports`,
`GEMV_MAX_ROWS`, `GEMV_BF16_MAX_ROWS`, `cpu_attention.amx_attention_runs` and the GELU's make by CPU
rest on these numbers.

    python -m embedserve.studies.cpu_paths            # ~10 minutes on 2 AVX2 cores; prints a markdown table
    python -m embedserve.studies.cpu_paths --only sampler       # one section (seconds)
    python -m embedserve.studies.cpu_paths --only decoder_bf16  # ~2 minutes on 2 Zen 4 cores
    python -m embedserve.studies.cpu_paths --only attention_bf16  # ~1 minute on 2 AMX Xeon cores
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import torch

from . import write_results

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = ((2000, 384, 1152), (2000, 384, 1536), (2000, 1536, 384))      # MiniLM/e5: qkv, ffn up, ffn down


def _best_ms(fn, reps: int = 5) -> float:
    fn()
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def matmuls() -> list[dict]:
    from embedserve.models.int8 import Int8Linear
    from embedserve.models.linear import Linear
    out = []
    for T, K, N in SHAPES:
        g = torch.Generator().manual_seed(T + K + N)
        x, w, b = torch.randn(T, K, generator=g), 0.05 * torch.randn(N, K, generator=g), torch.randn(N, generator=g)
        gflop = 2 * T * K * N / 1e9
        fp32 = Linear(w, b)
        row = {"shape": f"{T}x{K}x{N}", "fp32_packed": gflop / _best_ms(lambda: fp32(x)) * 1e3}
        xq = torch.randint(-127, 128, (T, K), dtype=torch.int8, generator=g)
        wq = torch.randint(-127, 128, (K, N), dtype=torch.int8, generator=g)
        row["int_mm"] = gflop / _best_ms(lambda: torch._int_mm(xq, wq), reps=1) * 1e3
        fb = Int8Linear(w, b, torch.float32, kernel="fbgemm")
        row["fbgemm_int8_linear"] = gflop / _best_ms(lambda: fb(x)) * 1e3
        out.append(row)
    return out


def _varlen_case(nh: int, hd: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention sections' input: 64 packed sequences of 8-159 tokens, (qkv, cu_seqlens)."""
    g = torch.Generator().manual_seed(nh * hd)
    lens = torch.randint(8, 160, (64,), generator=g)
    cu = torch.zeros(65, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    return torch.randn(int(lens.sum()), 3 * nh * hd, generator=g).to(dtype), cu


def _encoder_workload(m: str, dtype: str):
    """The encoder sections' workload: model `m` in `dtype`, 160 texts of 4-43 sentences in
    length-sorted 4,096-token batches -> (model, batches, real tokens)."""
    from embedserve.embedders import token_batches
    from embedserve.models.embedding_model import EmbeddingModel
    from embedserve.models.registry import resolve_model
    texts = [("The river %d crosses the valley, " % i) * (4 + i % 40) for i in range(160)]
    name, path = resolve_model(m)
    model = EmbeddingModel(path, name=name, dtype=dtype)
    ids = sorted((model.truncate(x) for x in model.tokenize(texts)), key=len)
    batches = [[ids[i] for i in b] for b in token_batches([len(x) for x in ids], 4096)]
    return model, batches, sum(map(len, ids))


def attention() -> list[dict]:
    import torch.nn.functional as F

    from kernels import cpu_attention
    out = []
    if cpu_attention.available() is not None:
        return [{"not_run": cpu_attention.available()}]
    for nh, hd in ((12, 32), (6, 64)):
        qkv, cu = _varlen_case(nh, hd)

        def sdpa():
            for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
                q, k, v = qkv[s:e].view(e - s, 3, nh, hd).permute(1, 2, 0, 3)
                F.scaled_dot_product_attention(q[None], k[None], v[None])
        out.append({"heads": f"{nh} x {hd}", "tokens": len(qkv),
                    "c_kernel_ms": _best_ms(lambda: cpu_attention.varlen_attention(qkv, cu, nh, hd ** -0.5)),
                    "sdpa_per_sequence_ms": _best_ms(sdpa)})
    return out


def attention_bf16(rounds: int = 5) -> list[dict]:
    """bf16 encoder attention on AMX tiles against the vector C kernel (`amx_attention` off): the
    kernel alone on the `attention` section's sequences, and the bf16 encoders in process on
    `encoders`' texts in 4,096-token batches; the two sides alternated, medians of `rounds`."""
    from kernels import compute, cpu_attention
    if cpu_attention.available() is not None:
        return [{"not_run": cpu_attention.available()}]
    if not cpu_attention.amx_attention_runs(torch.zeros(1, 3 * 12 * 32, dtype=torch.bfloat16), 12):
        return [{"not_run": "no AMX-BF16 tiles here (the CPU's flags, or Linux refused them)"}]

    def alternated(fn) -> dict[bool, float]:
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for amx in (True, False):
                with compute.override(amx_attention=amx):
                    times[amx].append(fn())
        return {k: statistics.median(v) for k, v in times.items()}

    out = []
    for nh, hd in ((12, 32), (6, 64)):
        qkv, cu = _varlen_case(nh, hd, torch.bfloat16)
        ms = alternated(lambda: _best_ms(lambda: cpu_attention.varlen_attention(qkv, cu, nh, hd ** -0.5), reps=3))
        out.append({"case": f"kernel, {nh} x {hd} heads, {len(qkv)} tokens", "unit": "ms",
                    "amx": ms[True], "vector": ms[False], "speedup": ms[False] / ms[True]})
    for m in ("all-MiniLM-L6-v2", "multilingual-e5-small"):
        model, batches, tokens = _encoder_workload(m, "bfloat16")
        ms = alternated(lambda: _best_ms(lambda: [model.embed(b, {"dense"}) for b in batches], reps=2))
        out.append({"case": f"{m} bf16 encoder, {tokens} tokens", "unit": "tokens/s", "amx": tokens / ms[True] * 1e3,
                    "vector": tokens / ms[False] * 1e3, "speedup": ms[False] / ms[True]})
    return out


def encoders() -> list[dict]:
    from embedserve.models.encoder import load_encoder
    from kernels import cpu_attention
    out = []
    for m in ("all-MiniLM-L6-v2", "multilingual-e5-small"):
        model, batches, tokens = _encoder_workload(m, "float32")
        encs = {"float32": model.encoder, "int8": load_encoder(model.path, "int8")}
        row = {"model": m, "tokens": tokens,
               "attention": "C kernel" if cpu_attention.varlen_preferred() else "SDPA"}
        ups = [layer["ffn_up"] for layer in model.encoder.layers]
        row["gelu"] = "fused post-op" if ups[0].fused else "in place after the matmul"

        @contextlib.contextmanager
        def other_gelu():                             # the GELU choice `fused_activation_preferred` did not make
            for up in ups:
                up.fused = not up.fused
            try:
                yield
            finally:
                for up in ups:
                    up.fused = not up.fused

        sdpa = lambda: mock.patch.object(cpu_attention, "varlen_preferred", lambda: False)  # noqa: E731
        runs = (("float32", "float32", contextlib.nullcontext), ("int8", "int8", contextlib.nullcontext),
                ("float32_sdpa", "float32", sdpa), ("float32_other_gelu", "float32", other_gelu))
        for _ in range(2):                                           # alternated: the machine drifts
            for key, prec, context in runs:
                with context():
                    ms = _best_ms(lambda: [model.embed_with(encs[prec], b, {"dense"}) for b in batches], reps=3)
                row[key] = max(row.get(key, 0.0), tokens / ms * 1e3)
        row["int8_over_fp32"] = row["int8"] / row["float32"]
        row["kernel_over_sdpa_fp32"] = row["float32"] / row["float32_sdpa"]
        row["gelu_choice_over_other"] = row["float32"] / row["float32_other_gelu"]
        out.append(row)
    return out


# the decoder's CPU choices, each turned off alone against the path as it runs (glue + gemv)
DECODER_PATHS = ("as run", "packed matmul, no gemv", "torch ops, no glue")


def _alternated_steps(eng, patches: dict[str, tuple], rounds: int, steps: int) -> dict[str, float]:
    """Median ms per step of each side of `patches` (name -> the mock patches that make it), in
    alternated blocks of `steps` steps on one engine, then the engine stepped to its end."""
    names = list(patches)
    times = {name: [] for name in names}
    for r in range(rounds):
        name = names[r % len(names)]
        with contextlib.ExitStack() as stack:
            for p in patches[name]:
                stack.enter_context(p)
            for _ in range(steps):
                t0 = time.perf_counter()
                eng.step()
                times[name].append(time.perf_counter() - t0)
    while eng.scheduler.has_work():
        eng.step()
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def decoder(batches=(1, 16), rounds: int = 12, steps: int = 6) -> list[dict]:
    """ms per decode step of SmolLM2 in fp32 as it runs (the C glue kernels and, for steps of up to
    32 sequences, `gemv` on the row-major weights), with the packed matmul instead of `gemv`, and with
    the torch ops instead of the glue: alternated blocks of `steps` steps on one engine (the same
    sequences, the same KV cache)."""
    from transformers import AutoTokenizer

    from embedserve.studies.profile import decoding_engine
    from embedserve.models import linear
    from embedserve.models.llama import LlamaModel
    from embedserve.models.registry import resolve_generate_model
    from kernels import cpu_attention
    if cpu_attention.available() is not None:
        return [{"not_run": cpu_attention.available()}]
    _, path = resolve_generate_model("SmolLM2-135M-Instruct")
    tok = AutoTokenizer.from_pretrained(str(path))
    model = LlamaModel.from_dir(path, dtype=torch.float32)
    patches = {"as run": (), "packed matmul, no gemv": (mock.patch.object(linear, "GEMV_MAX_ROWS", 0),),
               "torch ops, no glue": (mock.patch.object(cpu_attention, "decoder_glue_supports", lambda x, k: False),)}
    out = []
    for batch in batches:
        eng = decoding_engine(model, tok, batch, 128, rounds * steps + 8, warm=4)
        ms = _alternated_steps(eng, patches, rounds, steps)
        out.append({"sequences": batch, "ms_per_step": ms,
                    "gemv_speedup": ms["packed matmul, no gemv"] / ms["as run"],
                    "glue_speedup": ms["torch ops, no glue"] / ms["as run"]})
    return out


BF16_PATHS = ("as run", "oneDNN per op", "GEMV up to 8 rows")


def decoder_bf16(batches=(1, 2, 4, 8), rounds: int = 12, steps: int = 6) -> list[dict]:
    """ms per decode step of SmolLM2 in bf16 as it runs (the bf16 GEMV and the one-call step for
    steps of up to GEMV_BF16_MAX_ROWS sequences), with oneDNN's packed matmul op by op instead (the
    path before), and with the GEMV and the one-call step taken up to 8 sequences: alternated
    blocks of `steps` steps on one engine. What GEMV_BF16_MAX_ROWS rests on; not run without the
    AVX512-BF16 GEMV."""
    from transformers import AutoTokenizer

    from embedserve.models import linear, llama
    from embedserve.models.llama import LlamaModel
    from embedserve.models.registry import resolve_generate_model
    from embedserve.studies.profile import decoding_engine
    why = linear.small_rows_kernel(torch.bfloat16)
    if why is not None:
        return [{"not_run": why}]
    _, path = resolve_generate_model("SmolLM2-135M-Instruct")
    tok = AutoTokenizer.from_pretrained(str(path))
    model = LlamaModel.from_dir(path, dtype=torch.bfloat16)
    limits = dict(zip(BF16_PATHS, (linear.GEMV_BF16_MAX_ROWS, 0, 8)))
    patches = {name: tuple(mock.patch.object(mod, "GEMV_BF16_MAX_ROWS", n) for mod in (linear, llama))
               for name, n in limits.items()}
    out = []
    for batch in batches:
        eng = decoding_engine(model, tok, batch, 128, rounds * steps + 8, warm=4)
        ms = _alternated_steps(eng, patches, rounds, steps)
        out.append({"sequences": batch, "ms_per_step": ms, "as_run_over_onednn": ms["oneDNN per op"] / ms["as run"],
                    "gemv8_over_onednn": ms["oneDNN per op"] / ms["GEMV up to 8 rows"],
                    "weight_gb_per_s_as_run": model.weight_bytes_per_step() / ms["as run"] / 1e6})
    return out


SAMPLER_CASES = {"greedy": {"temperature": 0}, "temperature 1.0": {"temperature": 1.0},
                 "top_p 0.9, T 0.7": {"temperature": 0.7, "top_p": 0.9},
                 "top_k 50, T 0.8": {"temperature": 0.8, "top_k": 50},
                 "top_p 0.95, seeded": {"temperature": 1.0, "top_p": 0.95, "seed": 1}}


def _per_row_sample(logits: torch.Tensor, seqs) -> list[int]:
    """The textbook sampler the engine's batched one replaced: per row, top-k by topk, top-p by a
    sort of the whole vocabulary, then `torch.multinomial` (the peer of `sampler()` below)."""
    out = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if 0 < p.top_k < row.shape[-1]:
            row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            sorted_p = sorted_p.masked_fill(sorted_p.cumsum(0) - sorted_p > p.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out[i] = int(torch.multinomial(probs, 1, generator=seq.generator).item())
    return out


def sampler(rows: int = 16, vocab: int = 49_152, reps: int = 30) -> list[dict]:
    """`engine.sampler.sample` (batched over the step's rows) against the per-row sort sampler, on
    (rows, vocab) logits (SmolLM2's vocabulary), medians of `reps` calls, interleaved."""
    from embedserve.engine.sampler import sample
    from embedserve.engine.sequence import SamplingParams, Sequence

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 6
    out = []
    for name, kw in SAMPLER_CASES.items():
        ours = [Sequence(i, [0], SamplingParams(**kw)) for i in range(rows)]
        peer = [Sequence(i, [0], SamplingParams(**kw)) for i in range(rows)]
        times: dict[str, list[float]] = {"batched": [], "per row": []}
        for _ in range(reps):
            for label, fn in (("batched", lambda: sample(logits, ours)), ("per row", lambda: _per_row_sample(logits, peer))):
                t0 = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - t0)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        out.append({"case": name, "rows": rows, "vocab": vocab, "batched_ms": ms["batched"],
                    "per_row_ms": ms["per row"], "speedup": ms["per row"] / ms["batched"]})
    return out


def markdown(res: dict) -> str:
    lines = [f"CPU {res['cpu']}, flags {', '.join(res['flags'])}, {res['threads']} threads "
             f"(`python -m embedserve.studies.cpu_paths`, {res['date']}).", ""]
    if res.get("matmuls"):
        lines += ["| linear (T x K x N) | fp32 packed GFLOP/s | `torch._int_mm` GOP/s | fbgemm int8 linear GFLOP/s |",
                  "|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['fp32_packed']:.0f} | {r['int_mm']:.1f} | {r['fbgemm_int8_linear']:.0f} |"
                  for r in res["matmuls"]]
    if res.get("attention"):
        lines += ["", "| encoder attention, 64 sequences of 8-159 tokens | C varlen kernel ms | per-sequence SDPA ms |",
                  "|---|---|---|"]
        lines += [f"| {r['heads']} heads, {r['tokens']} tokens | {r['c_kernel_ms']:.1f} | {r['sdpa_per_sequence_ms']:.1f} |"
                  if "not_run" not in r else f"| not run: {r['not_run']} | | |" for r in res["attention"]]
    if res.get("attention_bf16"):
        lines += ["", "| bf16 encoder attention | AMX tiles | vector kernel | AMX / vector |", "|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['amx']:,.1f} {r['unit']} | {r['vector']:,.1f} {r['unit']} | {r['speedup']:.2f}× |"
                  if "not_run" not in r else f"| not run: {r['not_run']} | | | |" for r in res["attention_bf16"]]
    if res.get("encoders"):
        lines += ["", "| encoder in process, 4,096-token batches | attention | GELU | fp32 tokens/s | int8 tokens/s | "
                  "int8 / fp32 | fp32 with SDPA tokens/s | kernel / SDPA | fp32 with the other GELU tokens/s | "
                  "GELU choice / other |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} ({r['tokens']} tokens) | {r['attention']} | {r['gelu']} | {r['float32']:.0f} | "
                  f"{r['int8']:.0f} | {r['int8_over_fp32']:.2f}× | {r['float32_sdpa']:.0f} | {r['kernel_over_sdpa_fp32']:.2f}× "
                  f"| {r['float32_other_gelu']:.0f} | {r['gelu_choice_over_other']:.2f}× |" for r in res["encoders"]]
    if res.get("decoder"):
        lines += ["", "| SmolLM2 decode step, fp32, 128-token prompts | as run (glue + gemv) ms/step | packed matmul "
                  "instead of gemv | torch ops instead of glue | gemv speedup | glue speedup |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['sequences']} sequences | " + " | ".join(f"{r['ms_per_step'][n]:.1f}" for n in DECODER_PATHS)
                  + f" | {r['gemv_speedup']:.2f}× | {r['glue_speedup']:.2f}× |" if "not_run" not in r
                  else f"| not run: {r['not_run']} | | | | | |" for r in res.get("decoder", [])]
    if res.get("decoder_bf16"):
        lines += ["", "| SmolLM2 decode step, bf16, 128-token prompts | as run ms/step | oneDNN per op | GEMV + one-call "
                  "step up to 8 rows | as run / oneDNN | GEMV 8 / oneDNN | weights GB/s as run |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['sequences']} sequences | " + " | ".join(f"{r['ms_per_step'][n]:.1f}" for n in BF16_PATHS)
                  + f" | {r['as_run_over_onednn']:.2f}× | {r['gemv8_over_onednn']:.2f}× | {r['weight_gb_per_s_as_run']:.1f} |"
                  if "not_run" not in r else f"| not run: {r['not_run']} | | | | | | |" for r in res["decoder_bf16"]]
    if res.get("sampler"):
        lines += ["", "| sampler, 16 x 49,152 logits | batched (engine) ms | per-row sort + multinomial ms | speedup |",
                  "|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['batched_ms']:.2f} | {r['per_row_ms']:.2f} | {r['speedup']:.2f}× |"
                  for r in res["sampler"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    from embedserve.models.int8 import int8_kernel
    from embedserve.precision import cpu_flags, cpu_model
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="result file [default: results/cpu_paths-<flags>.json]")
    ap.add_argument("--only", default=None, help="comma-separated sections to run (matmuls, attention, attention_bf16, encoders, "
                    "decoder, decoder_bf16, sampler) [default: all]")
    args = ap.parse_args(argv)
    sections = {"matmuls": matmuls, "attention": attention, "attention_bf16": attention_bf16, "encoders": encoders,
                "decoder": decoder,
                "decoder_bf16": decoder_bf16, "sampler": sampler}
    chosen = [x.strip() for x in args.only.split(",")] if args.only else list(sections)
    unknown = sorted(set(chosen) - set(sections))
    if unknown:
        ap.error(f"--only {','.join(unknown)}: choose from {', '.join(sections)}")
    warnings.filterwarnings("ignore")
    model, flags = cpu_model(), cpu_flags()
    shown = sorted(f for f in flags if f.startswith(("avx", "amx")))
    res = {"date": time.strftime("%Y-%m-%d"), "cpu": model, "flags": shown, "threads": torch.get_num_threads(),
           "int8_kernel_chosen": int8_kernel()}
    for name in chosen:
        res[name] = sections[name]()
    kind = "avx512" if "avx512f" in flags else "avx2"
    suffix = "" if not args.only else "-" + "-".join(chosen)
    out = Path(args.out) if args.out else RESULTS / f"cpu_paths-{kind}{suffix}.json"
    write_results(out, res, markdown(res))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
