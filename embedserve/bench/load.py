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
import logging
import math
import os
import platform
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

from ..errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_ENDPOINTS = {"embed": "/v1/embeddings", "generate": "/v1/completions"}
DEFAULT_RANDOM_REQUESTS = 100
PERCENTILES = (50, 90, 99)
# statuses that say the request itself is wrong (model, endpoint, key), not that the server is busy
_REFUSALS = frozenset({400, 401, 403, 404, 405, 415, 422})

# Common words that most tokenizers (BPE and SentencePiece alike) keep as one token with their
# leading space. A Chinese word is ~2 tokens in XLM-R's SentencePiece and ~5 in byte-level BPE
# (SmolLM2, GPT-2 style), so it spends _ZH_COST of a text's length budget.
_EN_WORDS = tuple(dict.fromkeys("""
the of and to in is was for on that with as by at from it his an were are which this be
has or had first one their its new after but who not they have her she two been other when
there all during into school time may years more most only over city some world would where
later up such used many can state about national out known university united then made year
part under number three system well between city people water house small large family life
work group game music public river area country government world century second long high
place city company great world series center early north south east west home power light
model data search answer question document index query vector paper store engine server
market street village church field station record film book story history member
""".split()))
_ZH_WORDS = ("我们", "中国", "北京", "今天", "学生", "老师", "时间", "问题", "世界", "城市",
             "文化", "历史", "经济", "科学", "技术", "研究", "发展", "社会", "国家", "人民",
             "工作", "生活", "学习", "语言", "电脑", "数据", "模型", "搜索", "文档", "答案")
_ZH_FRACTION = 0.1
_ZH_COST = 3


# ----------------------------------------------------------------------------- configuration
@dataclass(slots=True)
class LoadConfig:
    """One load run's settings; the flags of `embedserve bench embed|generate` mirror the fields."""

    kind: str                               # "embed" | "generate"
    model: str
    base_url: str = DEFAULT_BASE_URL
    endpoint: str = ""                      # "" → the kind's OpenAI path
    api_key: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_requests: int | None = None         # None → 100 (random) or the whole file (jsonl)
    warmup: int = 0
    seed: int = 0
    dataset: str = "random"
    dataset_path: str | None = None
    input_len: int = 128
    range_ratio: float = 0.0
    batch_size: int = 1
    output_len: int = 64
    ignore_eos: bool = False
    stream: bool = True
    temperature: float = 0.0
    timeout: float = 600.0

    def __post_init__(self):
        if self.kind not in DEFAULT_ENDPOINTS:
            raise ConfigError(f"unknown benchmark {self.kind!r}; choose embed or generate")
        self.endpoint = self.endpoint or DEFAULT_ENDPOINTS[self.kind]
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"--base-url {self.base_url!r} must start with http:// or https://")
        if not self.endpoint.startswith("/"):
            raise ConfigError(f"--endpoint {self.endpoint!r} must start with / (e.g. {DEFAULT_ENDPOINTS[self.kind]})")
        check_rate(self.request_rate, "--request-rate")
        if not self.burstiness > 0 or math.isinf(self.burstiness):
            raise ConfigError(f"--burstiness must be a positive number (1 = Poisson), not {self.burstiness}")
        if self.max_concurrency is not None:
            check_concurrency(self.max_concurrency, "--max-concurrency")
        for flag, value, low in (("--num-requests", self.num_requests, 1), ("--warmup", self.warmup, 0),
                                 ("--input-len", self.input_len, 1), ("--batch-size", self.batch_size, 1),
                                 ("--output-len", self.output_len, 1)):
            if value is not None and value < low:
                raise ConfigError(f"{flag} must be at least {low}, not {value}")
        if not 0 <= self.range_ratio < 1:
            raise ConfigError(f"--range-ratio must be in [0, 1), not {self.range_ratio}")
        if not self.timeout > 0:
            raise ConfigError(f"--timeout must be positive seconds, not {self.timeout}")
        if not 0 <= self.temperature <= 2:
            raise ConfigError(f"--temperature must be in [0, 2], not {self.temperature}")
        if self.dataset == "jsonl":
            if not self.dataset_path:
                raise ConfigError("--dataset jsonl needs --dataset-path FILE.jsonl")
            if not Path(self.dataset_path).is_file():
                raise ConfigError(f"--dataset-path {self.dataset_path}: no such file")
        elif self.dataset != "random":
            raise ConfigError(f"--dataset {self.dataset!r}: choose random or jsonl")

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        if base.endswith("/v1") and self.endpoint.startswith("/v1/"):
            base = base[:-3]                # --base-url http://host:8000/v1 means the same server
        return base + self.endpoint

    def described(self) -> dict:
        """The settings as written into the result file (the API key never is)."""
        d = asdict(self)
        d["api_key"] = "***" if self.api_key else None
        d["request_rate"] = _rate_json(self.request_rate)
        return d


