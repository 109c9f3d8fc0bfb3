"""`make bench`'s embeddings: our server and infinity-emb under the same three workloads and a
Poisson sweep, sentence-transformers offline, and the encoder in process against transformers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import httpx
import numpy as np

from .ceiling import ceiling_shape, matmul_flops
from .peers import EMBED_MODELS, drive, infinity, log, med, ours, peer_missing, peer_precision, write_jsonl


def corpus(n: int, seed: int = 0) -> list[str]:
    """Mixed-length English and Chinese paragraphs (a log-normal mix, median ≈ 40 words)."""
    rng = np.random.default_rng(seed)
    en = ("the index stores passages and the service embeds queries so that retrieval finds the closest "
          "documents about rivers cities history science music software databases and the weather in "
          "spring when the trains run late and the markets open early").split()
    zh = list("检索系统把文档切成段落并用向量表示查询找到最相近的内容城市历史科学音乐软件数据库天气")
    out = []
    for i in range(n):
        k = int(np.clip(rng.lognormal(np.log(40), 0.8), 3, 300))
        out.append(" ".join(rng.choice(en, size=k)) if i % 4 else "".join(rng.choice(zh, size=k)))
    return out



EMBED_WORKLOADS = (("1 text/request, 8 clients", 1, 8, 192), ("1 text/request, 32 clients", 1, 32, 192),
                   ("32 texts/request, 8 clients", 32, 8, 12))


def embed_served(system: str, base: str, model: str, data: Path, runs: int) -> dict:
    """The three fixed workloads, `runs` times each; medians of texts/s and p50/p99 latency."""
    out = {}
    for label, per_req, conc, n in EMBED_WORKLOADS:
        rs = []
        for _ in range(runs):
            rs += drive("embed", base, model, data, "--batch-size", str(per_req), "--max-concurrency", str(conc),
                        "--num-requests", str(n), "--warmup", str(min(conc, n)))
        out[label] = {"texts_per_s": med([r["metrics"]["request_throughput"] * per_req for r in rs]),
                      "tokens_per_s": med([r["metrics"]["input_token_throughput"] for r in rs]),
                      "p50_ms": med([r["metrics"]["e2e_latency_ms"]["p50"] for r in rs]),
                      "p99_ms": med([r["metrics"]["e2e_latency_ms"]["p99"] for r in rs]),
                      "failed": sum(r["metrics"]["failed"] for r in rs)}
        log(f"  {system} {label}: {out[label]['texts_per_s']:.0f} texts/s, p99 {out[label]['p99_ms']:.0f} ms")
    return out


def _served_pass(base: str, model: str, data: Path, n_texts: int) -> float:
    """One pass of the 32 texts/request × 8 clients workload over the corpus's first `n_texts` texts
    (the in-process texts); input tokens/s."""
    _, per_req, conc, _ = EMBED_WORKLOADS[2]
    r, = drive("embed", base, model, data, "--batch-size", str(per_req), "--max-concurrency", str(conc),
               "--num-requests", str(n_texts // per_req), "--warmup", "0")
    return r["metrics"]["input_token_throughput"]


def embed_sweep(base: str, model: str, data: Path, saturation: float) -> list[dict]:
    """Poisson arrivals (1 text per request) at fractions of the measured saturation rate."""
    rates = [round(saturation * f, 1) for f in (0.25, 0.5, 0.75, 1.0, 1.25)]
    rs = drive("embed", base, model, data, "--batch-size", "1", "--num-requests", "128", "--warmup", "16",
               "--max-concurrency", "256", "--sweep", "rate=" + ",".join(map(str, rates)))
    return [{"rate": r["request_rate"], "texts_per_s": r["metrics"]["request_throughput"],
             "p50_ms": r["metrics"]["e2e_latency_ms"]["p50"], "p99_ms": r["metrics"]["e2e_latency_ms"]["p99"],
             "failed": r["metrics"]["failed"]} for r in rs]


def st_offline(path: Path, dtype: str, texts: list[str], runs: int) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(str(path), device="cpu")
    if dtype == "bfloat16":
        st = st.to(torch.bfloat16)
    st.encode(texts[:64], batch_size=32)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        st.encode(texts, batch_size=32)
        times.append(time.perf_counter() - t0)
    return {"texts_per_s": len(texts) / med(times)}


def encoder_in_process(path: Path, name: str, dtype: str, texts: list[str], runs: int,
                       served: Callable[[], float] | None = None) -> dict:
    """Encoder alone, in process, same texts and precision: ours (length-sorted batches under a
    4,096-token budget, as the server forms them) vs Hugging Face transformers' AutoModel
    (length-sorted batches of 32, padded per batch, SDPA), timed alternately. Tokens/s of real
    tokens, medians. `served`, where given, is one pass of our (idle) server over the same texts
    returning its tokens/s: it takes its turn in the same rounds, so the server's share of in
    process compares passes seconds apart, not blocks minutes apart."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from embedserve.embedders import token_batches
    from embedserve.models.embedding_model import EmbeddingModel
    ours_model = EmbeddingModel(path, name=name, dtype=dtype)
    ids = [ours_model.truncate(x) for x in ours_model.tokenize(texts)]
    tokens = sum(len(x) for x in ids)
    order = sorted(ids, key=len, reverse=True)
    batches = [[order[i] for i in b] for b in token_batches([len(x) for x in order], 4096)]

    def run_ours():
        for b in batches:
            ours_model.embed(b, {"dense"})

    # transformers in the precision our activations run in (int8's are bf16 only where bf16 is fast)
    tdtype = torch.bfloat16 if ours_model.precision != "float32" and peer_precision() == "bfloat16" else torch.float32
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModel.from_pretrained(str(path), dtype=tdtype, attn_implementation="sdpa").eval()
    sorted_texts = [texts[i] for i in sorted(range(len(texts)), key=lambda i: -len(ids[i]))]
    enc = [tok(sorted_texts[i:i + 32], padding=True, truncation=True, max_length=512, return_tensors="pt")
           for i in range(0, len(texts), 32)]

    def run_hf():
        with torch.inference_mode():
            for e in enc:
                hf(**e)

    out = {}
    sides = (("ours", run_ours), ("transformers", run_hf))
    for _, fn in sides:
        fn()                                                      # warm-up
    # alternated, ours then transformers (then the server), `runs` + 2 times: the machine's speed
    # drifts by 10-25 % within minutes, and one side timed in a block of its own would take a slow
    # phase alone
    times: dict[str, list[float]] = {label: [] for label, _ in sides}
    served_rates, shares = [], []
    for _ in range(runs + 2):
        for label, fn in sides:
            t0 = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t0)
        if served is not None:
            served_rates.append(served())
            shares.append(served_rates[-1] / (tokens / times["ours"][-1]))
    for label, _ in sides:
        out[label] = {"tokens_per_s": tokens / med(times[label])}
    if served is not None:
        out["served"] = {"tokens_per_s": med(served_rates), "share_of_in_process": med(shares),
                         "shares": shares}
    out["precision"] = {"ours": ours_model.precision, "transformers": str(tdtype).removeprefix("torch.")}
    out["texts"] = len(texts)
    out["ratio"] = out["ours"]["tokens_per_s"] / out["transformers"]["tokens_per_s"]
    log(f"  in process {out['precision']}: ours {out['ours']['tokens_per_s']:.0f} tokens/s, transformers "
        f"{out['transformers']['tokens_per_s']:.0f} ({out['ratio']:.2f}x)")
    return out


