"""`python -m embedserve.studies.row_buckets [--model M] [--dtype D]`: the encoder in process on
batches the way a server meets them (61 random texts each, so nearly every batch has a token
count not seen before) against the same batches repeated (what an in-process benchmark meets),
with the token rows bucketed (`--bucket-rows`, the default) and exact, alternated round by round.
oneDNN compiles a matmul primitive for each new row count; the repeated batches never pay it.
Writes results/row_buckets-<model>-<dtype>.{json,md}."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from . import write_results

RESULTS = Path(__file__).parent / "results"


def row_buckets(model_name: str, dtype: str, rounds: int = 4, per_batch: int = 61, batches: int = 12) -> dict:
    from embedserve.models.embedding_model import EmbeddingModel
    from embedserve.models.registry import resolve_model
    from embedserve.precision import cpu_flags
    from embedserve.studies import compare
    from kernels import compute
    name, path = resolve_model(model_name)
    model = EmbeddingModel(path, name=name, dtype=dtype)
    ids = [model.truncate(x) for x in model.tokenize(compare.corpus(768))]

    def shuffled(seed: int) -> list[list[list[int]]]:
        order = [ids[i] for i in np.random.default_rng(seed).permutation(len(ids))]
        return [order[i:i + per_batch] for i in range(0, per_batch * batches, per_batch)]

    def rate(bs) -> float:
        t = time.perf_counter()
        for b in bs:
            model.embed(b, {"dense"})
        return sum(len(x) for b in bs for x in b) / (time.perf_counter() - t)

    fixed, seed = shuffled(0), 100
    rates: dict[str, list[float]] = {}
    for _ in range(rounds):                                   # alternated: the machine's speed drifts
        for on in (True, False):
            with compute.override(bucket_rows=on):
                rate(fixed)                                   # this setting's shapes for `fixed` cached
                rates.setdefault(f"repeated, bucketed={on}", []).append(rate(fixed))
                seed += 1
                rates.setdefault(f"new batches, bucketed={on}", []).append(rate(shuffled(seed)))
    return {"model": name, "dtype": model.precision, "texts_per_batch": per_batch, "batches": batches,
            "rounds": rounds, "flags": sorted(f for f in cpu_flags() if f.startswith(("avx512_bf16", "amx", "avx2"))),
            "date": time.strftime("%Y-%m-%d"),
            "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()}, "per_round": rates}


def markdown(res: dict) -> str:
    lines = [f"{res['model']} {res['dtype']}, {res['batches']} batches of {res['texts_per_batch']} random texts, "
             f"medians of {res['rounds']} alternated rounds, flags {', '.join(res['flags'])} ({res['date']}).", "",
             "| batches | tokens/s |", "|---|---|"]
    lines += [f"| {k} | {v:,.0f} |" for k, v in res["tokens_per_s"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="all-MiniLM-L6-v2")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "int8"))
    args = ap.parse_args(argv)
    res = row_buckets(args.model, args.dtype)
    out = RESULTS / f"row_buckets-{args.model}-{args.dtype}.json"
    write_results(out, res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
