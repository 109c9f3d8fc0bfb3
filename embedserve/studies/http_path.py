"""`python -m embedserve.studies.http_path --against REV [--model M] [--layers N] [--dtype D]`: our
server's HTTP path against another revision's, on make bench's three embedding workloads.

Each round starts a fresh server from this tree and one from a git worktree of REV, in turn (the
order alternating from round to round), and drives each through the three workloads (1 text per
request at 8 and 32 clients, 32 texts per request at 8) with the load generator in this process.
Per run it reads texts/s and the CPU of the server's event-loop thread per request (/proc). The
table gives each side's medians and the median of the per-round ratios. The machines here are
shared and drift by 10-25 % within minutes, so only the ratios of one run count.

`--layers N` serves the model cut to its first N encoder layers (a model directory of symlinks and
an edited config.json, made here). A 1-layer all-MiniLM-L6-v2 runs ~6x the tokens/s of the whole
model on the AVX2 kind, about what the whole model runs in bf16 on an AMX Xeon. There the HTTP path,
not the model, sets how many small requests a second the server answers.

    python -m embedserve.studies.http_path --against 7336790 --layers 1 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from . import write_results

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[2]


def cut_model(path: Path, layers: int, into: Path) -> Path:
    """A model directory of `path`'s files (symlinked) whose config.json keeps `layers` layers."""
    into.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.name != "config.json":
            (into / f.name).symlink_to(f)
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (into / "config.json").write_text(json.dumps(cfg, indent=1))
    return into


def add_worktree(root: Path, rev: str, into: Path) -> None:
    """A detached git worktree of `rev` at `into`; SystemExit saying why where git refuses."""
    r = subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(into), rev],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"--against {rev}: git worktree add failed: {r.stderr.strip() or r.stdout.strip()}")


def _server_pid(port: int) -> int:
    out = subprocess.check_output(["pgrep", "-n", "-f", f"embedserve.cli serve .*--port {port}( |$)"])
    return int(out.split()[0])


def one_side(tree: Path, model: str, dtype: str, data: Path, requests: dict[str, int]) -> dict:
    """A fresh server from `tree` (its package first on the path), the three workloads once each."""
    from embedserve.studies.compare import peers
    from embedserve.studies.compare.embeddings import EMBED_WORKLOADS
    from embedserve.studies.profile_served import _thread_cpu
    with peers.ours(model, dtype, cwd=tree) as base:       # `python -m` imports the tree it starts in
        import httpx
        name = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        pid = _server_pid(int(base.rsplit(":", 1)[1]))
        out = {}
        for label, per_req, conc, _ in EMBED_WORKLOADS:
            n = requests[label]
            peers.drive("embed", base, name, data, "--batch-size", str(per_req), "--max-concurrency", str(conc),
                        "--num-requests", str(max(n // 8, conc)), "--warmup", "0")                   # warm
            c0 = _thread_cpu(pid)
            r, = peers.drive("embed", base, name, data, "--batch-size", str(per_req), "--max-concurrency",
                             str(conc), "--num-requests", str(n), "--warmup", "0")
            c1 = _thread_cpu(pid)
            out[label] = {"texts_per_s": r["metrics"]["request_throughput"] * per_req,
                          "loop_ms_per_request": (c1[pid] - c0[pid]) / n * 1e3,
                          "failed": r["metrics"]["failed"]}
        return out


def study(against: str, model: str, layers: int | None, dtype: str, rounds: int) -> dict:
    from embedserve.models.registry import resolve_model
    from embedserve.precision import cpu_flags
    from embedserve.studies.compare import write_jsonl
    from embedserve.studies.compare.embeddings import corpus
    work = Path(tempfile.mkdtemp(prefix="http-path-"))
    old = work / "tree"
    add_worktree(ROOT, against, old)
    try:
        name, path = resolve_model(model)
        served = str(cut_model(path, layers, work / f"{name}-{layers}-layers")) if layers else model
        data = write_jsonl([{"text": t} for t in corpus(768)], work / "corpus.jsonl")
        requests = {"1 text/request, 8 clients": 600, "1 text/request, 32 clients": 600,
                    "32 texts/request, 8 clients": 48}
        sides = {"this tree": ROOT, against: old}
        runs: dict[str, list[dict]] = {k: [] for k in sides}
        for r in range(rounds):
            for key in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                runs[key].append(one_side(sides[key], served, dtype, data, requests))
                print(f"round {r + 1}, {key}: " + ", ".join(f"{v['texts_per_s']:.0f}" for v in runs[key][-1].values()),
                      flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for label in requests:
        new, base = runs["this tree"], runs[against]
        ratios = [a[label]["texts_per_s"] / b[label]["texts_per_s"] for a, b in zip(new, base)]
        rows.append({"workload": label,
                     "texts_per_s": {k: statistics.median(x[label]["texts_per_s"] for x in v) for k, v in runs.items()},
                     "loop_ms_per_request": {k: statistics.median(x[label]["loop_ms_per_request"] for x in v)
                                             for k, v in runs.items()},
                     "ratio": statistics.median(ratios),
                     "ratios": ratios,
                     "failed": sum(x[label]["failed"] for v in runs.values() for x in v)})
    return {"against": against, "model": model, "layers": layers, "dtype": dtype, "rounds": rounds,
            "date": time.strftime("%Y-%m-%d"), "flags": sorted(f for f in cpu_flags()
                                                                if f.startswith(("avx512_bf16", "amx_bf16", "avx2"))),
            "rows": rows, "runs": runs}


def markdown(res: dict) -> str:
    model = res["model"] + (f" cut to {res['layers']} layer(s)" if res["layers"] else "")
    a = res["against"]
    lines = [f"{model}, `--dtype {res['dtype']}`, fresh servers of this tree and of {a} alternated, "
             f"{res['rounds']} rounds, flags {', '.join(res['flags'])} ({res['date']}).", "",
             f"| workload | texts/s, this tree | texts/s, {a} | this / {a} (median of rounds) | rounds | "
             f"event loop ms / request, this tree | same, {a} |", "|---|---|---|---|---|---|---|"]
    for row in res["rows"]:
        t, lp = row["texts_per_s"], row["loop_ms_per_request"]
        lines.append(f"| {row['workload']} | {t['this tree']:.0f} | {t[a]:.0f} | {row['ratio']:.2f}× | "
                     f"{', '.join(f'{x:.2f}' for x in row['ratios'])} | {lp['this tree']:.2f} | {lp[a]:.2f} |")
    failed = sum(r["failed"] for r in res["rows"])
    if failed:
        lines += ["", f"**{failed} requests failed.**"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="the git revision whose server to run beside this tree's")
    ap.add_argument("--model", default="all-MiniLM-L6-v2")
    ap.add_argument("--layers", type=int, default=None, help="serve the model cut to its first N layers")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "int8"))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    res = study(args.against, args.model, args.layers, args.dtype, args.rounds)
    suffix = f"-{args.layers}layers" if args.layers else ""
    write_results(RESULTS / f"http_path-{args.model}{suffix}-{args.dtype}.json", res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
