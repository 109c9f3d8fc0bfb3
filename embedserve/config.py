"""Server configuration: one dataclass, CLI flags mirror its fields (vLLM/TEI names where they
exist), each with an `EMBEDSERVE_<FIELD>` environment fallback. Impossible settings fail at
start-up with the reason and the flag to change."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

from .errors import ConfigError

DEFAULT_MODEL = "multilingual-e5-small"
DEFAULT_GENERATE_MODEL = "SmolLM2-135M-Instruct"
DTYPES = ("auto", "float32", "bfloat16", "int8")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "float": "float32"}


def normalize_dtype(dtype: str, allowed: tuple[str, ...] = DTYPES, flag: str = "--dtype") -> str:
    """The canonical name of `dtype`, or ConfigError naming the choices."""
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in allowed:
        raise ConfigError(f"{flag} {dtype!r}: choose {', '.join(allowed)}")
    return name


@dataclass(slots=True)
class ServerConfig:
    """Everything `embedserve serve` needs."""

    model: str = field(default=DEFAULT_MODEL, metadata={"help": "bundled embedding model name or local HF directory (comma-separated: several)"})
    served_model_name: str | None = field(default=None, metadata={"help": "name clients send as `model` (default: the model's name)"})
    host: str = field(default="127.0.0.1", metadata={"help": "bind address (loopback unless told otherwise)"})
    port: int = field(default=8000, metadata={"help": "TCP port"})
    dtype: str = field(default="auto", metadata={"help": "auto | float32 | bfloat16 | int8 (int8: the encoder's linear layers, if accurate; auto: the fastest precision that passes its accuracy probe on this machine, see embedserve.precision)"})
    device: str = field(default="cpu", metadata={"help": "cpu | cuda"})
    max_batch_tokens: int | None = field(default=None, metadata={"help": "token budget of one model batch (default 4096 on a CPU, where larger batches fall out of cache, 16384 on a GPU)"})
    max_batch_size: int = field(default=256, metadata={"help": "most inputs in one model batch"})
    max_input_length: int | None = field(default=None, metadata={"help": "longest input in tokens (default: the model's limit)"})
    max_client_batch_size: int = field(default=2048, metadata={"help": "most inputs in one request"})
    max_queued_tokens: int = field(default=262_144, metadata={"help": "tokens allowed to wait; more gets 429"})
    max_concurrent_requests: int = field(default=512, metadata={"help": "requests in flight; more gets 429"})
    max_body_bytes: int = field(default=2 * 1024 * 1024, metadata={"help": "largest request body; more gets 413"})
    api_key: str | None = field(default=None, repr=False, metadata={"help": "require `Authorization: Bearer KEY` on all routes but /health, /ready; any of several keys (comma-separated) works"})
    api_key_file: str | None = field(default=None, metadata={"help": "file of accepted keys, one a line (blank lines and # comments ignored), re-read within a second of a change"})
    rate_limit: float | None = field(default=None, metadata={"help": "requests per second per API key (per client IP when no key is set); more gets 429 (default: no limit)"})
    rate_burst: int | None = field(default=None, metadata={"help": "requests a key may send at once before --rate-limit applies (default: the rate, at least 1)"})
    allowed_origins: str | None = field(default=None, metadata={"help": "browser origins CORS allows (* for any; default: no CORS headers at all)"})
    # generation (RAG answer step)
    generate_model: str = field(default=DEFAULT_GENERATE_MODEL, metadata={"help": "bundled decoder name, local HF Llama directory, or none"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    kv_cache_memory: int | None = field(default=None, metadata={"help": "bytes for the KV cache (default: --memory-utilization, else min(2 GiB, 10%% of free RAM) on a CPU)"})
    memory_utilization: float | None = field(default=None, metadata={"help": "fraction of free RAM (GPU memory on a GPU) for the KV cache"})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "auto | float32 | bfloat16 | float16 | fp8 (fp8 only on GPUs with compute capability >= 8.9)"})
    max_model_len: int | None = field(default=None, metadata={"help": "prompt + output tokens per request (default: the model's, at most 8192)"})
    max_num_batched_tokens: int | None = field(default=None, metadata={"help": "token budget of one decode step (default 512 on a CPU, 8192 on a GPU)"})
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences running at once"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "share KV blocks of common prompt prefixes"})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": "split long prompts across steps so decoding never stalls"})
    index_dir: str | None = field(default=None, metadata={"help": "root of the named indexes (default $EMBEDSERVE_HOME/indexes)"})
    threads: int | None = field(default=None, metadata={"help": "torch intra-op threads (default: all cores)"})
    log_level: str = field(default="info", metadata={"help": "debug | info | warning"})
    shutdown_timeout: float = field(default=30.0, metadata={"help": "on SIGTERM: seconds requests in flight may take to finish (new ones get 503, /ready 503 at once)"})
    stall_timeout: float = field(default=60.0, metadata={"help": "an engine busy on one batch or step longer than this turns /health to 503"})

    def __post_init__(self):
        if self.max_batch_tokens is None:
            self.max_batch_tokens = 16384 if self.device.startswith("cuda") else 4096
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if self.device.startswith("cuda") else 512
        if self.generate_model.lower() in ("none", "", "off"):
            self.generate_model = "none"
        if self.memory_utilization is not None and not 0 < self.memory_utilization < 1:
            raise ConfigError(f"--memory-utilization {self.memory_utilization} must be a fraction in (0, 1)")
        if self.shutdown_timeout < 0 or self.stall_timeout <= 0:
            raise ConfigError("--shutdown-timeout must be >= 0 and --stall-timeout > 0 (seconds)")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port} is not a TCP port")
        self.dtype = normalize_dtype(self.dtype)
        for name in ("max_batch_tokens", "max_batch_size", "max_client_batch_size", "max_queued_tokens",
                     "max_concurrent_requests", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_queued_tokens < self.max_batch_tokens:
            raise ConfigError(f"--max-queued-tokens {self.max_queued_tokens} is below --max-batch-tokens "
                              f"{self.max_batch_tokens}: a full batch could never queue; raise it")
        if not self.models:
            raise ConfigError("--model names no model; pass a bundled name or a local directory")
        if not self.api_keys:
            self.api_key = None
        if self.rate_limit is not None and not self.rate_limit > 0:
            raise ConfigError(f"--rate-limit {self.rate_limit} must be above 0 requests per second")
        if self.rate_burst is not None:
            if self.rate_limit is None:
                raise ConfigError("--rate-burst needs --rate-limit (requests per second) to mean anything")
            if self.rate_burst < 1:
                raise ConfigError(f"--rate-burst {self.rate_burst} must be at least 1")
        elif self.rate_limit is not None:
            self.rate_burst = max(1, math.ceil(self.rate_limit))

    @property
    def models(self) -> list[str]:
        """The embedding models to serve, the default (first) one first."""
        return [m.strip() for m in self.model.split(",") if m.strip()]

    @property
    def api_keys(self) -> list[str]:
        """The keys given by --api-key (repeated or comma-separated); --api-key-file adds its own."""
        return [check_api_key(k.strip(), f"--api-key value {i + 1}")
                for i, k in enumerate(k for k in (self.api_key or "").split(",") if k.strip())]

    @property
    def origins(self) -> list[str]:
        """The origins CORS allows (empty: no CORS headers at all)."""
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]

    def check_model_limits(self, model_max_input: int) -> int:
        """The effective max input length, or ConfigError if the batch budget cannot hold it."""
        limit = self.max_input_length or model_max_input
        if limit > model_max_input:
            raise ConfigError(f"--max-input-length {limit} exceeds the model's limit of {model_max_input} "
                              "tokens (its position embeddings); lower it")
        if limit > self.max_batch_tokens:
            raise ConfigError(f"max input length {limit} tokens is above --max-batch-tokens "
                              f"{self.max_batch_tokens}: a longest input could never be batched; raise "
                              f"--max-batch-tokens to at least {limit} or lower --max-input-length")
        return limit


def check_api_key(key: str, where: str) -> str:
    """`key` if a bearer token can carry it; the error names `where` it came from, never the key."""
    if any(c.isspace() or c == "," for c in key) or not (key.isascii() and key.isprintable()):
        raise ConfigError(f"{where}: an API key is printable ASCII without whitespace or commas "
                          "(what an HTTP header carries intact)")
    return key


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_default(name: str, default, kind: str | None = None):
    """`EMBEDSERVE_<NAME>` overrides a field's default, converted to the field's type (`kind`,
    the dataclass annotation, else the default's type); a value that does not convert is a
    ConfigError naming the variable, never a silent default."""
    var = "EMBEDSERVE_" + name.upper()
    raw = os.environ.get(var)
    if raw is None:
        return default
    kind = kind or type(default).__name__
    if kind == "bool":
        if raw.strip().lower() not in _TRUE + _FALSE:
            raise ConfigError(f"{var}={raw!r} is not a boolean; set it to one of {', '.join(_TRUE + _FALSE)}")
        return raw.strip().lower() in _TRUE
    for typ, what in ((int, "a whole number"), (float, "a number")):
        if kind.split(" |")[0] == typ.__name__:
            try:
                return typ(raw)
            except ValueError:
                raise ConfigError(f"{var}={raw!r} is not {what}; set it to {what} or unset it") from None
    return raw


def config_fields():
    return fields(ServerConfig)
