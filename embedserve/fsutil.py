"""Crash-safe file operations: write to a temp name, fsync, rename, fsync the directory.

Every temp name starts with `TMP_PREFIX`, so a process killed mid-write leaves only entries
that readers ignore and `clean_temp` removes. Used by the index (files) and by the model
converters (whole directories, `install_dir`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

logger = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"


def temp_path(final: Path) -> Path:
    """A unique temp name beside `final` (same directory, so the rename is atomic)."""
    return final.with_name(f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:12]}")


def fsync_dir(path: Path) -> None:
    """Make a rename or create inside `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(final: Path, data: bytes) -> None:
    """Replace `final` with `data`: a reader sees the whole old or the whole new file."""
    atomic_write_with(final, lambda tmp: tmp.write_bytes(data))


def atomic_write_with(final: Path, writer: Callable[[Path], object]) -> None:
    """`writer(tmp)` fills a temp file (e.g. faiss.write_index), which is then fsynced and renamed."""
    tmp = temp_path(final)
    try:
        writer(tmp)
        fsync_file(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


def clean_temp(directory: Path, min_age_s: float = 0.0) -> int:
    """Remove stray temp entries (files or directories) a killed writer left behind; with
    `min_age_s`, only those that old (a live writer in another process may own a fresh one)."""
    n = 0
    if not directory.is_dir():
        return 0
    now = time.time()
    for entry in directory.iterdir():
        if entry.name.startswith(TMP_PREFIX):
            try:
                if min_age_s and now - entry.lstat().st_mtime < min_age_s:
                    continue
            except FileNotFoundError:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            n += 1
    if n:
        logger.info("removed %d stray temp entries in %s", n, directory)
    return n


@contextlib.contextmanager
def locked(out_dir: Path) -> Iterator[None]:
    """Exclusive flock on a sibling lock file, so only one process builds `out_dir`."""
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    # The lock file is never deleted: unlinking it would let a waiter lock a stale inode.
    with open(lock_path, "a+b") as lf:
        try:
            fcntl.flock(lf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building %s", out_dir)
            fcntl.flock(lf, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lf, fcntl.LOCK_UN)


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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
