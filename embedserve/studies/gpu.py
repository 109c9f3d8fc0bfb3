"""What a lent CUDA GPU runs in one call: the kernel tests compiled, `python -m kernels.bench`, and
the encoder and the decoder on CUDA against their CPU numbers.

    python -m embedserve.studies.gpu pack --out .gpu-pack       # here: configs, tokenizers and tensor shapes
    python -m embedserve.studies.gpu run --pack .gpu-pack --out DIR   # on the GPU machine (~6 minutes)

The bundled models' weights (90-540 MB each) cannot travel to the lent machine (64 MiB a call),
so `pack` takes each model's directory without its weights plus the name, shape and dtype of
every tensor, and `run` fills those tensors with seeded random values (normal, std 0.02; norm
weights 1, biases 0). Speed depends on the shapes alone; the checks compare two paths on the
same weights (CUDA against the CPU, the Triton kernels against plain torch), so they say as much
as with the real weights. What the random weights cannot say: whether the answers are good.

`run`, each part in its own try (a failure is written down and the next part runs):

1. the GPU and its driver (`nvidia-smi`), torch, triton;
2. `pytest tests/test_kernels.py`, compiled (no TRITON_INTERPRET), its summary line;
3. `python -m kernels.bench --out DIR/kernels.json` (checks against kernels.reference, copy
   bandwidth, decode bandwidth per batch x context);
4. the encoders (all-MiniLM-L6-v2, multilingual-e5-small shapes): make bench's in-process
   workload (512 corpus texts in 4,096-token length-sorted batches), fp32 and bf16 on CUDA,
   tokens/s (median of 5 passes after a warm-up), and the vectors against fp32 on the CPU;
5. the decoder (SmolLM2-135M shapes), our DecodeEngine on CUDA: steady decode tokens/s at 1, 16
   and 64 sequences (128-token prompts) in bf16 and fp32, and greedy tokens of the Triton
   attention backend against the reference backend, and of CUDA against the CPU (fp32).

Writes DIR/gpu.json and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

MODELS = {"all-MiniLM-L6-v2": "encoder", "multilingual-e5-small": "encoder", "SmolLM2-135M-Instruct": "decoder"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".onnx")
ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda"                # `run --device cpu`: the same code on this machine, a dry run


def pack(out: Path, names=tuple(MODELS)) -> None:
    """Each model's directory without weights, plus shapes.json: {tensor: [shape, dtype]}."""
    from safetensors import safe_open

    from embedserve.models.registry import resolve_generate_model, resolve_model
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        kind = MODELS[name]
        _, src = (resolve_model if kind == "encoder" else resolve_generate_model)(name)
        dst = out / name
        shutil.rmtree(dst, ignore_errors=True)
        shapes = {}
        for f in sorted(Path(src).rglob("*")):
            rel = f.relative_to(src)
            if f.is_dir() or f.name.startswith(".") or f.name == "README.md":
                continue
            if f.suffix in WEIGHT_SUFFIXES:
                if f.suffix != ".safetensors":
                    raise SystemExit(f"{f}: only safetensors weights can be packed")
                with safe_open(str(f), framework="pt") as fh:
                    for k in fh.keys():
                        t = fh.get_slice(k)
                        shapes[k] = [list(t.get_shape()), t.get_dtype()]
                continue
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst / rel)
        (dst / "shapes.json").write_text(json.dumps({"kind": kind, "tensors": shapes}))
        print(f"{name}: {len(shapes)} tensors, {sum(p.stat().st_size for p in dst.rglob('*')) / 1e6:.1f} MB packed")


