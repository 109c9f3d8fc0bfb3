"""The compute-path switches: which implementation each hot op takes on this process.

One frozen dataclass, read once per process: from the `EMBEDSERVE_<NAME>` environment variables
at first use (library use, tests), or set at start-up by the server's configuration tree
(`embedserve.config`, where each field is also a CLI flag and `embedserve plan` prints them).
The modules that branch on a switch call `current()` and key any cached probe by the switch's
value, so a changed setting never meets a stale cache. It lives here, the lowest layer, because
`kernels`, `embedserve.models` and `embedserve.precision` all read it."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Iterator

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_bool(var: str, raw: str) -> bool:
    """The boolean an environment value spells (1/true/yes/on, 0/false/no/off, any case), or a
    ValueError naming the variable. The one reading of booleans for every EMBEDSERVE_* variable."""
    value = raw.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"{var}={raw!r} is not a boolean; set it to one of {', '.join(_TRUE + _FALSE)}")
    return value in _TRUE


@dataclass(frozen=True, slots=True)
class ComputePaths:
    """The compute-path switches (each a flag `--<name>` and `EMBEDSERVE_<NAME>`)."""

    attention_backend: str = field(default="auto", metadata={
        "choices": ("auto", "triton", "reference"),
        "help": "paged-KV attention: triton (the kernels; without a GPU only under TRITON_INTERPRET=1), "
                "reference (plain torch), auto (triton on a CUDA GPU)"})
    cpu_attention: str = field(default="auto", metadata={
        "choices": ("auto", "c", "sdpa", "torch"),
        "help": "CPU C kernels: auto or c (built and used), sdpa (encoder keeps torch SDPA, the "
                "decode kernels stay), torch (no C kernels at all)"})
    amx_attention: bool = field(default=True, metadata={
        "help": "the encoder's bf16 attention as AMX tile products where the CPU has AMX-BF16 "
                "(head_dim 32 or 64); false keeps the vector C kernel"})
    bucket_rows: bool = field(default=True, metadata={
        "help": "an encoder batch's token rows padded up to one of 16 row counts per doubling (CPU): "
                "oneDNN builds a matmul per row count it meets (~10 ms for a bf16 AMX linear), so the "
                "server's ever-new batch sizes each paid it; false runs the exact row count"})
    keep_freed_memory: bool = field(default=True, metadata={
        "help": "glibc's malloc keeps freed batch memory in the process (mmap threshold 32 MB, trim "
                "threshold 512 MB; embedserve/engine/malloc_tuning.py): otherwise a server page-faults "
                "its activations in afresh on every batch; false keeps glibc's defaults"})
    fast_tokenizer: bool = field(default=True, metadata={
        "help": "ASCII and Chinese texts of BERT WordPiece models tokenized in C (kernels/cpu_wordpiece.c; the "
                "same ids as `tokenizers`, checked on probe texts at load); false: `tokenizers` for every text"})
    packed_linear: bool = field(default=True, metadata={
        "help": "linear weights reordered once into oneDNN's blocked layout (CPU)"})
    decode_gemv: bool = field(default=True, metadata={
        "help": "decode steps of up to 32 sequences take the C GEMV on row-major weights (fp32 CPU; "
                "bf16: up to 2 sequences, on a CPU with AVX512-BF16)"})
    fused_decode: bool = field(default=True, metadata={
        "help": "a decode step's layers in one C call (kernels/cpu_decode.py) instead of one call per op: "
                "float32, or bfloat16 with --decode-weights int8 or with the bf16 GEMV (AVX512-BF16)"})
    int8_kernel: str = field(default="auto", metadata={
        "choices": ("auto", "int_mm", "fbgemm"),
        "help": "int8 matmul for --dtype int8: int_mm (VNNI), fbgemm (AVX2), auto (by the CPU's flags)"})
    fast_bf16: str = field(default="auto", metadata={
        "choices": ("auto", "1", "0"),
        "help": "treat bf16 matmuls as fast (1) or slow (0) instead of detecting AVX512-BF16/AMX "
                "(auto); 0|1 imitates the other kind of CPU"})

    def __post_init__(self):
        for f in fields(self):
            value, choices = getattr(self, f.name), f.metadata.get("choices")
            if choices and value not in choices:
                raise ValueError(f"--{f.name.replace('_', '-')} {value!r}: choose {' | '.join(choices)}")
            if not choices and not isinstance(value, bool):
                raise ValueError(f"--{f.name.replace('_', '-')} {value!r}: must be true or false")

    @classmethod
    def from_env(cls) -> "ComputePaths":
        """The defaults, overridden by `EMBEDSERVE_<NAME>`; a value that does not parse is a
        ValueError naming the variable."""
        values = {}
        for f in fields(cls):
            var = "EMBEDSERVE_" + f.name.upper()
            raw = os.environ.get(var)
            if raw is None:
                continue
            values[f.name] = raw.strip().lower() if f.metadata.get("choices") else env_bool(var, raw)
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{exc} (from the environment)") from None

    def lines(self) -> list[str]:
        """`name = value` per switch, for `embedserve plan` and the start-up log."""
        return [f"{f.name} = {getattr(self, f.name)}" for f in fields(self)]


_current: ComputePaths | None = None


def current() -> ComputePaths:
    """This process's switches: those `configure` set, else read from the environment once."""
    global _current
    if _current is None:
        _current = ComputePaths.from_env()
    return _current


def configure(paths: ComputePaths) -> None:
    """Set this process's switches (the server does so once, before any model loads)."""
    global _current
    _current = paths


@contextmanager
def override(**changes) -> Iterator[ComputePaths]:
    """The switches with `changes` applied inside the block, restored after (tests, benchmarks)."""
    before = current()
    configure(replace(before, **changes))
    try:
        yield current()
    finally:
        configure(before)
