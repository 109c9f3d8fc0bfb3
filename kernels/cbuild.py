"""Building the C sources of kernels/ at first use: the machine's C compiler, -march=native, the
shared library cached under $EMBEDSERVE_CACHE_DIR (default $EMBEDSERVE_HOME)/kernels, keyed by the
source, the flags and the CPU (a build is ~1 s, once per machine). Callers load the library with
ctypes and say why not where this returns a reason (no compiler, a failed build).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# -ffast-math lets GCC vectorize expf (glibc's libmvec) and the dot products; it is given to the
# compile step only: at the link step it would add crtfastmath.o, which flushes denormals to
# zero for the whole process. The kernels' values stay finite (no inf/NaN logic relies on IEEE).
CFLAGS = ("-O3", "-march=native", "-fPIC", "-fopenmp", "-ffast-math")
LDFLAGS = ("-shared", "-fopenmp")


def cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        wanted = ("model name", "flags")
        return "\n".join(sorted({ln for ln in text.splitlines() if ln.split(":")[0].strip() in wanted}))
    except OSError:
        return platform.processor() or platform.machine()


def build_dirs() -> list[Path]:
    """$EMBEDSERVE_CACHE_DIR (default $EMBEDSERVE_HOME)/kernels, then a per-user temp folder (a
    read-only home without a cache volume). Read from the environment: kernels/ imports nothing
    of embedserve's."""
    home = (os.environ.get("EMBEDSERVE_CACHE_DIR") or os.environ.get("EMBEDSERVE_HOME")
            or Path.home() / ".cache" / "embedserve")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return [Path(home) / "kernels", Path(tempfile.gettempdir()) / f"embedserve-kernels-{uid}"]


NO_CC = "no C compiler (cc/gcc) on PATH"


def _cc() -> str | None:
    """The C compiler: $CC, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _compile(cc: str, target: Path, source: Path, cflags: tuple[str, ...] = CFLAGS) -> str | None:
    """Compile `source` to the library `target` (atomically), `cflags` at the compile step only
    (never -ffast-math at the link: see CFLAGS); None, or why it failed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        for cmd in ([cc, *cflags, "-c", str(source), "-o", tmp + ".o"], [cc, *LDFLAGS, tmp + ".o", "-o", tmp, "-lm"]):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                return f"compiling {source.name} failed: {proc.stderr.strip().splitlines()[-1:]}"
        os.replace(tmp, target)            # atomic: a concurrent build lands the same file
    except (OSError, subprocess.SubprocessError) as exc:
        return f"compiling {source.name} failed: {exc}"
    finally:
        for leftover in (tmp, tmp + ".o"):
            if os.path.exists(leftover):
                os.unlink(leftover)
    logger.info("built %s", target)
    return None


def built(source: Path) -> tuple[Path | None, str | None]:
    """The shared library of `source` (`<stem>-<key>.so`), built where no build of this source,
    these flags and this CPU is cached yet: (its path, None) or (None, why not)."""
    cc = _cc()
    if not cc:
        return None, NO_CC
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join((cc,) + CFLAGS + LDFLAGS).encode() + cpu_id().encode()).hexdigest()[:16]
    why = None
    for folder in build_dirs():
        target = folder / f"{source.stem}-{key}.so"
        if target.exists():
            return target, None
        try:
            why = _compile(cc, target, source)
        except OSError as exc:                 # this folder is not writable: try the next
            why = f"cannot write {folder}: {exc.strerror or exc}"
            continue
        return (target, None) if why is None else (None, why)
    return None, why


def compile_uncached(source: Path, target: Path, cflags: tuple[str, ...] = CFLAGS) -> str | None:
    """Build `source` into `target` with `cflags` (no cache; for tests that build a variant, such
    as kernels/avx512_emulated.c): None, or why not."""
    cc = _cc()
    if not cc:
        return NO_CC
    return _compile(cc, target, source, cflags)
