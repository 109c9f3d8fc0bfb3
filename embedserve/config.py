"""The configuration tree: one small dataclass per subsystem, each validated in `__post_init__`
with a `ConfigError` that names the flag and what to set, under one `ServerConfig` that checks
what spans sections. Every field is a CLI flag of the same name (vLLM/TEI names where they
exist) with an `EMBEDSERVE_<NAME>` environment fallback; name, type, default, limits and help
live here once, and `embedserve.cli.serve` builds the flags from them. The whole tree is built
and checked before any model loads or any port is bound.

    ServerConfig
    ├── http     HTTPConfig      bind address, keys, rate limit, body and request limits, timeouts
    ├── compute  ComputeConfig   device, precision, torch threads
    ├── paths    ComputePaths    the compute-path switches (kernels.compute: read once per process)
    ├── embed    EmbedConfig     embedding models, the token-budget batcher and its admission limits
    ├── decode   DecodeConfig    the generation model, its paged KV cache and its scheduler
    └── index    IndexConfig     where the named indexes live, FAISS search threads
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import MISSING, Field, dataclass, field, fields

from kernels.compute import ComputePaths, env_bool

from .errors import ConfigError

DEFAULT_MODEL = "multilingual-e5-small"            # the default embedder (and the index CLI's model)
DEFAULT_RERANKER = "ms-marco-MiniLM-L-12-v2"        # served beside it when no --model is given
DEFAULT_GENERATE_MODEL = "SmolLM2-135M-Instruct"
DTYPES = ("auto", "float32", "bfloat16", "int8")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "float": "float32"}
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8")
BLOCK_SIZES = (8, 16, 32, 64, 128)


def normalize_dtype(dtype: str, allowed: tuple[str, ...] = DTYPES, flag: str = "--dtype") -> str:
    """The canonical name of `dtype`, or ConfigError naming the choices."""
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in allowed:
        raise ConfigError(f"{flag} {dtype!r}: choose {', '.join(allowed)}")
    return name


def flag(name: str) -> str:
    """The CLI flag of field `name`."""
    return "--" + name.replace("_", "-")


def opt(default, help: str, *, lo=None, hi=None, above=None, below=None, choices=None, secret=False):
    """A configuration field: its default, help, and the limits `Section` checks (`lo`/`hi`
    inclusive, `above`/`below` exclusive, `choices`)."""
    meta = {"help": help, "lo": lo, "hi": hi, "above": above, "below": below, "choices": choices}
    return field(default=default, repr=not secret, metadata=meta)


class Section:
    """Checks every field against its limits (`opt`); subclasses add what spans their fields."""

    __slots__ = ()

    def __post_init__(self):
        for f in fields(self):
            check_value(f, getattr(self, f.name))


def check_value(f: Field, value) -> None:
    """ConfigError naming `f`'s flag when `value` is outside the field's limits."""
    m, name = f.metadata, flag(f.name)
    if value is None:
        return
    if isinstance(value, bool):
        return
    if m.get("choices"):
        if value not in m["choices"]:
            raise ConfigError(f"{name} {value!r}: choose one of {', '.join(map(str, m['choices']))}")
        return
    if isinstance(value, str):
        if len(value) > 4096:
            raise ConfigError(f"{name}: the value is {len(value)} characters long; at most 4096")
        if f.repr and not value.isprintable():     # a secret's characters are checked where it is parsed
            raise ConfigError(f"{name}: the value holds control characters; give plain text")
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} {value}: give a finite number")
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    if m.get("lo") is not None and value < m["lo"]:
        raise ConfigError(f"{name} {shown}: must be at least {m['lo']}{_upto(m)}")
    if m.get("above") is not None and value <= m["above"]:
        raise ConfigError(f"{name} {shown}: must be above {m['above']}{_upto(m)}")
    if m.get("hi") is not None and value > m["hi"]:
        raise ConfigError(f"{name} {shown}: must be at most {m['hi']:,}")
    if m.get("below") is not None and value >= m["below"]:
        raise ConfigError(f"{name} {shown}: must be below {m['below']}")


def _upto(m) -> str:
    return f" (and at most {m['hi']:,})" if m.get("hi") is not None else ""


@dataclass(slots=True)
class HTTPConfig(Section):
    """The HTTP server: where it listens, who may call it, how much one call may ask."""

    host: str = opt("127.0.0.1", "bind address (loopback unless told otherwise)")
    port: int = opt(8000, "TCP port", lo=1, hi=65535)
    served_model_name: str | None = opt(None, "name clients send as `model` (default: the model's name)")
    api_key: str | None = opt(None, "require `Authorization: Bearer KEY` on all routes but /health, /ready; "
                                    "any of several keys (comma-separated) works", secret=True)
    api_key_file: str | None = opt(None, "file of accepted keys, one a line (blank lines and # comments "
                                         "ignored), re-read within a second of a change")
    rate_limit: float | None = opt(None, "requests per second per API key (per client IP when no key is set); "
                                         "more gets 429 (default: no limit)", above=0, hi=1e6)
    rate_burst: int | None = opt(None, "requests a key may send at once before --rate-limit applies "
                                       "(default: the rate, at least 1)", lo=1, hi=1 << 20)
    allowed_origins: str | None = opt(None, "browser origins CORS allows (* for any; default: no CORS headers at all)")
    max_body_bytes: int = opt(2 * 1024 * 1024, "largest request body; more gets 413", lo=1, hi=1 << 34)
    max_client_batch_size: int = opt(2048, "most inputs in one request", lo=1, hi=1 << 20)
    log_level: str = opt("info", "debug | info | warning | error", choices=("debug", "info", "warning", "error"))
    shutdown_timeout: float = opt(30.0, "on SIGTERM: seconds requests in flight may take to finish (new ones "
                                        "get 503, /ready 503 at once)", lo=0, hi=86400)
    stall_timeout: float = opt(60.0, "an engine busy on one batch or step longer than this turns /health to 503",
                               above=0, hi=86400)

    def __post_init__(self):
        Section.__post_init__(self)
        if not self.host or any(c.isspace() for c in self.host):
            raise ConfigError(f"--host {self.host!r}: give an address or host name without spaces")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("--served-model-name is empty; give the name clients send as `model`, or omit it")
        if not self.api_keys:
            self.api_key = None
        if self.rate_burst is not None and self.rate_limit is None:
            raise ConfigError("--rate-burst needs --rate-limit (requests per second) to mean anything")
        if self.rate_limit is not None and self.rate_burst is None:
            self.rate_burst = max(1, math.ceil(self.rate_limit))

    @property
    def api_keys(self) -> list[str]:
        """The keys given by --api-key (repeated or comma-separated); --api-key-file adds its own."""
        return [check_api_key(k.strip(), f"--api-key value {i + 1}")
                for i, k in enumerate(k for k in (self.api_key or "").split(",") if k.strip())]

    @property
    def origins(self) -> list[str]:
        """The origins CORS allows (empty: no CORS headers at all)."""
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]


@dataclass(slots=True)
class ComputeConfig(Section):
    """Where the models run and in what precision."""

    device: str = opt("cpu", "cpu | cuda | cuda:N")
    dtype: str = opt("auto", "auto | float32 | bfloat16 | int8 (int8: the encoder's linear layers, if accurate; "
                             "auto: the fastest precision that passes its accuracy probe on this machine, "
                             "see embedserve.precision)")
    threads: int | None = opt(None, "torch intra-op threads (default: all cores)", lo=1, hi=1024)

    def __post_init__(self):
        Section.__post_init__(self)
        if not re.fullmatch(r"cpu|cuda(:\d{1,2})?", self.device):
            raise ConfigError(f"--device {self.device!r}: choose cpu, cuda or cuda:N")
        self.dtype = normalize_dtype(self.dtype)

    @property
    def gpu(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(slots=True)
class EmbedConfig(Section):
    """The embedding models and the token-budget batcher that feeds them."""

    model: str = opt(f"{DEFAULT_MODEL},{DEFAULT_RERANKER}",
                     "embedding or reranking models: bundled names or local HF directories (a "
                     "*ForSequenceClassification checkpoint serves as a reranker); the first embedder is the "
                     "default for embeddings, the first reranker for reranking")
    max_batch_tokens: int | None = opt(None, "token budget of one model batch (default 4096 on a CPU, where larger "
                                             "batches fall out of cache, 16384 on a GPU)", lo=1, hi=1 << 22)
    max_batch_size: int = opt(256, "most inputs in one model batch", lo=1, hi=1 << 16)
    max_input_length: int | None = opt(None, "longest input in tokens (default: the model's limit)", lo=1, hi=1 << 20)
    max_queued_tokens: int = opt(262_144, "tokens allowed to wait; more gets 429", lo=1, hi=1 << 30)
    max_concurrent_requests: int = opt(512, "requests in flight; more gets 429", lo=1, hi=1 << 20)
    default_prompt_name: str | None = opt(None, "the named prompt an embedding request without `prompt_name` or "
                                                "`input_type` gets, for the models that have it (default: the model's "
                                                "own default_prompt_name, else none)")

    def __post_init__(self):
        Section.__post_init__(self)
        if not self.models:
            raise ConfigError("--model names no model; pass a bundled name or a local directory")
        self.check_queue()

    def check_queue(self) -> None:
        """ConfigError where a full batch could never queue (once the batch budget is known)."""
        if self.max_batch_tokens is not None and self.max_queued_tokens < self.max_batch_tokens:
            raise ConfigError(f"--max-queued-tokens {self.max_queued_tokens} is below --max-batch-tokens "
                              f"{self.max_batch_tokens}: a full batch could never queue; raise it")

    @property
    def models(self) -> list[str]:
        """The embedding models to serve, the default (first) one first."""
        return [m.strip() for m in self.model.split(",") if m.strip()]

    def input_limit(self, model_max_input: int) -> int:
        """The effective max input length, or ConfigError if the batch budget cannot hold it."""
        limit = self.max_input_length or model_max_input
        if limit > model_max_input:
            raise ConfigError(f"--max-input-length {limit} exceeds the model's limit of {model_max_input} "
                              "tokens (its position embeddings); lower it")
        if self.max_batch_tokens is not None and limit > self.max_batch_tokens:
            raise ConfigError(f"max input length {limit} tokens is above --max-batch-tokens "
                              f"{self.max_batch_tokens}: a longest input could never be batched; raise "
                              f"--max-batch-tokens to at least {limit} or lower --max-input-length")
        return limit


@dataclass(slots=True)
class DecodeConfig(Section):
    """The generation model (RAG answer step), its paged KV cache and its scheduler."""

    generate_model: str = opt(DEFAULT_GENERATE_MODEL, "bundled decoder name, local HF Llama directory, or none")
    block_size: int = opt(16, "tokens per KV cache block", choices=BLOCK_SIZES)
    kv_cache_memory: int | None = opt(None, "bytes for the KV cache (default: --memory-utilization, else "
                                            "min(2 GiB, 10%% of free RAM) on a CPU)", lo=1, hi=1 << 44)
    memory_utilization: float | None = opt(None, "fraction of free RAM (GPU memory on a GPU) for the KV cache",
                                           above=0, below=1)
    kv_cache_dtype: str = opt("auto", "auto (the decoder's dtype; float16 under a float32 decoder on a CPU) | "
                                      "float32 | bfloat16 | float16 | fp8 (fp8 only on GPUs with compute "
                                      "capability >= 8.9)", choices=KV_CACHE_DTYPES)
    decode_weights: str = opt("auto", "the decoder's linear weights: native (in --dtype), int8 (weight-only, per "
                                      "output channel; CPU), auto (int8 for a float32 decoder on a CPU where the model "
                                      "passes the accuracy gate of embedserve.models.int8_gate, else native)",
                              choices=("auto", "native", "int8"))
    max_model_len: int | None = opt(None, "prompt + output tokens per request (default: the model's, at most 8192)",
                                    lo=1, hi=1 << 20)
    max_num_batched_tokens: int | None = opt(None, "token budget of one decode step (default 512 on a CPU, 8192 "
                                                   "on a GPU)", lo=1, hi=1 << 22)
    max_num_seqs: int = opt(64, "most sequences running at once", lo=1, hi=4096)
    enable_prefix_caching: bool = opt(True, "share KV blocks of common prompt prefixes")
    enable_chunked_prefill: bool = opt(True, "split long prompts across steps so decoding never stalls")

    def __post_init__(self):
        Section.__post_init__(self)
        if self.generate_model.strip().lower() in ("none", "", "off"):
            self.generate_model = "none"

    @property
    def enabled(self) -> bool:
        return self.generate_model != "none"

    def check_model_len(self, max_model_len: int) -> None:
        """ConfigError where a request of `max_model_len` tokens could never be scheduled."""
        if (not self.enable_chunked_prefill and self.max_num_batched_tokens is not None
                and max_model_len > self.max_num_batched_tokens):
            raise ConfigError(f"without chunked prefill, --max-num-batched-tokens {self.max_num_batched_tokens} "
                              f"must be at least --max-model-len {max_model_len}; raise it or enable "
                              "--enable-chunked-prefill")


@dataclass(slots=True)
class IndexConfig(Section):
    """Where the named indexes live and how they search."""

    index_dir: str | None = opt(None, "root of the named indexes (default $EMBEDSERVE_HOME/indexes)")
    index_url: str | None = opt(None, "keep the indexes in PostgreSQL + pgvector instead of --index-dir: "
                                      "postgresql://user:password@host:5432/db; every replica given the same URL "
                                      "shares them (pip install 'embedserve[postgres]')", secret=True)
    index_schema: str = opt("embedserve", "with --index-url: the schema of embedserve's tables")
    index_pool_size: int = opt(16, "with --index-url: most database connections this process opens", lo=1, hi=1024)
    faiss_threads: int = opt(1, "OpenMP threads per FAISS search (1: searches are single queries and more "
                                "threads spin against the embed engine's)", lo=1, hi=1024)

    def __post_init__(self):
        Section.__post_init__(self)
        if self.index_url is not None and self.index_url.strip() == "":
            self.index_url = None
        if self.index_url is not None and not self.index_url.startswith(("postgresql://", "postgres://")):
            raise ConfigError("--index-url: give a PostgreSQL URL (postgresql://user@host:5432/db), or leave it out "
                              "to keep the indexes on local disk under --index-dir")
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", self.index_schema):
            raise ConfigError(f"--index-schema {self.index_schema!r}: use 1-63 lower-case letters, digits or '_', "
                              "not starting with a digit")

    @property
    def backend(self) -> str:
        return "postgres" if self.index_url else "local"


SECTIONS: dict[str, type] = {"http": HTTPConfig, "compute": ComputeConfig, "paths": ComputePaths,
                             "embed": EmbedConfig, "decode": DecodeConfig, "index": IndexConfig}


@dataclass(slots=True)
class ServerConfig:
    """Everything `embedserve serve` needs, one section per subsystem."""

    http: HTTPConfig = field(default_factory=HTTPConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    paths: ComputePaths = field(default_factory=ComputePaths)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    index: IndexConfig = field(default_factory=IndexConfig)

    def __post_init__(self):
        gpu = self.compute.gpu
        if self.embed.max_batch_tokens is None:
            self.embed.max_batch_tokens = 16384 if gpu else 4096
        if self.decode.max_num_batched_tokens is None:
            self.decode.max_num_batched_tokens = 8192 if gpu else 512
        self.embed.check_queue()                     # again, with the device's default budget
        if self.decode.max_model_len is not None:
            self.decode.check_model_len(self.decode.max_model_len)

    @classmethod
    def of(cls, **values) -> "ServerConfig":
        """The tree from flat field names (`model=`, `port=`, `block_size=` ...), as the CLI and the
        tests give them; unnamed fields keep their defaults."""
        parts: dict[str, dict] = {name: {} for name in SECTIONS}
        for key, value in values.items():
            section = _SECTION_OF.get(key)
            if section is None:
                raise TypeError(f"no configuration field {key!r}")
            parts[section][key] = value
        built = {}
        for name, kind in SECTIONS.items():
            try:
                built[name] = kind(**parts[name])
            except ValueError as exc:        # kernels.compute speaks ValueError; the tree speaks ConfigError
                raise ConfigError(str(exc)) from None
        return cls(**built)

    def flat(self) -> dict:
        """Every field by its flag's name (the inverse of `of`)."""
        return {f.name: getattr(getattr(self, section), f.name) for section, f in config_fields_by_section()}