def bench_embeddings(runs: int, work: Path) -> dict:
    from embedserve.models.registry import resolve_model
    texts = corpus(768)
    data = write_jsonl([{"text": t} for t in texts], work / "corpus.jsonl")
    result = {}
    for model in EMBED_MODELS:
        name, path = resolve_model(model)
        res: dict = {"ours": {}, "infinity": {}, "sentence_transformers": {}, "sweep": {}, "in_process": {}}
        for dtype in ("auto", "float32"):
            if dtype == "float32" and "float32" in res["ours"]:
                break                                     # auto picked fp32 here: run once
            with ours(model, dtype) as base:
                resolved = httpx.get(base + "/v1/models").json()["data"][0]["dtype"]
                key = "float32" if resolved == "float32" else f"best ({resolved})"
                res["ours"][key] = embed_served(f"embedserve {resolved}", base, name, data, runs)
                if dtype == "auto":
                    sat = res["ours"][key]["1 text/request, 32 clients"]["texts_per_s"]
                    res["sweep"]["ours"] = embed_sweep(base, name, data, sat)
                # the encoder in process and the matmul rate right after the served runs of the same
                # precision, the server (idle meanwhile) taking its turn in the in-process rounds on
                # the same texts, the whole corpus (a pass of ~1 s on each side: passes of its first
                # 384 texts, ~0.5 s, moved the server's share by up to ±20 % from round to round):
                # this shared machine's speed moves by 10-15 % within minutes, and these three are
                # compared with one another (server share, fraction of the ceiling)
                ip_key = "float32" if resolved == "float32" else "auto"
                res["in_process"][ip_key] = encoder_in_process(
                    path, name, dtype, texts, runs, served=lambda: _served_pass(base, name, data, len(texts)))
            prec = res["in_process"][ip_key]["precision"]["ours"]
            shape = ceiling_shape(path)
            res["in_process"][ip_key]["matmul_shape"] = list(shape)
            res["in_process"][ip_key]["matmul_gflops"] = matmul_flops(prec, shape) / 1e9
            # the 2048^3 square earlier runs used as the ceiling, beside it for comparison
            res["in_process"][ip_key]["square_matmul_gflops"] = matmul_flops(prec, (2048, 2048, 2048)) / 1e9
            log(f"  matmul {prec}: {res['in_process'][ip_key]['matmul_gflops']:.0f} GFLOP/s at {shape}, "
                f"{res['in_process'][ip_key]['square_matmul_gflops']:.0f} at 2048^3")
        best = peer_precision()
        peer_dtypes = ("float32", best) if best != "float32" else ("float32",)
        missing = peer_missing("infinity")
        for dtype in peer_dtypes:
            if missing:
                res["infinity"] = {"not_run": missing}
                break
            with infinity(path, name, dtype) as base:
                key = "float32" if dtype == "float32" else f"best ({dtype})"
                res["infinity"][key] = embed_served(f"infinity {dtype}", base, name, data, runs)
                if dtype == best:
                    sat = res["infinity"][key]["1 text/request, 32 clients"]["texts_per_s"]
                    res["sweep"]["infinity"] = embed_sweep(base, name, data, sat)
        for dtype in peer_dtypes:
            key = "float32" if dtype == "float32" else f"best ({dtype})"
            res["sentence_transformers"][key] = st_offline(path, dtype, texts[:384], runs)
            log(f"  sentence-transformers {dtype}: {res['sentence_transformers'][key]['texts_per_s']:.0f} texts/s")
        result[model] = res
    return result
