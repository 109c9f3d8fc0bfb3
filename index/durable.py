"""Crash-safe file operations: write to a temp name, fsync, rename, fsync the directory.

Every temp name starts with `TMP_PREFIX`, so a process killed mid-write leaves only entries
that readers ignore and `clean_temp` removes. The index's own; embedserve's model converters
build on them too (`embedserve.fsutil.install_dir`).

Out of space (ENOSPC, EDQUOT) is a `StorageFullError` naming the volume, and the temp file is
removed. Each volume's state is kept here (`volume_state`): full from the first refused write
(logged once) until a write to it succeeds again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Iterator

from .errors import StorageFullError

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
    """`writer(tmp)` fills a temp file (e.g. faiss.write_index), which is then fsynced and renamed.
    On any failure the temp file is removed; out of space is a `StorageFullError`."""
    tmp = temp_path(final)
    with refused_when_full(final):
        try:
            writer(tmp)
            _check_simulated_room(tmp)
            fsync_file(tmp)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(final.parent)
    note_written(final)


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


# ------------------------------------------------------------------ full volumes
LOW_SPACE_BYTES = 1 << 20       # an I/O error with less room than this left is taken for "full"


def out_of_space(exc: BaseException) -> bool:
    """Is `exc` the OS saying there is no room (ENOSPC, or EDQUOT: over the user's quota), not yet
    recorded as a StorageFullError?"""
    return (isinstance(exc, OSError) and not isinstance(exc, StorageFullError)
            and exc.errno in (errno.ENOSPC, errno.EDQUOT))


@contextlib.contextmanager
def refused_when_full(path: str | os.PathLike, outcome: str = "this write was not applied") -> Iterator[None]:
    """Inside the block, the OS's out of space (see `out_of_space`) becomes the typed
    StorageFullError for `path` (`note_full`); any other error passes through as it is."""
    try:
        yield
    except OSError as exc:
        if out_of_space(exc):
            raise note_full(path, exc.strerror or str(exc), outcome) from exc
        raise


def volume_of(path: str | os.PathLike) -> str:
    """The mount point of the volume holding `path` (which need not exist yet)."""
    p = Path(os.path.abspath(path))
    simulated = _simulated_volume(p)
    if simulated is not None:
        return str(simulated[0])
    while not p.exists() and p != p.parent:
        p = p.parent
    p = p.resolve()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p)


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still use on the volume holding `path`."""
    p = Path(os.path.abspath(path))
    simulated = _simulated_volume(p)
    if simulated is not None:
        return max(0, simulated[1] - _used_bytes(simulated[0]))
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


@dataclass(slots=True)
class VolumeState:
    """One volume as this process's writes found it."""

    volume: str
    full_since: float | None = None     # when a write first found it full; None: the last write fit
    reason: str | None = None           # the last refusal's cause ("No space left on device", SQLite's)
    refused: int = 0                    # writes (and snapshots) refused for lack of room, ever
    episodes: int = 0                   # times it went from "fits" to "full"

    @property
    def full(self) -> bool:
        return self.full_since is not None


_volumes: dict[str, VolumeState] = {}
_volumes_lock = threading.Lock()
_any_full = False                       # fast path for `note_written`: nothing to clear


def volume_state(path: str | os.PathLike) -> VolumeState:
    """The state of the volume holding `path` (a copy)."""
    volume = volume_of(path)
    with _volumes_lock:
        st = _volumes.get(volume) or VolumeState(volume)
        return VolumeState(st.volume, st.full_since, st.reason, st.refused, st.episodes)


def note_full(path: str | os.PathLike, reason: str, outcome: str = "this write was not applied") -> StorageFullError:
    """Record that writing `path` found no room; the error to raise (`outcome` says what it cost).
    Logged once per episode (until a write to that volume succeeds), without a traceback."""
    global _any_full
    volume = volume_of(path)
    where = Path(path).parent
    err = StorageFullError(
        f"the volume holding the index is full (mounted at {volume}, writing in {where}: {reason}); {outcome}. "
        f"Free space on {volume} or grow that volume: writes succeed again as soon as there is room, without "
        "a restart", volume=volume, path=str(path))
    with _volumes_lock:
        st = _volumes.setdefault(volume, VolumeState(volume))
        first = st.full_since is None
        if first:
            st.full_since, st.episodes = time.time(), st.episodes + 1
        st.refused += 1
        st.reason = reason
        _any_full = True
    if first:
        logger.warning("index volume %s is full (%s, writing in %s): writes are refused until there is room; "
                       "free space there or grow the volume (said once, until a write succeeds)",
                       volume, reason, where)
    return err


def note_written(path: str | os.PathLike) -> None:
    """Record that a write to `path` succeeded: its volume has room (again)."""
    global _any_full
    if not _any_full:
        return
    volume = volume_of(path)
    with _volumes_lock:
        st = _volumes.get(volume)
        if st is None or st.full_since is None:
            return
        lasted, st.full_since = time.time() - st.full_since, None
        _any_full = any(v.full_since is not None for v in _volumes.values())
    logger.warning("index volume %s has room again: a write succeeded after %.0f s full", volume, lasted)


# Test-only fault point, for machines where no tmpfs can be mounted (CI without root): with
# EMBEDSERVE_TEST_VOLUME_QUOTA=<file>, the directory holding <file> acts as a volume of as many
# bytes as <file> says (no file: no limit). A temp file that does not fit fails with ENOSPC
# before its rename, and the doc store caps SQLite's page count (docstore), so SQLite itself
# answers "database or disk is full".
QUOTA_ENV = "EMBEDSERVE_TEST_VOLUME_QUOTA"


def _simulated_volume(path: Path) -> tuple[Path, int] | None:
    """(the simulated volume's directory, its size) when `path` lies in one."""
    quota = os.environ.get(QUOTA_ENV)
    if not quota:
        return None
    quota_file = Path(os.path.abspath(quota))
    try:
        size = int(quota_file.read_text().strip())
    except (OSError, ValueError):
        return None
    root = quota_file.parent
    return (root, size) if path == root or root in path.parents else None


def simulated_room(path: str | os.PathLike) -> int | None:
    """Bytes left in the test-only simulated volume holding `path`; None outside one."""
    simulated = _simulated_volume(Path(os.path.abspath(path)))
    return None if simulated is None else simulated[1] - _used_bytes(simulated[0])


def _check_simulated_room(tmp: Path) -> None:
    room = simulated_room(tmp)
    if room is not None and room < 0:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))


def _used_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total
