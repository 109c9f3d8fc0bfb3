"""The doc store: SQLite in WAL mode, the source of truth for text, metadata *and* vectors.

Each write takes the next sequence numbers from `meta.seq`, inside the transaction that
changes the rows. A document's vectors carry a `label` (the sequence number of the write that
made them): the id FAISS and the postings know it by. Replacing or deleting a document
records its old label in `dead` with the sequence number of that change, so an in-memory
index that has applied every write up to sequence S catches up by removing the labels dead
after S and adding the rows labelled after S. A row's `wseq` is the sequence number of the last
write to it, its text's (= its label) or its metadata's alone: a reindex copies the rows written
after its checkpoint by `wseq`, so a metadata change made meanwhile is carried over too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from . import durable
from .docstore_file import SCHEMA, Transaction, is_full, upgrade
from .errors import ConflictError, RetiredError, ValidationError

logger = logging.getLogger(__name__)

DB_NAME = "docs.sqlite"
RETIRED = "RETIRED"          # in a version directory: a migration replaced it; no more writes

Sparse = tuple[np.ndarray, np.ndarray]      # (token ids, weights)


@dataclass(slots=True)
class Document:
    """One document as a user sends it."""

    id: str
    text: str
    metadata: dict = field(default_factory=dict)


@dataclass(slots=True)
class Change:
    """What a committed write did, for the in-memory parts to apply."""

    base: int                       # sequence number before this write
    seq: int                        # sequence number after it
    added: list[tuple[int, np.ndarray | None, Sparse | None]] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)   # ext id -> added|replaced|metadata|unchanged|deleted|missing


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _f32(blob: bytes | None) -> np.ndarray | None:
    return None if blob is None else np.frombuffer(blob, dtype="<f4")


def _sparse(ids: bytes | None, w: bytes | None) -> Sparse | None:
    if ids is None:
        return None
    return np.frombuffer(ids, dtype="<i4").astype(np.int64), np.frombuffer(w, dtype="<f4")


def _metadata_json(meta: dict) -> str:
    return json.dumps(meta, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


class DocStore:
    """One version's `docs.sqlite`. Not thread-safe on its own: the Index holds a lock."""

    def __init__(self, path: Path):
        self.path = path
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT).
        self.conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30.0)
        self._page_cap: int | None = None       # the test-only simulated volume's cap (see _transaction)
        try:
            self.conn.execute("PRAGMA journal_mode=WAL")
            # FULL: a commit is on disk before the write is acknowledged (survives power loss, not just kill -9).
            self.conn.execute("PRAGMA synchronous=FULL")
            self.conn.executescript(SCHEMA)
            upgrade(self.conn, self._transaction)
        except BaseException as exc:
            self.conn.close()
            if is_full(exc, path):
                raise durable.note_full(path, str(exc), "the doc store cannot be opened without room for its "
                                        "write-ahead log") from exc
            raise

    def close(self) -> None:
        self.conn.close()

    @property
    def source(self) -> str:
        """Where a worker process reads these documents (`index.backend.read_documents`)."""
        return str(self.path)

    # ------------------------------------------------------------------ state
    def _meta(self, key: str) -> int:
        return int(self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()[0])

    def seq(self) -> int:
        """Sequence number of the last committed write."""
        return self._meta("seq")

    def pruned_upto(self) -> int:
        """`dead` rows up to this sequence number were dropped (a snapshot holds those removals)."""
        return self._meta("pruned_upto")

    def counts(self) -> dict[str, int]:
        n, d, s = self.conn.execute(
            "SELECT COUNT(*), COUNT(dense), COUNT(sparse_ids) FROM docs").fetchone()
        return {"documents": n, "dense": d, "sparse": s}

    def hashes(self, ext_ids: list[str]) -> dict[str, tuple[str, str]]:
        """ext id -> (content hash, metadata JSON) for the ids that exist."""
        out = {}
        for chunk in _chunks(ext_ids, 500):
            q = f"SELECT ext_id, content_hash, metadata FROM docs WHERE ext_id IN ({','.join('?' * len(chunk))})"
            out.update({r[0]: (r[1], r[2]) for r in self.conn.execute(q, chunk)})
        return out

    # ----------------------------------------------------------------- writes
    def upsert(self, docs: list[Document], dense: list[np.ndarray | None],
               sparse: list[Sparse | None]) -> Change:
        """Insert or replace documents in one transaction. Same text: no-op (metadata updated
        if it differs); new text: new vectors under a new label. A doc passed without vectors
        must be unchanged (callers skip embedding those)."""
        now = time.time()
        with self._transaction() as cur:
            self._refuse_if_retired()
            seq = self._meta("seq")
            change = Change(base=seq, seq=seq)
            for doc, d, s in zip(docs, dense, sparse):
                h = content_hash(doc.text)
                meta = _metadata_json(doc.metadata)
                row = cur.execute("SELECT label, content_hash, metadata FROM docs WHERE ext_id=?",
                                  (doc.id,)).fetchone()
                if row is not None and row[1] == h:
                    if row[2] != meta:          # a write of its own (wseq), vectors and label unchanged
                        seq += 1
                        cur.execute("UPDATE docs SET metadata=?, updated_at=?, wseq=? WHERE ext_id=?",
                                    (meta, now, seq, doc.id))
                    change.outcomes[doc.id] = "metadata" if row[2] != meta else "unchanged"
                    continue
                if d is None and s is None:
                    raise ConflictError(f"document {doc.id!r} changed while it was being embedded; retry the upsert",
                                        param="documents", code="concurrent_change")
                seq += 1
                blobs = (None if d is None else np.asarray(d, "<f4").tobytes(),
                         None if s is None else np.asarray(s[0], "<i4").tobytes(),
                         None if s is None else np.asarray(s[1], "<f4").tobytes())
                if row is None:
                    cur.execute("INSERT INTO docs (ext_id, text, metadata, content_hash, label, dense, sparse_ids, "
                                "sparse_weights, created_at, updated_at, wseq) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                                (doc.id, doc.text, meta, h, seq, *blobs, now, now, seq))
                    change.outcomes[doc.id] = "added"
                else:
                    cur.execute("INSERT INTO dead VALUES (?, ?)", (row[0], seq))
                    cur.execute("UPDATE docs SET text=?, metadata=?, content_hash=?, label=?, dense=?, sparse_ids=?, "
                                "sparse_weights=?, updated_at=?, wseq=? WHERE ext_id=?",
                                (doc.text, meta, h, seq, *blobs, now, seq, doc.id))
                    change.removed.append(row[0])
                    change.outcomes[doc.id] = "replaced"
                change.added.append((seq, d, s))
            if seq != change.base:          # nothing changed: nothing to write (a full volume can still say 200)
                cur.execute("UPDATE meta SET value=? WHERE key='seq'", (seq,))
            change.seq = seq
        return change

    def delete(self, ext_ids: list[str]) -> Change:
        """Delete documents by external id, in one transaction; unknown ids are reported as missing."""
        with self._transaction() as cur:
            self._refuse_if_retired()
            seq = self._meta("seq")
            change = Change(base=seq, seq=seq)
            for ext_id in ext_ids:
                row = cur.execute("SELECT label FROM docs WHERE ext_id=?", (ext_id,)).fetchone()
                if row is None:
                    change.outcomes[ext_id] = "missing"
                    continue
                seq += 1
                cur.execute("INSERT INTO dead VALUES (?, ?)", (row[0], seq))
                cur.execute("DELETE FROM docs WHERE ext_id=?", (ext_id,))
                change.removed.append(row[0])
                change.outcomes[ext_id] = "deleted"
            if seq != change.base:          # nothing changed: nothing to write (a full volume can still say 200)
                cur.execute("UPDATE meta SET value=? WHERE key='seq'", (seq,))
            change.seq = seq
        return change

    def prune_dead(self, upto: int) -> None:
        """Forget removals a durable snapshot already holds."""
        with self._transaction() as cur:
            cur.execute("DELETE FROM dead WHERE at_seq <= ?", (upto,))
            cur.execute("UPDATE meta SET value=MAX(value, ?) WHERE key='pruned_upto'", (upto,))

    def _transaction(self) -> Transaction:
        """A write transaction; out of room is a StorageFullError, after a rollback."""
        if os.environ.get(durable.QUOTA_ENV):
            self._simulate_quota()
        return Transaction(self.conn, self.path)

    def _simulate_quota(self) -> None:
        """Test-only (durable.QUOTA_ENV): while the simulated volume is full, cap the page count
        where it is, so SQLite itself answers SQLITE_FULL to a write that needs a new page."""
        room = durable.simulated_room(self.path)
        if room is not None and room <= 0:
            if self._page_cap is None:
                self._page_cap = int(self.conn.execute("PRAGMA max_page_count").fetchone()[0])
                pages = int(self.conn.execute("PRAGMA page_count").fetchone()[0])
                self.conn.execute(f"PRAGMA max_page_count = {pages}")
        elif self._page_cap is not None:
            self.conn.execute(f"PRAGMA max_page_count = {self._page_cap}")
            self._page_cap = None

    def _refuse_if_retired(self) -> None:
        """Inside a write transaction (the version's write lock is held): a version a migration
        replaced takes no more writes; the writer retries against the live one."""
        marker = self.path.parent / RETIRED
        if marker.exists():
            raise RetiredError(f"this index version was replaced by {marker.read_text().strip()}; retry the "
                               "write (it goes to the live version)", code="version_retired")

    def reading(self):
        """A read transaction: every read inside sees one committed state (WAL snapshot)."""
        return Transaction(self.conn, self.path, "BEGIN DEFERRED")

    # ----------------------------------------------------------------- replay
    def dead_since(self, seq: int) -> np.ndarray:
        rows = self.conn.execute("SELECT label FROM dead WHERE at_seq > ?", (seq,)).fetchall()
        return np.array([r[0] for r in rows], dtype=np.int64)

    def rows_since(self, seq: int, batch: int = 2048) -> Iterator[list[tuple[int, np.ndarray | None, Sparse | None]]]:
        """Vectors of the documents labelled after `seq`, in label order, in batches."""
        last = seq
        while True:
            rows = self.conn.execute("SELECT label, dense, sparse_ids, sparse_weights FROM docs WHERE label > ? "
                                     "ORDER BY label LIMIT ?", (last, batch)).fetchall()
            if not rows:
                return
            yield [(r[0], _f32(r[1]), _sparse(r[2], r[3])) for r in rows]
            last = rows[-1][0]

    def live_labels(self) -> np.ndarray:
        return np.array([r[0] for r in self.conn.execute("SELECT label FROM docs")], dtype=np.int64)

    # ------------------------------------------------------------------ reads
    def fetch(self, labels: list[int]) -> dict[int, tuple[str, str, dict]]:
        """label -> (ext id, text, metadata) for the labels still live."""
        out = {}
        for chunk in _chunks([int(x) for x in labels], 500):
            q = f"SELECT label, ext_id, text, metadata FROM docs WHERE label IN ({','.join('?' * len(chunk))})"
            out.update({r[0]: (r[1], r[2], json.loads(r[3])) for r in self.conn.execute(q, chunk)})
        return out

    def dense_for(self, labels: list[int]) -> dict[int, np.ndarray]:
        out = {}
        for chunk in _chunks([int(x) for x in labels], 500):
            q = f"SELECT label, dense FROM docs WHERE dense IS NOT NULL AND label IN ({','.join('?' * len(chunk))})"
            out.update({r[0]: _f32(r[1]) for r in self.conn.execute(q, chunk)})
        return out

    def vector_of(self, ext_id: str) -> tuple[int, np.ndarray | None, Sparse | None] | None:
        row = self.conn.execute("SELECT label, dense, sparse_ids, sparse_weights FROM docs WHERE ext_id=?",
                                (ext_id,)).fetchone()
        return None if row is None else (row[0], _f32(row[1]), _sparse(row[2], row[3]))

    def filter_labels(self, flt: dict) -> np.ndarray:
        """Labels of documents whose metadata matches every key (scalar: equal; list: one of)."""
        where, params = [], []
        for key, values in filter_terms(flt):
            path = f'$."{key}"'
            parts = []
            for v in values:
                if v is None:
                    parts.append("json_extract(metadata, ?) IS NULL")
                    params.append(path)
                else:
                    parts.append("json_extract(metadata, ?) = ?")
                    params += [path, v]
            where.append("(" + " OR ".join(parts) + ")")
        q = "SELECT label FROM docs" + (" WHERE " + " AND ".join(where) if where else "")
        return np.array([r[0] for r in self.conn.execute(q, params)], dtype=np.int64)

    def iter_docs(self, batch: int = 1024) -> Iterator[list[tuple]]:
        """(label, ext_id, text, content_hash, dense, sparse) for every document, in batches (verify)."""
        last = -1
        while True:
            rows = self.conn.execute("SELECT label, ext_id, text, content_hash, dense, sparse_ids, sparse_weights "
                                     "FROM docs WHERE label > ? ORDER BY label LIMIT ?", (last, batch)).fetchall()
            if not rows:
                return
            yield [(r[0], r[1], r[2], r[3], _f32(r[4]), _sparse(r[5], r[6])) for r in rows]
            last = rows[-1][0]

    def documents_after(self, seq: int, limit: int = 1024) -> list[tuple[int, Document]]:
        """(wseq, document) of the live documents last written (text or metadata) after sequence
        number `seq`, in write order: a reindex reads the live version by these, so a rerun or a
        catch-up continues where it stopped."""
        rows = self.conn.execute("SELECT wseq, ext_id, text, metadata FROM docs WHERE wseq > ? ORDER BY wseq "
                                 "LIMIT ?", (seq, limit)).fetchall()
        return [(r[0], Document(r[1], r[2], json.loads(r[3]))) for r in rows]

    def writes_after(self, seq: int) -> np.ndarray:
        """The `wseq` of the live documents last written after `seq`, ascending (a reindex on Ray
        cuts its shards by them)."""
        rows = self.conn.execute("SELECT wseq FROM docs WHERE wseq > ? ORDER BY wseq", (seq,))
        return np.fromiter((r[0] for r in rows), dtype=np.int64)

    def ids(self) -> set[str]:
        """The ext ids of every live document (a reindex's catch-up finds deletions by these)."""
        return {r[0] for r in self.conn.execute("SELECT ext_id FROM docs")}

    def integrity(self) -> str:
        return self.conn.execute("PRAGMA quick_check").fetchone()[0]


def filter_terms(flt: dict) -> list[tuple[str, list]]:
    """A metadata filter as (key, accepted values), checked: every key a non-empty string
    without quotes or backslashes; values strings, numbers, booleans or null (a scalar, or a
    non-empty list of them: one of). Every backend reads filters through this."""
    out = []
    for key, value in flt.items():
        if not isinstance(key, str) or not key or any(c in key for c in '"\\\x00'):
            raise ValidationError(f"filter key {key!r} must be a non-empty string without quotes, "
                                  "backslashes or NUL characters", param="filter")
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ValidationError(f"filter {key!r} lists no values; give at least one", param="filter")
        for v in values:
            if v is not None and not isinstance(v, (str, int, float, bool)):
                raise ValidationError(f"filter {key!r}: values are strings, numbers, booleans or null "
                                      f"(or a list of them), not {type(v).__name__}", param="filter")
        out.append((key, values))
    return out


def _chunks(items: list, n: int):
    for i in range(0, len(items), n):
        yield items[i:i + n]


def read_documents(path: Path, after: int, upto: int) -> list[tuple[int, Document]]:
    """(wseq, document) of the live documents with `after` < wseq <= `upto`, in write order,
    over a read-only connection of its own: a reindex shard, read by a worker process while the
    live version keeps taking writes."""
    conn = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True, timeout=30.0)
    try:
        rows = conn.execute("SELECT wseq, ext_id, text, metadata FROM docs WHERE wseq > ? AND wseq <= ? "
                            "ORDER BY wseq", (after, upto)).fetchall()
    finally:
        conn.close()
    return [(r[0], Document(r[1], r[2], json.loads(r[3]))) for r in rows]


def read_counts(path: Path) -> dict[str, int]:
    """A doc store's live counts over a read-only connection (an index not open in this process)."""
    conn = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True, timeout=30.0)
    try:
        n, d, s = conn.execute("SELECT COUNT(*), COUNT(dense), COUNT(sparse_ids) FROM docs").fetchone()
    finally:
        conn.close()
    return {"documents": n, "dense": d, "sparse": s}
