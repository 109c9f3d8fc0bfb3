"""The doc store's SQLite file: its schema, the one upgrade of it (`wseq`), and the transactions
every read and write runs in, which turn an out-of-room failure into StorageFullError."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Callable

from . import durable

logger = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (
    id INTEGER PRIMARY KEY,
    ext_id TEXT NOT NULL UNIQUE,
    text TEXT NOT NULL,
    metadata TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    label INTEGER NOT NULL UNIQUE,
    dense BLOB,
    sparse_ids BLOB,
    sparse_weights BLOB,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    wseq INTEGER
);
CREATE TABLE IF NOT EXISTS dead (label INTEGER PRIMARY KEY, at_seq INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS dead_at_seq ON dead (at_seq);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('seq', 0), ('pruned_upto', 0);
"""


def upgrade(conn: sqlite3.Connection, transaction: Callable[[], "Transaction"]) -> None:
    """A doc store written before `wseq` existed gets it (= label: the last write to each row
    the store knows of), in one transaction, once."""
    if not any(r[1] == "wseq" for r in conn.execute("PRAGMA table_info(docs)")):
        with transaction() as cur:
            if not any(r[1] == "wseq" for r in cur.execute("PRAGMA table_info(docs)")):
                cur.execute("ALTER TABLE docs ADD COLUMN wseq INTEGER")
                cur.execute("UPDATE docs SET wseq = label")
    conn.execute("CREATE INDEX IF NOT EXISTS docs_wseq ON docs (wseq)")


class Transaction:
    """BEGIN IMMEDIATE (take the write lock up front: no upgrade deadlocks) ... COMMIT or ROLLBACK.

    A failed statement or COMMIT is rolled back (SQLite may or may not have done so itself after
    SQLITE_FULL or an I/O error), so the connection takes the next write once there is room;
    out of room is raised as StorageFullError."""

    def __init__(self, conn: sqlite3.Connection, path: Path, begin: str = "BEGIN IMMEDIATE"):
        self.conn = conn
        self.path = path
        self.begin = begin
        self.changes = 0            # the connection's total_changes at BEGIN

    def __enter__(self) -> sqlite3.Cursor:
        self.changes = self.conn.total_changes
        try:
            self.conn.execute(self.begin)
        except sqlite3.Error as exc:
            self._raise_if_full(exc)
            raise
        return self.conn.cursor()

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self._rollback()
            self._raise_if_full(exc)
            return False
        try:
            self.conn.execute("COMMIT")
        except BaseException as commit_exc:
            self._rollback()
            self._raise_if_full(commit_exc)
            raise
        if self.conn.total_changes != self.changes:     # it wrote something: the volume had room
            durable.note_written(self.path)
        return False

    def _rollback(self) -> None:
        """Roll back what is still open (after SQLITE_FULL, SQLite may have done it already)."""
        if self.conn.in_transaction:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error as exc:
                logger.warning("doc store %s: rollback failed (%s)", self.path, exc)

    def _raise_if_full(self, exc: BaseException) -> None:
        if is_full(exc, self.path):
            raise durable.note_full(self.path, str(exc)) from exc


def is_full(exc: BaseException, path: Path) -> bool:
    """SQLITE_FULL ("database or disk is full"), ENOSPC, or an I/O error (a failed fsync, a -shm
    file that cannot grow) on a volume with (almost) no room left."""
    if not isinstance(exc, sqlite3.Error):
        return durable.out_of_space(exc)
    code = getattr(exc, "sqlite_errorcode", None)       # Python 3.11+
    if code == sqlite3.SQLITE_FULL or (code is None and "database or disk is full" in str(exc)):
        return True
    io_error = code & 0xFF == sqlite3.SQLITE_IOERR if code is not None else "disk I/O error" in str(exc)
    if not io_error:
        return False
    try:
        return durable.free_bytes(path) < durable.LOW_SPACE_BYTES
    except OSError:
        return False
