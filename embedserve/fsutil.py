"""Installing a whole directory once, atomically (the model converters' output), on top of the
index library's crash-safe file primitives (`index.durable`)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from index.durable import TMP_PREFIX, file_lock, fsync_dir, fsync_file

logger = logging.getLogger(__name__)


def locked(out_dir: Path):
    """Exclusive lock on a sibling lock file, so only one process builds `out_dir`."""
    return file_lock(out_dir.parent / f".{out_dir.name}.lock")


def install_dir(out_dir: Path, is_complete: Callable[[Path], bool], build: Callable[[Path], None]) -> Path:
    """Build `out_dir` once, atomically: `build(tmp)` fills a temp directory beside it under a
    file lock; it is fsynced and renamed into place, so a killed build never leaves half a
    directory. Partial builds of dead processes are removed; a complete `out_dir` is kept."""
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    prefix = f"{TMP_PREFIX}{out_dir.name}-"
    with locked(out_dir):
        if is_complete(out_dir):                 # another process finished while we waited
            return out_dir
        # under the lock, every matching temp dir belongs to a dead build
        for p in out_dir.parent.iterdir():
            if p.name.startswith(prefix):
                logger.info("removing stale partial build %s", p)
                shutil.rmtree(p, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out_dir.parent))
        try:
            tmp.chmod(0o755)                     # mkdtemp makes it 0700; models are shared
            build(tmp)
            for p in tmp.rglob("*"):
                if p.is_file():
                    fsync_file(p)
            fsync_dir(tmp)
            if out_dir.exists():
                # An incomplete leftover (our renames are atomic): move it aside first, since
                # rename cannot replace a non-empty directory.
                logger.warning("replacing incomplete directory %s", out_dir)
                stale = Path(tempfile.mkdtemp(prefix=prefix, dir=out_dir.parent))
                os.replace(out_dir, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, out_dir)
            fsync_dir(out_dir.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir
