"""`python -m embedserve.studies.profile served`: our server under make bench's three embedding
workloads (1 text per request at 8 and 32 clients, 32 per request at 8), the load generator in
this process: the server's CPU by thread, the load generator's, the batches the engine formed and
the model's tokens/s inside them, beside the same model on batches of that size in process."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch


def _thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process `pid`."""
    import os
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue                                           # the thread ended
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _metric_sums(base: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    keep = ("embedserve_embed_batch_size_inputs_sum", "embedserve_embed_batch_size_inputs_count",
            "embedserve_embed_batch_size_tokens_sum", "embedserve_embed_batch_seconds_sum")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for sample in family.samples:
            if sample.name in keep:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def profile_served(model_name: str, dtype: str) -> dict:
    """Our server on 2 cores under the make-bench embedding workloads, each driven by the same load
    generator in this process: where the CPU goes (the server's event-loop thread, its two busiest
    other threads — the engine's and torch's OpenMP worker —, its other threads, the load
    generator) and how the model runs there (batches, inputs per batch, the engine's busy share,
    tokens/s inside the model under load) beside the same model on batches of that size in
    process, with nothing else running."""
    import os
    import subprocess
    import tempfile

    from embedserve.studies import compare
    from embedserve.models.embedding_model import EmbeddingModel
    from embedserve.models.registry import resolve_model
    name, path = resolve_model(model_name)
    texts = compare.corpus(768)
    data = compare.write_jsonl([{"text": t} for t in texts], Path(tempfile.mkdtemp()) / "corpus.jsonl")
    rows = []
    with compare.ours(model_name, dtype) as base:
        pid = int(subprocess.check_output(["pgrep", "-n", "-f", f"embedserve.cli serve --model {model_name}"]).split()[0])
        for label, per_req, conc, n in compare.EMBED_WORKLOADS:
            compare.drive("embed", base, name, data, "--batch-size", str(per_req), "--max-concurrency", str(conc),
                          "--num-requests", str(min(n, 48)), "--warmup", "0")                 # warm
            m0, t0, self0, w0 = _metric_sums(base), _thread_cpu(pid), sum(os.times()[:2]), time.perf_counter()
            runs = compare.drive("embed", base, name, data, "--batch-size", str(per_req), "--max-concurrency",
                                 str(conc), "--num-requests", str(n * 2), "--warmup", "0")
            wall = time.perf_counter() - w0
            m1, t1, self1 = _metric_sums(base), _thread_cpu(pid), sum(os.times()[:2])
            d = {k: m1[k] - m0.get(k, 0.0) for k in m1}
            cpu = {tid: t1[tid] - t0.get(tid, 0.0) for tid in t1}
            busiest = sorted((c for tid, c in cpu.items() if tid != pid), reverse=True)
            batches = d["embedserve_embed_batch_size_inputs_count"]
            rows.append({"workload": label, "texts_per_s": runs[0]["metrics"]["request_throughput"] * per_req,
                         "batches": batches, "inputs_per_batch": d["embedserve_embed_batch_size_inputs_sum"] / batches,
                         "tokens_per_batch": d["embedserve_embed_batch_size_tokens_sum"] / batches,
                         "engine_busy": d["embedserve_embed_batch_seconds_sum"] / wall,
                         "model_tokens_per_s_under_load": d["embedserve_embed_batch_size_tokens_sum"]
                         / d["embedserve_embed_batch_seconds_sum"],
                         "cores": {"event loop (main thread)": cpu.get(pid, 0.0) / wall,
                                   "engine + OpenMP worker (2 busiest)": sum(busiest[:2]) / wall,
                                   "other server threads": sum(busiest[2:]) / wall,
                                   "load generator": (self1 - self0) / wall}})
    # the same model on batches of the sizes the server formed, in process, nothing else running:
    # the whole corpus in random batches, one pass untimed (the server had met its batch sizes'
    # row buckets, and oneDNN's primitives for them, long before), then the median of 3 passes,
    # with the server's malloc settings (`--keep-freed-memory`: else each batch page-faults in
    # its activations afresh, ~15 % slower here)
    from embedserve.engine.malloc_tuning import keep_freed_memory
    keep_freed_memory()
    model = EmbeddingModel(path, name=name, dtype=dtype)
    ids = [model.truncate(x) for x in model.tokenize(texts)]
    rng = np.random.default_rng(0)
    for row in rows:
        k = max(1, round(row["inputs_per_batch"]))
        order = [ids[i] for i in rng.permutation(len(ids))]
        batches = [order[i:i + k] for i in range(0, len(order), k)]
        tokens = sum(len(x) for x in order)
        rates = []
        for _ in range(4):
            t = time.perf_counter()
            for b in batches:
                model.embed(b, {"dense"})
            rates.append(tokens / (time.perf_counter() - t))
        row["model_tokens_per_s_alone"] = float(np.median(rates[1:]))
    return {"what": "embeddings over HTTP, where the 2 cores go", "model": name, "dtype": dtype,
            "threads": torch.get_num_threads(), "workloads": rows}


def render_served(res: dict) -> str:
    keys = list(res["workloads"][0]["cores"])
    lines = [f"**{res['what']}**, {res['model']} {res['dtype']}, {res['threads']} threads "
             "(cores: CPU seconds per wall second).", "",
             "| workload | texts/s | inputs / batch | engine busy | model tokens/s under load | alone, same batch size | "
             + " | ".join(keys) + " |", "|---|---|---|---|---|---|" + "---|" * len(keys)]
    for r in res["workloads"]:
        lines.append(f"| {r['workload']} | {r['texts_per_s']:.0f} | {r['inputs_per_batch']:.1f} | "
                     f"{100 * r['engine_busy']:.0f} % | {r['model_tokens_per_s_under_load']:,.0f} | "
                     f"{r['model_tokens_per_s_alone']:,.0f} | " + " | ".join(f"{r['cores'][k]:.2f}" for k in keys) + " |")
    return "\n".join(lines) + "\n"
