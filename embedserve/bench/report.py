"""What a load run measured: one record per request, a run's metrics (throughputs, latency
percentiles), and their output as a table, a plot and the machine they ran on."""

from __future__ import annotations

import math
import os
import platform
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..errors import ConfigError

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class Record:
    """What one request did; times in seconds, `start` from the run's start."""

    ok: bool
    status: str                             # "200", "429", ..., "connection", "stream", "invalid"
    start: float
    latency: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str = ""


# ----------------------------------------------------------------------------- metrics
def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's
    default `linear`): position (n-1)*q/100 in the sorted values."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100
    k = math.floor(pos)
    if k + 1 >= len(xs):
        return float(xs[-1])
    return float(xs[k] + (xs[k + 1] - xs[k]) * (pos - k))


def latency_stats(seconds: list[float]) -> dict:
    """mean, p50, p90, p99 in milliseconds (None where there is nothing to measure)."""
    if not seconds:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    return {"mean": 1000 * sum(seconds) / len(seconds),
            **{f"p{q}": 1000 * percentile(seconds, q) for q in PERCENTILES}}


def summarize(records: list[Record], duration: float, kind: str) -> dict:
    """A run's metrics: counts, throughputs (over the run's duration) and latency percentiles."""
    ok = [r for r in records if r.ok]
    failed = Counter(r.status for r in records if not r.ok)
    errors: dict[str, str] = {}
    for r in records:
        if not r.ok:
            errors.setdefault(r.status, r.error)
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.completion_tokens for r in ok)
    m = {"duration_s": duration, "completed": len(ok), "failed": sum(failed.values()),
         "failed_by_status": dict(sorted(failed.items())), "first_error_by_status": errors,
         "request_throughput": len(ok) / duration, "input_tokens": input_tokens,
         "output_tokens": output_tokens, "input_token_throughput": input_tokens / duration,
         "output_token_throughput": output_tokens / duration,
         "e2e_latency_ms": latency_stats([r.latency for r in ok])}
    if kind == "generate":
        timed = [r for r in ok if r.ttft is not None]
        m["ttft_ms"] = latency_stats([r.ttft for r in timed])
        m["itl_ms"] = latency_stats([g for r in timed for g in r.itl])
        m["tpot_ms"] = latency_stats([(r.latency - r.ttft) / (r.completion_tokens - 1)
                                      for r in timed if r.completion_tokens > 1])
    return m



# ----------------------------------------------------------------------------- output
def machine_info() -> dict:
    """The machine the load generator ran on (the server's too when it is local)."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
                break
    except OSError:
        pass
    return {"cpu": cpu or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def format_table(runs: list[dict], kind: str) -> str:
    """One column per run, one row per metric."""
    rows: list[tuple[str, list[str]]] = []
    ms = [r["metrics"] for r in runs]
    rows.append(("completed", [str(m["completed"]) for m in ms]))
    rows.append(("failed", [" ".join(f"{k}:{v}" for k, v in m["failed_by_status"].items()) or "0" for m in ms]))
    rows.append(("duration (s)", [_fmt(m["duration_s"], 2) for m in ms]))
    rows.append(("requests/s", [_fmt(m["request_throughput"], 2) for m in ms]))
    rows.append(("input tokens", [str(m["input_tokens"]) for m in ms]))
    rows.append(("input tokens/s", [_fmt(m["input_token_throughput"]) for m in ms]))
    if kind == "generate":
        rows.append(("output tokens", [str(m["output_tokens"]) for m in ms]))
        rows.append(("output tokens/s", [_fmt(m["output_token_throughput"]) for m in ms]))
    groups = [("e2e", "e2e_latency_ms")]
    if kind == "generate":
        groups += [("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms")]
    for name, key in groups:
        for stat in ("mean", *(f"p{q}" for q in PERCENTILES)):
            rows.append((f"{name} {stat} (ms)", [_fmt(m[key][stat]) for m in ms]))
    labels = [r["label"] for r in runs]
    w0 = max(len(n) for n, _ in rows)
    w = max(max(len(x) for x in labels), *(len(v) for _, vals in rows for v in vals))
    lines = [f"{'':<{w0}}  " + "  ".join(f"{x:>{w}}" for x in labels)]
    lines += [f"{n:<{w0}}  " + "  ".join(f"{v:>{w}}" for v in vals) for n, vals in rows]
    return "\n".join(lines)


def new_figure():
    """A matplotlib Figure on the Agg canvas (imported only when a plot is asked for)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from None
    fig = Figure(figsize=(7.5, 4.5))
    FigureCanvasAgg(fig)
    return fig


def plot_runs(runs: list[dict], kind: str, path: str, title: str = "") -> None:
    """Latency (e2e p50/p99, and TTFT p50/p99 for generate) against achieved throughput."""
    xkey, xlabel = (("request_throughput", "achieved throughput (requests/s)") if kind == "embed"
                    else ("output_token_throughput", "achieved throughput (output tokens/s)"))
    fig = new_figure()
    ax = fig.add_subplot()
    xs = [r["metrics"][xkey] for r in runs]
    series = [("e2e p50", "e2e_latency_ms", "p50", "-o"), ("e2e p99", "e2e_latency_ms", "p99", "-s")]
    if kind == "generate":
        series += [("TTFT p50", "ttft_ms", "p50", "--o"), ("TTFT p99", "ttft_ms", "p99", "--s")]
    for label, key, stat, style in series:
        ys = [r["metrics"][key][stat] for r in runs]
        ys = [math.nan if y is None else y for y in ys]
        ax.plot(xs, ys, style, label=label)
    for x, r in zip(xs, runs):
        y = r["metrics"]["e2e_latency_ms"]["p50"]
        if y is not None:
            ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
