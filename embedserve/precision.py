"""One precision resolver for every model the service loads: `plan`, `serve`'s start-up log and
the loaded model agree because they all ask here.

    --dtype float32 | bfloat16 | int8   taken as asked (int8 only if its accuracy gate passes)
    --dtype auto, encoder               among the precisions whose accuracy gate passes on this
                                        model, the one measured fastest on this machine
    --dtype auto, decoder               bfloat16 only on a GPU with bf16, or on a CPU with fast bf16
                                        where it was measured faster than float32 (see BENCHMARKS.md)

Fast bf16 means AVX512-BF16 or AMX on a CPU (elsewhere torch emulates bf16, ~4x slower than fp32)
or a GPU with bf16. The `fast_bf16` compute path (`--fast-bf16 0|1`, `EMBEDSERVE_FAST_BF16=0|1`) overrides the detection — a testing aid that makes
`auto` behave as on the other kind of CPU.

The encoder's probe (accuracy of each candidate against fp32 on fixed multilingual texts, and
its speed on a large and a small batch, timed in rounds alternated with fp32's) runs once per model fingerprint and machine; its outcome is cached in
`$EMBEDSERVE_HOME/precision/`, so later starts load the encoder once and `plan` can say what
`serve` will load.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kernels import compute

from .config import normalize_dtype
from .errors import ConfigError
from .paths import cache_dir

logger = logging.getLogger(__name__)

DECODER_DTYPES = ("float32", "bfloat16")
# Accuracy gates: the minimum cosine of a candidate's dense embeddings to fp32's on the probe
# texts. bf16 keeps ~3 significant digits, so 0.999 holds for any sane model; int8 must stay
# within 0.99 (and the index retrieval test checks its recall@10 on a real set).
GATES = {"bfloat16": 0.999, "int8": 0.99}
# Measured with embedserve.studies.decode_bench on a 2-core EPYC with AVX512-BF16 (BENCHMARKS.md):
# bf16 decoding ran 1.25x fp32 at 16 concurrent sequences and 2.1x alone (--precision run).
DECODER_BF16_FASTER_ON_CPU = True


def fast_bf16_available(device: torch.device | str = "cpu") -> bool:
    """True where bf16 matmuls are fast: a CUDA GPU with bf16, or a CPU with AVX512-BF16 / AMX;
    the `fast_bf16` compute path (`--fast-bf16 0|1`) overrides."""
    forced = compute.current().fast_bf16
    if forced in ("0", "1"):
        return forced == "1"
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(CPU model name, flags) of the first CPU in /proc/cpuinfo, read once."""
    model, flags = "", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def cpu_flags() -> frozenset[str]:
    """The first CPU's flags in /proc/cpuinfo (empty where it cannot be read)."""
    return _cpuinfo()[1]


def cpu_model() -> str:
    """The first CPU's model name in /proc/cpuinfo ("" where it cannot be read)."""
    return _cpuinfo()[0]


def machine_key(device: torch.device | str = "cpu") -> str:
    """What a speed measurement depends on: the device, its model and flags, the thread count."""
    device = torch.device(device)
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
    else:
        model, all_flags = _cpuinfo()
        flags = sorted(f for f in all_flags if f.startswith(("avx", "amx")))
        what = f"{model}|{' '.join(flags)}|threads={torch.get_num_threads()}|fast_bf16={fast_bf16_available(device)}"
    return hashlib.sha256(f"{platform.machine()}|{device.type}|{what}".encode()).hexdigest()[:16]


# ------------------------------------------------------------------------- encoder
# Most accurate first; a less accurate precision is chosen only when it is clearly faster.
ACCURACY_ORDER = ("float32", "bfloat16", "int8")
CLEARLY_FASTER = 1.10


@dataclass(slots=True)
class ProbeResult:
    """One probe of a model on one machine: per candidate dtype, min cosine to fp32 and tokens/s
    on a ~2,000-token batch and on a small one (8 texts: what 1 text/request x 8 clients forms),
    float32's too; and the candidates that could not run here, with the reason."""

    min_cosine: dict[str, float] = field(default_factory=dict)
    tokens_per_s: dict[str, float] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    small_tokens_per_s: dict[str, float] = field(default_factory=dict)

    def passing(self) -> list[str]:
        return ["float32"] + [d for d, c in self.min_cosine.items() if c >= GATES[d]]

    def faster(self, dtype: str, than: str) -> bool:
        """`dtype` is clearly (10 %) faster than `than` on the large batch, and not slower on the
        small one where both were measured there."""
        big, small = self.tokens_per_s, self.small_tokens_per_s
        if big.get(dtype, 0.0) < CLEARLY_FASTER * big.get(than, 0.0):
            return False
        return dtype not in small or than not in small or small[dtype] >= small[than]

    def fastest_passing(self) -> str:
        """Going from the most accurate down, take the next passing precision only if it is
        `faster` than the one taken so far (a noise margin: accuracy breaks ties)."""
        passing = self.passing()
        best = "float32"
        for dtype in ACCURACY_ORDER[1:]:
            if dtype in passing and self.faster(dtype, best):
                best = dtype
        return best