def config_fields_by_section() -> list[tuple[str, Field]]:
    """(section name, field) of every configuration field, in the order `--help` lists them."""
    return [(name, f) for name, kind in SECTIONS.items() for f in fields(kind)]


def config_fields() -> list[Field]:
    """Every configuration field (each one flag)."""
    return [f for _, f in config_fields_by_section()]


_SECTION_OF = {f.name: section for section, f in config_fields_by_section()}
assert len(_SECTION_OF) == len(config_fields()), "two configuration fields share a flag name"


def field_default(f: Field):
    return f.default if f.default is not MISSING else None


def check_api_key(key: str, where: str) -> str:
    """`key` if a bearer token can carry it; the error names `where` it came from, never the key."""
    if any(c.isspace() or c == "," for c in key) or not (key.isascii() and key.isprintable()):
        raise ConfigError(f"{where}: an API key is printable ASCII without whitespace or commas "
                          "(what an HTTP header carries intact)")
    return key


def env_default(name: str, default, kind: str | None = None, choices: tuple | None = None):
    """`EMBEDSERVE_<NAME>` overrides a field's default, converted to the field's type (`kind`,
    the dataclass annotation, else the default's type); a value that does not convert, or is
    not one of `choices`, is a ConfigError naming the variable, never a silent default."""
    var = "EMBEDSERVE_" + name.upper()
    raw = os.environ.get(var)
    if raw is None:
        return default
    if choices and raw.strip() not in map(str, choices):
        raise ConfigError(f"{var}={raw!r}: choose one of {', '.join(map(str, choices))}")
    kind = kind or type(default).__name__
    if kind == "bool":
        try:
            return env_bool(var, raw)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    for typ, what in ((int, "a whole number"), (float, "a number")):
        if kind.split(" |")[0] == typ.__name__:
            try:
                return typ(raw)
            except ValueError:
                raise ConfigError(f"{var}={raw!r} is not {what}; set it to {what} or unset it") from None
    return raw