def check_rate(rate: float, flag: str) -> None:
    if not (rate > 0):                      # also refuses NaN
        raise ConfigError(f"{flag} must be a positive number of requests/s or inf, not {rate}")


def check_concurrency(n: int, flag: str) -> None:
    if n < 1:
        raise ConfigError(f"{flag} must be at least 1, not {n}")


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


# ----------------------------------------------------------------------------- arrivals
def inter_arrival_times(n: int, rate: float, burstiness: float = 1.0,
                        rng: np.random.Generator | None = None) -> np.ndarray:
    """n gaps (s) between request arrivals: gamma with shape=burstiness and mean 1/rate, so the
    coefficient of variation is 1/sqrt(burstiness) (1: exponential, a Poisson process); all zero at inf."""
    if math.isinf(rate):
        return np.zeros(n)
    rng = rng if rng is not None else np.random.default_rng()
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_offsets(gaps: np.ndarray) -> np.ndarray:
    """Send times (s after the start): the first request at 0, each next one a gap later."""
    return np.concatenate(([0.0], np.cumsum(gaps[:-1]))) if len(gaps) else np.zeros(0)


# ----------------------------------------------------------------------------- datasets
@dataclass(slots=True)
class Item:
    """One text of the dataset; `output_len` only where a JSONL line sets it."""

    text: str
    output_len: int | None = None


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """n integers uniform in [length*(1-r), length*(1+r)] (at least 1), as vLLM's random dataset."""
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def random_text(rng: np.random.Generator, length: int) -> str:
    """Real words worth about `length` tokens (one in ten words Chinese), distinct per draw so
    that requests share no prefix."""
    zh = rng.random(length) < _ZH_FRACTION
    en = rng.integers(0, len(_EN_WORDS), size=length)
    cn = rng.integers(0, len(_ZH_WORDS), size=length)
    n = max(1, int(np.searchsorted(np.cumsum(np.where(zh, _ZH_COST, 1)), length, side="right")))
    return " ".join(_ZH_WORDS[c] if z else _EN_WORDS[e] for z, e, c in zip(zh[:n], en[:n], cn[:n]))


def read_jsonl(path: str) -> list[Item]:
    """Items from `{"text": ...}` or `{"prompt": ..., "output_len": ...}` lines (blank lines skipped)."""
    items = []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--dataset-path {path}: line {no} is not JSON ({exc.msg})") from None
            text = obj.get("text", obj.get("prompt")) if isinstance(obj, dict) else None
            out = obj.get("output_len") if isinstance(obj, dict) else None
            if not isinstance(text, str) or not text:
                raise ConfigError(f"--dataset-path {path}: line {no} needs a non-empty \"text\" or \"prompt\" string")
            if out is not None and (not isinstance(out, int) or isinstance(out, bool) or out < 1):
                raise ConfigError(f"--dataset-path {path}: line {no}: output_len must be a positive integer")
            items.append(Item(text, out))
    if not items:
        raise ConfigError(f"--dataset-path {path}: no lines")
    return items


@dataclass(slots=True)
class Workload:
    """Request bodies: the measured ones, the warm-up ones, and the probe sent first."""

    measured: list[dict]
    warmup: list[dict]
    probe: dict


