"""`embedserve bench embed | generate`: a load generator shaped like `vllm bench serve`.

It speaks only the public OpenAI-compatible HTTP API, so one command measures this server and its
peers alike (vLLM's OpenAI server, infinity-emb, text-embeddings-inference):

    embedserve bench embed --model multilingual-e5-small --num-requests 200 --request-rate 20
    embedserve bench generate --model SmolLM2-135M-Instruct --input-len 128 --output-len 64 \\
        --ignore-eos --sweep concurrency=1,4,16 --out gen.json --plot gen.png

Arrivals: requests are sent at --request-rate with gamma inter-arrival times (shape =
--burstiness, mean 1/rate; burstiness 1 is a Poisson process, below 1 burstier, above 1 steadier),
as vLLM does; `inf` sends them all at once. --max-concurrency caps the requests in flight and
nothing else: the arrival schedule does not wait for it.

Before measuring, one probe request (a bad --model, --endpoint or --api-key stops the run here with
the server's message) and then --warmup requests are sent and awaited; neither is counted.

Token counts come from the server's `usage` (prompt_tokens, completion_tokens): the random dataset
draws real words (English, some Chinese) only to land near --input-len tokens (within ~15% on
XLM-R's SentencePiece and on GPT-2-style byte-level BPE).
A stream without usage counts one output token per text chunk.

Latencies are over the completed requests. Percentiles interpolate linearly between the closest
ranks: p = xs[k] + (xs[k+1] - xs[k]) * f with k + f = (n - 1) * p / 100 on the sorted values
(numpy's default method `linear`, Hyndman & Fan type 7). TTFT: send to the first chunk with text;
ITL: every gap between consecutive text chunks, pooled over requests; TPOT per request:
(e2e - TTFT) / (output tokens - 1). Failures are counted by HTTP status, `connection` for
transport errors and timeouts, `stream` for a stream that ends in an error or without [DONE],
`invalid` for a 200 whose body cannot be read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path

from ..errors import ConfigError
from .client import parse_sweep, run_all
from .report import format_table, machine_info, new_figure, plot_runs
from .workload import (DEFAULT_BASE_URL, DEFAULT_ENDPOINTS, DEFAULT_RANDOM_REQUESTS, LoadConfig, build_workload,
                       rate_json)


# ----------------------------------------------------------------------------- command line
class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as a ConfigError (one line, exit 2) instead of usage text."""

    def error(self, message):
        raise ConfigError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="embedserve bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="kind", required=True, parser_class=_Parser)
    for kind, text in (("embed", "load an embeddings endpoint"), ("generate", "load a completions endpoint")):
        s = sub.add_parser(kind, help=text, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        s.add_argument("--base-url", default=os.environ.get("EMBEDSERVE_URL", DEFAULT_BASE_URL),
                       help=f"server root (default {DEFAULT_BASE_URL} or $EMBEDSERVE_URL)")
        s.add_argument("--endpoint", default="", help=f"path (default {DEFAULT_ENDPOINTS[kind]}; infinity-emb "
                       "serves /embeddings unless started with --url-prefix /v1)")
        s.add_argument("--model", required=True, help="sent as `model`")
        s.add_argument("--api-key", default=os.environ.get("EMBEDSERVE_API_KEY"),
                       help="bearer token (default $EMBEDSERVE_API_KEY)")
        s.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests/s; inf sends all at once (default inf)")
        s.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of the inter-arrival times: 1 = Poisson, <1 burstier (default 1)")
        s.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default none)")
        s.add_argument("--num-requests", type=int, default=None,
                       help=f"measured requests (default {DEFAULT_RANDOM_REQUESTS}; jsonl: the whole file)")
        s.add_argument("--warmup", type=int, default=0, help="requests sent and awaited before each run, not counted")
        s.add_argument("--seed", type=int, default=0, help="seeds the random dataset and the arrival times")
        s.add_argument("--dataset", choices=("random", "jsonl"), default="random")
        s.add_argument("--dataset-path", default=None,
                       help='JSONL with {"text": ...} or {"prompt": ..., "output_len": ...} per line')
        s.add_argument("--input-len", type=int, default=128,
                       help="random dataset: tokens per text, aimed at with real words (the server's usage "
                       "has the real count; default 128)")
        s.add_argument("--range-ratio", type=float, default=0.0,
                       help="random lengths uniform in [len*(1-r), len*(1+r)] (default 0)")
        s.add_argument("--timeout", type=float, default=600.0, help="seconds per request before it counts as failed")
        if kind == "embed":
            s.add_argument("--batch-size", type=int, default=1, help="texts per request (default 1)")
        else:
            s.add_argument("--output-len", type=int, default=64, help="max_tokens, with --range-ratio (default 64)")
            s.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (vLLM and embedserve)")
            s.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                           help="stream (default; needed for TTFT and ITL)")
            s.add_argument("--temperature", type=float, default=0.0)
        s.add_argument("--sweep", default=None, help="one run per value: rate=1,2,4,inf or concurrency=1,8,32")
        s.add_argument("--out", default=None, help="write config, machine and metrics to this JSON file")
        s.add_argument("--save-requests", action="store_true", help="also write every request's record to --out")
        s.add_argument("--plot", default=None, help="PNG of latency against achieved throughput (needs matplotlib)")
    return p


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    extra = ({"batch_size": args.batch_size} if args.kind == "embed" else
             {"output_len": args.output_len, "ignore_eos": args.ignore_eos, "stream": args.stream,
              "temperature": args.temperature})
    return LoadConfig(kind=args.kind, model=args.model, base_url=args.base_url, endpoint=args.endpoint,
                      api_key=args.api_key, request_rate=args.request_rate, burstiness=args.burstiness,
                      max_concurrency=args.max_concurrency, num_requests=args.num_requests, warmup=args.warmup,
                      seed=args.seed, dataset=args.dataset, dataset_path=args.dataset_path,
                      input_len=args.input_len, range_ratio=args.range_ratio, timeout=args.timeout, **extra)


