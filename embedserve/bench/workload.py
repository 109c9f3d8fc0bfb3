"""What `embedserve bench` sends, and when: a run's settings (LoadConfig), the arrival schedule
(gamma inter-arrival times), the texts (random words near a token length, or a JSONL file) and
the request bodies built from them."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_ENDPOINTS = {"embed": "/v1/embeddings", "generate": "/v1/completions"}
DEFAULT_RANDOM_REQUESTS = 100

# Common words that most tokenizers (BPE and SentencePiece alike) keep as one token with their
# leading space. A Chinese word is ~2 tokens in XLM-R's SentencePiece and ~5 in byte-level BPE
# (SmolLM2, GPT-2 style), so it spends ZH_COST of a text's length budget.
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
ZH_COST = 3


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
        d["request_rate"] = rate_json(self.request_rate)
        return d


def check_rate(rate: float, flag: str) -> None:
    if not (rate > 0):                      # also refuses NaN
        raise ConfigError(f"{flag} must be a positive number of requests/s or inf, not {rate}")


def check_concurrency(n: int, flag: str) -> None:
    if n < 1:
        raise ConfigError(f"{flag} must be at least 1, not {n}")


def rate_json(rate: float) -> float | str:
    """A rate as the result file writes it: the number, or "inf"."""
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
    n = max(1, int(np.searchsorted(np.cumsum(np.where(zh, ZH_COST, 1)), length, side="right")))
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
