"""Where embedserve keeps its files (a leaf module: it imports nothing of ours)."""

from __future__ import annotations

import os
from pathlib import Path


def embedserve_home() -> Path:
    """$EMBEDSERVE_HOME, default ~/.cache/embedserve: converted models, indexes, cached probes."""
    return Path(os.environ.get("EMBEDSERVE_HOME") or Path.home() / ".cache" / "embedserve")


def cache_dir() -> Path:
    """$EMBEDSERVE_CACHE_DIR, default $EMBEDSERVE_HOME: what a process learns about its machine
    at run time (precision probes, built kernels). Apart from the home so that a read-only home
    (a container image, its models converted at build time) can keep them on a volume."""
    return Path(os.environ.get("EMBEDSERVE_CACHE_DIR") or embedserve_home())


def index_root(index_dir: str | os.PathLike | None = None) -> Path:
    """The root of the named indexes: `index_dir` if given, else $EMBEDSERVE_HOME/indexes."""
    return Path(index_dir).expanduser() if index_dir else embedserve_home() / "indexes"