def build_workload(cfg: LoadConfig) -> Workload:
    """Bodies for every request, fixed by the config and its seed (the same for each sweep run).
    A JSONL file is read in order and cycled when more texts are needed than it holds."""
    per = cfg.batch_size if cfg.kind == "embed" else 1
    rng = np.random.default_rng(cfg.seed)
    if cfg.dataset == "jsonl":
        lines = read_jsonl(cfg.dataset_path)
        n = cfg.num_requests or -(-len(lines) // per)
        total = (n + cfg.warmup + 1) * per
        items = [lines[i % len(lines)] for i in range(total)]
    else:
        n = cfg.num_requests or DEFAULT_RANDOM_REQUESTS
        total = (n + cfg.warmup + 1) * per
        items = [Item(random_text(rng, int(k))) for k in sample_lengths(rng, total, cfg.input_len, cfg.range_ratio)]
    out_lens = sample_lengths(rng, total, cfg.output_len, cfg.range_ratio)
    bodies = []
    for i in range(0, total, per):
        chunk = items[i:i + per]
        if cfg.kind == "embed":
            bodies.append(embed_body(cfg, [it.text for it in chunk]))
        else:
            bodies.append(generate_body(cfg, chunk[0].text, chunk[0].output_len or int(out_lens[i])))
    return Workload(measured=bodies[:n], warmup=bodies[n:n + cfg.warmup], probe=bodies[-1])


def embed_body(cfg: LoadConfig, texts: list[str]) -> dict:
    return {"model": cfg.model, "input": texts}


def generate_body(cfg: LoadConfig, prompt: str, max_tokens: int) -> dict:
    """A completions body, or a chat body when --endpoint is a chat path; only OpenAI fields and
    `ignore_eos` (vLLM's and ours), as servers with strict schemas refuse unknown ones."""
    body: dict = {"model": cfg.model}
    if cfg.endpoint.rstrip("/").endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(max_tokens=max_tokens, temperature=float(cfg.temperature), stream=cfg.stream)
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


# ----------------------------------------------------------------------------- one request
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


def _error_text(r: httpx.Response) -> str:
    """The server's message from an OpenAI error envelope (or the body's start)."""
    try:
        err = r.json().get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        if msg:
            return str(msg)[:300]
    except (ValueError, AttributeError):
        pass
    return r.text[:300]


async def send_json(client: httpx.AsyncClient, url: str, body: dict, t0: float) -> Record:
    """POST one body and read one JSON answer (embeddings, or generation without streaming)."""
    start = time.perf_counter()
    try:
        r = await client.post(url, json=body)
    except httpx.HTTPError as exc:
        return Record(False, "connection", start - t0, time.perf_counter() - start, error=repr(exc)[:300])
    latency = time.perf_counter() - start
    if r.status_code != 200:
        return Record(False, str(r.status_code), start - t0, latency, error=_error_text(r))
    try:
        reply = r.json()
        usage = reply.get("usage") or {}
        if "input" in body and len(reply["data"]) != len(body["input"]):
            raise ValueError(f"{len(reply['data'])} embeddings for {len(body['input'])} inputs")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return Record(False, "invalid", start - t0, latency, error=str(exc)[:300])
    return Record(True, "200", start - t0, latency, int(usage.get("prompt_tokens") or 0),
                  int(usage.get("completion_tokens") or 0))


async def send_stream(client: httpx.AsyncClient, url: str, body: dict, t0: float) -> Record:
    """POST one streaming body; time every SSE chunk that carries text, read usage, expect [DONE]."""
    start = time.perf_counter()
    chunks: list[float] = []
    usage: dict = {}
    done, problem = False, ""
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return Record(False, str(r.status_code), start - t0, time.perf_counter() - start,
                              error=_error_text(r))
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    problem = str(obj["error"])[:300]
                    break
                usage = obj.get("usage") or usage
                for choice in obj.get("choices") or ():
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text:
                        chunks.append(time.perf_counter())
                    if choice.get("finish_reason") == "error":
                        problem = "the server ended the stream with finish_reason=error"
    except httpx.HTTPError as exc:
        return Record(False, "connection", start - t0, time.perf_counter() - start, error=repr(exc)[:300])
    except (ValueError, AttributeError) as exc:
        return Record(False, "invalid", start - t0, time.perf_counter() - start, error=str(exc)[:300])
    end = time.perf_counter()
    if problem or not done:
        return Record(False, "stream", start - t0, end - start, error=problem or "the stream ended without [DONE]")
    return Record(True, "200", start - t0, end - start, int(usage.get("prompt_tokens") or 0),
                  int(usage.get("completion_tokens") or len(chunks)),
                  ttft=chunks[0] - start if chunks else None,
                  itl=[b - a for a, b in zip(chunks, chunks[1:])])


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


# ----------------------------------------------------------------------------- the run
class Runner:
    """Sends requests over one HTTP client: the probe, and batches of bodies on an arrival schedule."""

    def __init__(self, cfg: LoadConfig, client: httpx.AsyncClient):
        self.cfg, self.client = cfg, client
        self.send = send_stream if cfg.kind == "generate" and cfg.stream else send_json

    async def probe(self, body: dict) -> None:
        """One request first, so a wrong URL, model or key stops here with the server's reason."""
        rec = await self.send(self.client, self.cfg.url, body, time.perf_counter())
        if rec.status == "connection":
            raise ConfigError(f"cannot reach {self.cfg.url}: {rec.error}; is the server up at --base-url?")
        if rec.status.isdigit() and int(rec.status) in _REFUSALS:
            raise ConfigError(f"{self.cfg.url} refused the first request: HTTP {rec.status}: {rec.error} "
                              "(check --model, --endpoint and --api-key)")
        if not rec.ok:
            logger.warning("the probe request failed (%s: %s); measuring anyway", rec.status, rec.error)

    async def run(self, bodies: list[dict], rate: float, max_concurrency: int | None) -> tuple[list[Record], float]:
        """Send `bodies` on the arrival schedule under the concurrency cap; (records, duration)."""
        gaps = inter_arrival_times(len(bodies), rate, self.cfg.burstiness, np.random.default_rng(self.cfg.seed))
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        records: list[Record | None] = [None] * len(bodies)
        t0 = time.perf_counter()

        async def one(i: int, body: dict):
            if sem is None:
                records[i] = await self.send(self.client, self.cfg.url, body, t0)
            else:
                async with sem:
                    records[i] = await self.send(self.client, self.cfg.url, body, t0)

        tasks = []
        for i, (body, at) in enumerate(zip(bodies, arrival_offsets(gaps))):
            wait = t0 + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(i, body)))
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - t0