def materialize(packed: Path, dst: Path, seed: int = 0) -> Path:
    """A loadable model directory: the packed files and seeded random weights of the packed shapes."""
    import torch
    from safetensors.torch import save_file
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
              "I32": torch.int32}
    shutil.copytree(packed, dst, dirs_exist_ok=True)
    spec = json.loads((dst / "shapes.json").read_text())
    (dst / "shapes.json").unlink()
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for k, (shape, dt) in spec["tensors"].items():
        low = k.lower()
        if dt.startswith("I"):                                # buffers such as position_ids: 0, 1, 2, ...
            t = torch.arange(shape[-1]).expand(shape).clone() if shape else torch.tensor(0)
        elif low.endswith("bias") or low.endswith("beta"):
            t = torch.zeros(shape)
        elif "norm" in low and (low.endswith("weight") or low.endswith("gamma")):
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=g) * 0.02
        if dt not in dtypes:
            raise SystemExit(f"{k}: dtype {dt} is not one the pack knows ({', '.join(dtypes)})")
        tensors[k] = t.to(dtypes[dt]).contiguous()
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _sync():
    import torch
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def bench_encoder(path: Path, name: str) -> dict:
    import numpy as np
    import torch

    from embedserve.embedders import token_batches
    from embedserve.models.embedding_model import EmbeddingModel
    from embedserve.studies.compare.embeddings import corpus
    from embedserve.studies.compare.encoder_peers import BUDGET, N_TEXTS
    texts = corpus(N_TEXTS)
    cpu = EmbeddingModel(path, name=name, dtype="float32", device="cpu")
    ids = [cpu.truncate(x) for x in cpu.tokenize(texts)]
    order = sorted(ids, key=len, reverse=True)
    batches = [[order[i] for i in b] for b in token_batches([len(x) for x in order], BUDGET)]
    tokens = sum(len(x) for x in ids)
    ref = np.stack([o.dense for o in cpu.embed(batches[0], {"dense"})[0]])
    res: dict = {"workload": {"texts": len(texts), "tokens": tokens, "batches": len(batches), "budget": BUDGET}}
    for dtype in ("float32", "bfloat16"):
        model = EmbeddingModel(path, name=name, dtype=dtype, device=DEVICE)
        got = np.stack([o.dense for o in model.embed(batches[0], {"dense"})[0]])
        cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
        times = []
        for _ in range(6 if DEVICE == "cuda" else 2):
            _sync()
            t0 = time.perf_counter()
            for b in batches:
                model.embed(b, {"dense"})
            _sync()
            times.append(time.perf_counter() - t0)
        res[dtype] = {"tokens_per_s": tokens / statistics.median(times[1:]), "seconds": times[1:],
                      "vs_cpu_fp32": {"min_cosine": float(cos.min()), "max_abs": float(np.abs(got - ref).max())}}
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return res


def _greedy(model, tok, prompts, n: int) -> list[list[int]]:
    from embedserve.config import DecodeConfig
    from embedserve.engine.decode_engine import DecodeEngine
    from embedserve.engine.sequence import SamplingParams
    eng = DecodeEngine(model, tok, DecodeConfig(block_size=16, max_model_len=2048, max_num_batched_tokens=2048,
                                                max_num_seqs=64), num_blocks=256)
    return [s.completion_ids for s in eng.generate(prompts, SamplingParams(temperature=0, max_tokens=n,
                                                                           ignore_eos=True))]


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    firsts = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None) for s, t in zip(a, b)]
    return {"sequences": len(a), "equal": sum(f is None for f in firsts),
            "first_divergence": [f for f in firsts if f is not None]}


