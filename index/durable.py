"""Crash-safe file operations: write to a temp name, fsync, rename, fsync the directory.

Every temp name starts with `TMP_PREFIX`, so a process killed mid-write leaves only entries
that readers ignore and `clean_temp` removes. The index's own; embedserve's model converters
build on them too (`embedserve.fsutil.install_dir`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
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
def file_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive flock on `lock_path` (created if absent, never deleted: unlinking it would let
    a waiter lock a stale inode). Logs once when it has to wait for another process."""
    with open(lock_path, "a+b") as lf:
        try:
            fcntl.flock(lf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process holding %s", lock_path)
            fcntl.flock(lf, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lf, fcntl.LOCK_UN)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