def parse_sweep(spec: str) -> tuple[str, list]:
    """`rate=1,2,4,inf` or `concurrency=1,8,32` → (key, values)."""
    key, sep, values = spec.partition("=")
    key = key.strip()
    if not sep or key not in ("rate", "concurrency") or not values.strip():
        raise ConfigError(f"--sweep {spec!r}: write rate=1,2,4,inf or concurrency=1,8,32")
    out = []
    for v in values.split(","):
        try:
            x = float(v) if key == "rate" else int(v)
        except ValueError:
            raise ConfigError(f"--sweep {spec!r}: {v!r} is not a {'number' if key == 'rate' else 'whole number'}") from None
        (check_rate if key == "rate" else check_concurrency)(x, f"--sweep {key}")
        out.append(x)
    return key, out


async def run_all(cfg: LoadConfig, work: Workload, sweep: tuple[str, list] | None,
                  save_requests: bool = False, log=print) -> list[dict]:
    """The probe, then for each sweep value (or once) the warm-up and the measured run."""
    headers = {"User-Agent": "embedserve-bench"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    if sweep and sweep[0] == "concurrency":
        limits = httpx.Limits(max_connections=max(sweep[1]), max_keepalive_connections=max(sweep[1]))
    settings = [(cfg.request_rate, cfg.max_concurrency, "run")]
    if sweep:
        key, values = sweep
        settings = [(v, cfg.max_concurrency, f"rate={v:g}") if key == "rate"
                    else (cfg.request_rate, v, f"concurrency={v}") for v in values]
    runs = []
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(cfg.timeout), limits=limits) as client:
        runner = Runner(cfg, client)
        await runner.probe(work.probe)
        for rate, conc, label in settings:
            if work.warmup:
                warm, _ = await runner.run(work.warmup, math.inf, conc)
                if bad := sum(not r.ok for r in warm):
                    log(f"{label}: {bad} of {len(warm)} warm-up requests failed")
            log(f"{label}: {len(work.measured)} requests, rate {rate:g}/s, "
                f"max concurrency {conc or 'unlimited'}")
            records, duration = await runner.run(work.measured, rate, conc)
            run = {"label": label, "request_rate": _rate_json(rate), "max_concurrency": conc,
                   "metrics": summarize(records, duration, cfg.kind)}
            if save_requests:
                run["requests"] = [asdict(r) for r in records]
            runs.append(run)
    return runs


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


def _figure():
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
    fig = _figure()
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
            _figure()                       # no matplotlib: say so before the runs, not after
        work = build_workload(cfg)
        runs = asyncio.run(run_all(cfg, work, sweep, args.save_requests, log=err))
    except ConfigError as exc:
        err(f"embedserve bench: error: {exc}")
        return 2
    print(format_table(runs, cfg.kind))
    if args.out:
        result = {"benchmark": f"embedserve bench {cfg.kind}", "config": cfg.described(),
                  "sweep": {"key": sweep[0], "values": [_rate_json(v) for v in sweep[1]]} if sweep else None,
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
