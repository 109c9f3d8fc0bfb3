"""`python -m embedserve.studies.tokenize_bench [--model M] [--dtype D]`: what tokenizing costs.

In process: CPU milliseconds per request of 32 texts (make bench's corpus, English and Chinese)
for `tokenizers`' encode_batch (what the server ran before), its encode_batch_fast, and the
model's `tokenize` (the C WordPiece of kernels/cpu_wordpiece.py for ASCII and Chinese texts where the model
has a WordPiece tokenizer, encode_batch_fast for the rest), alternated round by round, medians.

Served: our server at 32 texts/request × 8 clients over the corpus, sent as text and as the same
texts' token ids (tokenized by the client: the server then tokenizes nothing), the two passes
alternated on one server, so the machine's drift falls on both alike; ids/text is what
tokenizing costs the server. Once with `--no-fast-tokenizer`, once with the default.
Writes results/tokenize_bench-<model>-<dtype>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from . import write_results

RESULTS = Path(__file__).parent / "results"
PER_REQUEST, CLIENTS = 32, 8


def in_process(path: Path, name: str, texts: list[str], rounds: int) -> dict:
    from tokenizers import Tokenizer

    from embedserve.models.embedding_model import EmbeddingModel
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    model = EmbeddingModel(path, name=name, dtype="float32")
    chunks = [texts[i:i + PER_REQUEST] for i in range(0, len(texts), PER_REQUEST)]
    ref = [[e.ids for e in tok.encode_batch(c)] for c in chunks]
    assert [model.tokenize(c) for c in chunks] == ref, "the model's ids differ from tokenizers'"
    sides = {"tokenizers encode_batch": lambda c: tok.encode_batch(c),
             "tokenizers encode_batch_fast": lambda c: tok.encode_batch_fast(c),
             "embedserve (model.tokenize)": model.tokenize}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    wall: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(rounds):
        for label, fn in sides.items():
            c0, w0 = time.process_time(), time.perf_counter()
            for c in chunks:
                fn(c)
            cpu[label].append((time.process_time() - c0) / len(chunks) * 1e3)
            wall[label].append((time.perf_counter() - w0) / len(chunks) * 1e3)
    return {"fast_tokenizer": model.fast_tokenizer is not None,
            "cpu_ms_per_request": {k: statistics.median(v) for k, v in cpu.items()},
            "wall_ms_per_request": {k: statistics.median(v) for k, v in wall.items()}}


async def _pass(url: str, name: str, inputs: list) -> float:
    """One pass over `inputs`, 32 per request from 8 clients; input tokens/s (the server's usage)."""
    import aiohttp
    import orjson
    requests = [inputs[i:i + PER_REQUEST] for i in range(0, len(inputs), PER_REQUEST)]
    tokens = 0
    async with aiohttp.ClientSession() as session:
        async def client():
            nonlocal tokens
            while requests:
                body = orjson.dumps({"input": requests.pop(), "model": name})
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    raw = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{r.status}: {raw[:300]!r}")
                    tokens += orjson.loads(raw)["usage"]["prompt_tokens"]
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(CLIENTS)))
        return tokens / (time.perf_counter() - t0)


def served(model: str, path: Path, name: str, dtype: str, texts: list[str], rounds: int) -> dict:
    from tokenizers import Tokenizer

    from embedserve.studies.compare import ours
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    out = {}
    for label, extra in (("--no-fast-tokenizer", ("--no-fast-tokenizer",)), ("default", ())):
        with ours(model, dtype, extra=extra) as base:
            url = base + "/v1/embeddings"
            asyncio.run(_pass(url, name, texts))                            # warm-up, both kinds
            asyncio.run(_pass(url, name, ids))
            rates: dict[str, list[float]] = {"text": [], "token ids": []}
            for r in range(rounds):
                for kind in (("text", "token ids") if r % 2 == 0 else ("token ids", "text")):
                    rates[kind].append(asyncio.run(_pass(url, name, texts if kind == "text" else ids)))
            ratios = [t / i for t, i in zip(rates["text"], rates["token ids"])]
            out[label] = {"text_tokens_per_s": statistics.median(rates["text"]),
                          "ids_tokens_per_s": statistics.median(rates["token ids"]),
                          "text_over_ids": statistics.median(ratios), "per_round": ratios}
    return out


def tokenize_bench(model: str, dtype: str, rounds: int = 7) -> dict:
    from embedserve.models.registry import resolve_model
    from embedserve.precision import cpu_flags
    from embedserve.studies import compare
    name, path = resolve_model(model)
    texts = compare.corpus(768)
    return {"model": name, "dtype": dtype, "texts": len(texts), "rounds": rounds, "date": time.strftime("%Y-%m-%d"),
            "flags": sorted(f for f in cpu_flags() if f.startswith(("avx512_bf16", "amx_bf16", "avx2"))),
            "in_process": in_process(path, name, texts, rounds),
            "served": served(model, path, name, dtype, texts, rounds)}


def markdown(res: dict) -> str:
    ip = res["in_process"]
    lines = [f"{res['model']}, make bench's {res['texts']} texts (English and Chinese), 32 per request, medians of "
             f"{res['rounds']} alternated rounds, flags {', '.join(res['flags'])} ({res['date']}).", "",
             "| tokenizer, in process | CPU ms / request | wall ms / request |", "|---|---|---|"]
    lines += [f"| {k} | {v:.2f} | {ip['wall_ms_per_request'][k]:.2f} |" for k, v in ip["cpu_ms_per_request"].items()]
    lines += ["", f"Served ({res['dtype']}, 8 clients): the same texts as text and as token ids, alternated on one server.", "",
              "| server | text tokens/s | token ids tokens/s | text / ids (median of rounds) |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['text_tokens_per_s']:,.0f} | {v['ids_tokens_per_s']:,.0f} | {v['text_over_ids']:.3f} |"
              for k, v in res["served"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="all-MiniLM-L6-v2")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "int8", "auto"))
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    res = tokenize_bench(args.model, args.dtype, args.rounds)
    out = RESULTS / f"tokenize_bench-{args.model}-{args.dtype}.json"
    write_results(out, res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