def reference_markdown() -> str:
    """The flag reference (docs/configuration.md), generated from the tree so it cannot drift:
    `python -m embedserve.config > docs/configuration.md`."""
    out = ["# Configuration", "",
           "Generated from `embedserve/config.py` (`python -m embedserve.config > docs/configuration.md`; a test",
           "checks it is current). Every flag of `embedserve serve` and `embedserve plan` has an",
           "`EMBEDSERVE_<NAME>` environment fallback; the flag wins. Values outside the limits exit 2",
           "with one line naming the flag, before any model loads or any port is bound.", ""]
    for section, kind in SECTIONS.items():
        out += [f"## `{section}`: {(kind.__doc__ or '').strip().splitlines()[0]}", "",
                "| flag | environment | default | limits | meaning |", "|---|---|---|---|---|"]
        for f in fields(kind):
            m = f.metadata
            limits = " | ".join(map(str, m["choices"])) if m.get("choices") else ", ".join(
                s for s in (f">= {m['lo']}" if m.get("lo") is not None else "",
                            f"> {m['above']}" if m.get("above") is not None else "",
                            f"<= {m['hi']:,}" if m.get("hi") is not None else "",
                            f"< {m['below']}" if m.get("below") is not None else "") if s)
            default = field_default(f)
            shown = "on" if default is True else "off" if default is False else "—" if default is None else f"`{default}`"
            name = f"`{flag(f.name)}`" + (f" / `--no-{flag(f.name)[2:]}`" if str(f.type) == "bool" else "")
            cells = [name, f"`EMBEDSERVE_{f.name.upper()}`", shown, limits.replace("|", "\\|"),
                     m.get("help", "").replace("%%", "%").replace("|", "\\|")]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(reference_markdown())