def profile_step(model, tok, batch: int, steps: int = 8) -> dict:
    """Where a steady decode step's wall time goes on this device: the engine's phases (profile.py's
    labels), the GPU's busy time (the kernels' summed durations), kernel launches and host syncs
    per step, and the host-side ops that cost most."""
    import torch
    from torch.autograd import DeviceType

    from embedserve.studies.profile import _instrument, _restore, decoding_engine
    eng = decoding_engine(model, tok, batch, 128, steps + 5 + 1, 4)
    patches = _instrument(eng)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    try:
        with torch.profiler.profile(activities=acts) as prof:
            _sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            _sync()
            wall = (time.perf_counter() - t0) / steps * 1e3
    finally:
        _restore(patches)
    while eng.scheduler.has_work():
        eng.step()
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    labels: dict[str, float] = {}
    for e in events:
        if e.name.startswith("es::"):
            labels[e.name] = labels.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 1e3 / steps
    host = sorted(((a.key, a.self_cpu_time_total / 1e3 / steps, a.count / steps) for a in prof.key_averages()
                   if a.device_type != DeviceType.CUDA), key=lambda r: -r[1])[:14]
    return {"batch": batch, "steps": steps, "step_ms_profiled": wall, "phases_ms": labels,
            "gpu_busy_ms_per_step": sum(e.time_range.end - e.time_range.start for e in kernels) / 1e3 / steps,
            "kernels_per_step": len(kernels) / steps,
            "host_syncs_per_step": sum(a.count for a in prof.key_averages()
                                       if "Synchronize" in a.key or a.key in ("aten::item", "aten::_local_scalar_dense"))
            / steps,
            "top_host_ops": [{"op": k, "self_ms_per_step": ms, "calls_per_step": n} for k, ms, n in host]}


def bench_decoder(path: Path) -> dict:
    import torch
    from transformers import AutoTokenizer

    from kernels import compute
    from embedserve.models.llama import LlamaModel
    from embedserve.studies.decode_bench import random_prompts
    from embedserve.studies.profile import decoding_engine
    tok = AutoTokenizer.from_pretrained(str(path))
    res: dict = {"prompt_len": 128, "steady_steps": 32}
    for dtype in (torch.bfloat16, torch.float32):
        model = LlamaModel.from_dir(path, dtype=dtype, device=DEVICE)
        rows = {}
        for batch in (1, 16, 64):
            eng = decoding_engine(model, tok, batch, 128, 32 + 4 + 1, 4)
            _sync()
            t0 = time.perf_counter()
            for _ in range(32):
                eng.step()
            _sync()
            dt = time.perf_counter() - t0
            while eng.scheduler.has_work():
                eng.step()
            rows[str(batch)] = {"tokens_per_s": batch * 32 / dt, "step_ms": dt / 32 * 1e3}
        res[str(dtype).removeprefix("torch.")] = rows
        if dtype == torch.bfloat16:
            res["profile_bfloat16"] = [profile_step(model, tok, b) for b in (1, 64)]
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    prompts = random_prompts(tok, 8, 48, seed=5)
    model = LlamaModel.from_dir(path, dtype=torch.float32, device=DEVICE)
    with compute.override(attention_backend="triton" if DEVICE == "cuda" else "reference"):   # no interpreter here
        triton_ids = _greedy(model, tok, prompts, 32)
    with compute.override(attention_backend="reference"):
        reference_ids = _greedy(model, tok, prompts, 32)
    del model
    cpu_ids = _greedy(LlamaModel.from_dir(path, dtype=torch.float32, device="cpu"), tok, prompts, 32)
    res["greedy_fp32_32_tokens"] = {"triton_vs_reference": _agreement(triton_ids, reference_ids),
                                    "cuda_triton_vs_cpu": _agreement(triton_ids, cpu_ids)}
    return res