# Bumped when the compute paths change speed (v2: oneDNN-packed linears, fused GELU, fp32
# attention for bf16; v3: the C varlen attention kernel; v4: int8 through fbgemm on AVX2-only CPUs,
# where v3 measured torch._int_mm's slow fallback; v5: the varlen kernel in the machine's vector
# width, taken on AVX2-only CPUs too; v6: the GELU in place where the post-op is slower) or the
# probe itself does (v7: each candidate timed in rounds alternated with float32, and on a small
# batch too; v6's blocks in sequence let noise pick int8 for e5 on an AVX2 CPU where it was 1.09x
# fp32 on large batches and slower on small ones): a probe cached by an older version would pick
# by stale speeds.
PROBE_VERSION = 7


def _cache_path(fingerprint: str, device) -> Path:
    return cache_dir() / "precision" / f"{fingerprint[:24]}-{machine_key(device)}-v{PROBE_VERSION}.json"


def cached_probe(fingerprint: str, device) -> ProbeResult | None:
    try:
        return ProbeResult(**json.loads(_cache_path(fingerprint, device).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def store_probe(fingerprint: str, device, result: ProbeResult) -> None:
    from index.durable import atomic_write
    path = _cache_path(fingerprint, device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(asdict(result), indent=2).encode())
    except OSError as exc:             # a read-only home (a container image): probe again next start
        logging.getLogger(__name__).warning("cannot cache the precision probe in %s (%s); it runs again at "
                                            "the next start", path.parent, exc)


def auto_candidates(device) -> list[str]:
    """What `auto` may pick besides float32: bf16 only where it is fast; int8 on a CPU."""
    out = ["bfloat16"] if fast_bf16_available(device) else []
    if torch.device(device).type == "cpu":
        out.append("int8")
    return out


@dataclass(slots=True)
class EncoderPrecision:
    """The encoder's precision as decided before loading: `dtype`, or — for auto when the probe
    has not run on this machine — the candidates the probe will choose among."""

    requested: str
    dtype: str | None
    candidates: tuple[str, ...] = ()
    reason: str = ""

    def describe(self) -> str:
        """For `plan` and the start-up log."""
        if self.dtype is not None:
            return self.dtype
        return " or ".join(self.candidates) + ", whichever passes its accuracy probe and runs fastest, else float32"

    @property
    def planning_dtype(self) -> str:
        """What a memory plan budgets for: int8 loads float32 weights first and quantizes them,
        and while the probe has not chosen, the widest candidate (float32)."""
        return "bfloat16" if self.dtype == "bfloat16" else "float32"


def encoder_precision(requested: str, device, fingerprint: str | None) -> EncoderPrecision:
    """Decide without loading weights (a cached probe outcome counts)."""
    req = normalize_dtype(requested)
    if req != "auto":
        return EncoderPrecision(req, req, reason="asked for")
    candidates = tuple(auto_candidates(device))
    if not candidates:
        return EncoderPrecision(req, "float32", reason="no faster precision on this device")
    probe = cached_probe(fingerprint, device) if fingerprint else None
    if probe is None:
        return EncoderPrecision(req, None, candidates, reason="the accuracy probe has not run on this machine")
    dtype = probe.fastest_passing()
    return EncoderPrecision(req, dtype, candidates, reason=why(probe, dtype))


def why(probe: ProbeResult, dtype: str) -> str:
    parts = [f"{d}: min cosine {probe.min_cosine[d]:.5f}" for d in probe.min_cosine]
    parts += [f"{d}: unavailable ({r})" for d, r in probe.unavailable.items()]
    speeds = [f"{d} {probe.tokens_per_s.get(d, 0):.0f} tok/s" + (
        f" ({probe.small_tokens_per_s[d]:.0f} on 8 texts)" if d in probe.small_tokens_per_s else "")
        for d in probe.passing()]
    return f"probe ({'; '.join(parts)}); passing: {', '.join(speeds)} -> {dtype}"


def check_gate(dtype: str, min_cosine: float, model_name: str) -> None:
    """Refuse an explicitly requested precision whose embeddings drift too far from fp32."""
    if dtype in GATES and min_cosine < GATES[dtype]:
        raise ConfigError(f"--dtype {dtype} is not accurate enough for {model_name}: its embeddings reach a "
                          f"minimum cosine of {min_cosine:.4f} to float32 on the probe texts (the gate is "
                          f"{GATES[dtype]}); use --dtype float32" +
                          (" or bfloat16" if dtype == "int8" else "") + " or auto")


# ------------------------------------------------------------------------- decoder
def decoder_precision(requested: str, device) -> str:
    """The decoder's dtype for `--dtype` (int8 applies to the encoder only: the decoder stays
    float32 under it)."""
    req = normalize_dtype(requested)
    if req in DECODER_DTYPES:
        return req
    if req == "int8":
        return "float32"
    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16" if fast_bf16_available(device) else "float32"
    return "bfloat16" if fast_bf16_available(device) and DECODER_BF16_FASTER_ON_CPU else "float32"
