"""glibc's malloc kept from handing a server's batch memory back to the kernel after each batch.

A batch's activations are tens of MB (all-MiniLM-L6-v2, ~3,500 tokens: 10-20 MB for each FFN
intermediate). glibc serves a block past its mmap threshold from a fresh mapping and trims the
free memory at the top of a heap past its trim threshold, so a long-running server took its
activations' pages from the kernel anew, zeroed, batch after batch: `serve` at 32 texts/request ×
8 clients (MiniLM bf16, 2-core AMX Xeon) took 7,420 minor page faults per batch, against 93 with
the settings below, and ran 33.9K input tokens/s against 37.1K with them (BENCHMARKS.md). An
in-process benchmark repeating its batches on one thread hardly faulted, so it had hidden this.

The settings: mmap threshold 32 MB (glibc's largest dynamic value, fixed so it no longer moves),
trim threshold 512 MB, top pad 64 MB. The cost: up to ~512 MB freed by a peak stays in the process
instead of going back to the system. `--keep-freed-memory false` (EMBEDSERVE_KEEP_FREED_MEMORY=0)
leaves glibc's defaults, as does a MALLOC_*_ or GLIBC_TUNABLES malloc setting of the user's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = (("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, 32 << 20), ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, 512 << 20),
            ("M_TOP_PAD", M_TOP_PAD, 64 << 20))
USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")


def keep_freed_memory() -> str | None:
    """Set glibc's malloc as above for this process: None, or why it was left as it is."""
    user = [v for v in USER_VARS if v in os.environ]
    if user or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return f"malloc settings of the environment kept ({', '.join(user) or 'GLIBC_TUNABLES'})"
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError) as exc:            # not glibc (musl, macOS): nothing to set
        return f"no glibc mallopt here ({exc})"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for name, param, value in SETTINGS:
        if mallopt(param, value) != 1:
            return f"mallopt({name}, {value}) was refused"
    return None