def _check_writable(path: str | None, flag: str) -> None:
    if path and not Path(path).resolve().parent.is_dir():
        raise ConfigError(f"{flag} {path}: its directory does not exist")


def main(argv: list[str] | None = None) -> int:
    """`embedserve bench embed|generate ...`: 0 when every run completed a request, 1 when a run
    completed none, 2 on a bad flag or an unreachable server."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
        cfg = config_from_args(args)
        sweep = parse_sweep(args.sweep) if args.sweep else None
        _check_writable(args.out, "--out")
        _check_writable(args.plot, "--plot")
        if args.plot:
            new_figure()                    # no matplotlib: say so before the runs, not after
        work = build_workload(cfg)
        runs = asyncio.run(run_all(cfg, work, sweep, args.save_requests, log=err))
    except ConfigError as exc:
        err(f"embedserve bench: error: {exc}")
        return 2
    print(format_table(runs, cfg.kind))
    if args.out:
        result = {"benchmark": f"embedserve bench {cfg.kind}", "config": cfg.described(),
                  "sweep": {"key": sweep[0], "values": [rate_json(v) for v in sweep[1]]} if sweep else None,
                  "machine": machine_info(), "runs": runs}
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        err(f"wrote {args.out}")
    if args.plot:
        plot_runs(runs, cfg.kind, args.plot, title=f"{cfg.kind} {cfg.model} at {cfg.url}")
        err(f"wrote {args.plot}")
    empty = [r for r in runs if r["metrics"]["completed"] == 0]
    if empty:
        status, message = next(iter(empty[0]["metrics"]["first_error_by_status"].items()), ("?", ""))
        err(f"embedserve bench: no request completed in {', '.join(r['label'] for r in empty)} "
            f"(first failure {status}: {message})")
        return 1
    return 0


def err(message: str) -> None:
    print(message, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