def _part(res: dict, name: str, fn, out: Path) -> None:
    t0 = time.perf_counter()
    try:
        res[name] = fn()
    except Exception as exc:                                  # written down; the next part runs
        res[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    res[name]["seconds"] = time.perf_counter() - t0
    (out / "gpu.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {time.perf_counter() - t0:.0f} s"
          + (f" ERROR {res[name]['error']}" if "error" in res[name] else ""), flush=True)


def _subprocess(cmd: list[str], timeout: int, log: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        log.write_text(p.stdout + p.stderr)
        return {"command": " ".join(cmd), "rc": p.returncode, "tail": (p.stdout + p.stderr)[-1500:]}
    except subprocess.TimeoutExpired as exc:
        log.write_text(str(exc.stdout or "") + str(exc.stderr or ""))
        return {"command": " ".join(cmd), "rc": None, "error": f"timed out after {timeout} s"}


def device_facts() -> dict:
    import torch
    if DEVICE != "cuda":
        return {"gpu": None, "torch": torch.__version__}
    import triton
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True)
    return {"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
            "nvidia_smi": smi.stdout.strip(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0]}


def summary(res: dict) -> str:
    lines = [f"GPU: {res.get('device', {}).get('gpu')}"]
    for name in ("kernel_tests", "kernels_bench"):
        r = res.get(name, {})
        lines.append(f"{name}: rc={r.get('rc')} {r.get('error', '')} {r.get('tail', '').strip().splitlines()[-1:]}")
    for model in ("all-MiniLM-L6-v2", "multilingual-e5-small"):
        r = res.get(model, {})
        if "error" in r:
            lines.append(f"{model}: ERROR {r['error']}")
            continue
        for dt in ("float32", "bfloat16"):
            if dt in r:
                lines.append(f"{model} {dt}: {r[dt]['tokens_per_s']:,.0f} tokens/s, min cosine vs CPU fp32 "
                             f"{r[dt]['vs_cpu_fp32']['min_cosine']:.5f}")
    d = res.get("SmolLM2-135M-Instruct", {})
    if "error" in d:
        lines.append(f"decoder: ERROR {d['error']}")
    for dt in ("bfloat16", "float32"):
        if dt in d:
            lines.append(f"decoder {dt}: " + ", ".join(f"@{b} {r['tokens_per_s']:,.0f} tok/s ({r['step_ms']:.2f} ms)"
                                                         for b, r in d[dt].items()))
    for p in d.get("profile_bfloat16", []):
        lines.append(f"profile bf16 @{p['batch']}: step {p['step_ms_profiled']:.2f} ms, GPU busy "
                     f"{p['gpu_busy_ms_per_step']:.2f} ms, {p['kernels_per_step']:.0f} kernels, "
                     f"{p['host_syncs_per_step']:.0f} syncs; phases " + ", ".join(
                         f"{k[4:]} {v:.2f}" for k, v in p["phases_ms"].items()))
        lines.append("  host: " + ", ".join(f"{o['op']} {o['self_ms_per_step']:.2f} ms x{o['calls_per_step']:.0f}"
                                            for o in p["top_host_ops"][:8]))
    if "greedy_fp32_32_tokens" in d:
        lines.append(f"greedy fp32: {d['greedy_fp32_32_tokens']}")
    return "\n".join(lines)


def run(packed: Path, out: Path, skip: set[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "embedserve-gpu"
    res: dict = {"date": time.strftime("%Y-%m-%d"), "weights": "seeded random, the bundled models' shapes"}
    _part(res, "device", device_facts, out)
    if "tests" not in skip:
        _part(res, "kernel_tests", lambda: _subprocess(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py"], 300,
            out / "kernel_tests.log"), out)
    if "bench" not in skip:
        _part(res, "kernels_bench", lambda: _subprocess(
            [sys.executable, "-m", "kernels.bench", "--out", str(out / "kernels.json")], 300,
            out / "kernels_bench.log"), out)
    for name, kind in MODELS.items():
        if kind in skip:
            continue
        path = materialize(packed / name, work / name)
        _part(res, name, (lambda p=path, n=name: bench_encoder(p, n)) if kind == "encoder"
              else (lambda p=path: bench_decoder(p)), out)
    print(summary(res))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m embedserve.studies.gpu", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="here: the models without their weights, for the GPU machine")
    p.add_argument("--out", type=Path, default=Path(".gpu-pack"))
    r = sub.add_parser("run", help="on the GPU machine")
    r.add_argument("--pack", type=Path, default=Path(".gpu-pack"))
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-results")))
    r.add_argument("--skip", action="append", default=[], choices=("tests", "bench", "encoder", "decoder"))
    r.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the model parts here")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        pack(args.out)
        return 0
    import torch
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: `run` is for the lent GPU machine", file=sys.stderr)
        return 2
    return run(args.pack, args.out, set(args.skip))


if __name__ == "__main__":
    raise SystemExit(main())
