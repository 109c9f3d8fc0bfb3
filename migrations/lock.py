"""One migration per index at a time, across processes: a lock file naming its holder."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from .errors import MigrationError


@contextlib.contextmanager
def migration_lock(index_dir: Path, name: str):
    """Hold the index's migration lock, or raise naming the pid and start time of the holder."""
    path = Path(index_dir) / ".migration.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise MigrationError(f"a migration of index {name!r} is already running ({holder}); wait for it "
                                 "or stop it first", code="migration_running") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)
