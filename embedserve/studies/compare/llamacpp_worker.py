"""Run by the llama.cpp peer venv's python (.bench-peers/llamacpp), never imported by embedserve:
llama-cpp-python and the standard library only. `python llamacpp_worker.py REQUEST.json RESULT.json`
with REQUEST one of

  {"quantize": {"src": GGUF, "dst": GGUF, "ftype": "Q8_0", "threads": 2}}
      llama.cpp's own quantizer (`llama_model_quantize`, allow_requantize: the source may be
      quantized already); RESULT: the output file's type and size
  {"bench": {"gguf": GGUF, "prompt": [ids], "new_tokens": 128, "runs": 3, "threads": 2}}
      single-stream greedy generation, one warm-up then `runs` timed runs; RESULT: each run's
      time to the first token, its decode time, llama.cpp's own prompt-eval / eval timers and
      the generated ids, and the model's file type

The token loop is `Llama.generate` (what `create_completion` iterates), temperature 0 (llama.cpp's
greedy sampler), repeat_penalty 1, the prompt given as token ids (no BOS added, none tokenized
here). `generate` itself never stops at an end-of-generation token (`create_completion` does, by
`llama_vocab_is_eog`), so an EOS that greedy picks is fed back and decoding goes on, as ours does
under `ignore_eos`: no logit_bias is needed, and none of create_completion's per-token
detokenization is timed. Each run starts from an empty context (`reset()`: llama-cpp-python
would otherwise reuse the KV of a matching prefix), so the prompt is evaluated every time.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import llama_cpp


def ftype_name(ftype: int) -> str:
    names = {v: k[len("LLAMA_FTYPE_"):] for k, v in vars(llama_cpp).items()
             if k.startswith("LLAMA_FTYPE_") and isinstance(v, int)}
    return names.get(ftype, str(ftype))


def describe(model) -> dict:
    buf = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, buf, len(buf))
    return {"ftype": ftype_name(llama_cpp.llama_model_ftype(model)), "desc": buf.value.decode(),
            "size_bytes": int(llama_cpp.llama_model_size(model)), "params": int(llama_cpp.llama_model_n_params(model))}


def quantize(src: str, dst: str, ftype: str, threads: int) -> dict:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = threads
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {ftype}) returned {rc}")
    return {"seconds": time.perf_counter() - t0}


def one_run(llm, prompt: list[int], new_tokens: int) -> dict:
    llm.reset()
    llama_cpp.llama_perf_context_reset(llm.ctx)
    gen = llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True)
    t0 = time.perf_counter()
    out = [next(gen)]                       # the prompt evaluated and the first token sampled
    t1 = time.perf_counter()
    for tok in gen:                         # each: the previous token evaluated, this one sampled
        out.append(tok)
        if len(out) == new_tokens:
            break
    t2 = time.perf_counter()
    gen.close()
    perf = llama_cpp.llama_perf_context(llm.ctx)
    assert perf.n_p_eval == len(prompt) and perf.n_eval == new_tokens - 1, (perf.n_p_eval, perf.n_eval)
    return {"ttft_s": t1 - t0, "decode_s": t2 - t1, "prompt_eval_ms": perf.t_p_eval_ms, "eval_ms": perf.t_eval_ms,
            "n_prompt_eval": perf.n_p_eval, "n_eval": perf.n_eval, "ids": out}


def bench(gguf: str, prompt: list[int], new_tokens: int, runs: int, threads: int) -> dict:
    n_ctx = max(512, -(-(len(prompt) + new_tokens) // 256) * 256)
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    assert len(prompt) + new_tokens <= llm.n_ctx()
    one_run(llm, prompt, new_tokens)                                        # warm-up
    rs = [one_run(llm, prompt, new_tokens) for _ in range(runs)]
    ids = [r.pop("ids") for r in rs][-1]
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return {"model": describe(llm.model), "llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode().strip(), "n_threads": threads,
            "n_batch": llm.n_batch, "n_ctx": llm.n_ctx(), "runs": rs, "ids": ids,
            "eos_in_output": sum(bool(llama_cpp.llama_vocab_is_eog(vocab, t)) for t in ids)}


def main(argv: list[str]) -> int:
    req_path, out_path = argv
    with open(req_path) as f:
        req = json.load(f)
    if "quantize" in req:
        q = req["quantize"]
        res = quantize(q["src"], q["dst"], q["ftype"], q["threads"])
    else:
        b = req["bench"]
        res = bench(b["gguf"], b["prompt"], b["new_tokens"], b["runs"], b["threads"])
    with open(out_path, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
