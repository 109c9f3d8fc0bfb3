"""One open index version: manifest + doc store + dense + sparse, kept consistent.

Writes commit to SQLite first (that commit is the acknowledgement), then apply to the
in-memory FAISS index and postings. Snapshots of those two are written now and then, each
under a new name, and committed by atomically replacing `manifest.json`, which records
the sequence number they hold; opening loads the snapshots and replays the doc store from
there. A kill at any moment therefore loses nothing acknowledged.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import numpy as np

from . import search as search_mod
from .dense import DenseIndex
from .docstore import DB_NAME, Change, DocStore, Document, Sparse, content_hash
from .durable import clean_temp, file_lock, sha256_file
from .errors import ConflictError, IndexCorruptError, StorageFullError, ValidationError
from .manifest import Manifest, ModelIdentity
from .sparse import SparseIndex

logger = logging.getLogger(__name__)

MAX_ID_CHARS = 512
MAX_METADATA_BYTES = 64 * 1024
# Held by anyone with a temp file in a version directory (snapshots, a migration's checkpoint):
# an opening Index removes stray temp files under it, so it never removes a live writer's.
TEMP_LOCK = ".lock"
NORM_TOLERANCE = 1e-3          # fp32 models normalize to ~1e-7; bf16 ones to ~1e-3


class SnapshotError(Exception):
    """A snapshot file is missing or does not match the manifest's checksum."""


class Index:
    """A version directory, open for reading and writing (thread-safe)."""

    def __init__(self, path: Path, identity: ModelIdentity | None = None, *,
                 snapshot_min_ops: int = 1000, verify_checksums: bool = True):
        self.path = Path(path)
        self.snapshot_min_ops = snapshot_min_ops
        self.verify_checksums = verify_checksums
        self._lock = threading.RLock()
        self._closed = False
        self._snapshot_after = 0        # after a snapshot found the volume full: the seq to try again at
        with file_lock(self.path / TEMP_LOCK):   # writers of temp files here hold it meanwhile
            clean_temp(self.path)
        self.manifest = Manifest.load(self.path)
        if identity is not None:
            self.manifest.check(identity, "open")
        self.docs = DocStore(self.path / DB_NAME)
        self._load()

    @property
    def name(self) -> str:
        return self.manifest.index

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def key(self) -> str:
        """What `IndexStore.live` names this version by."""
        return self.version

    @property
    def lock(self) -> threading.RLock:
        """Held by every read and write of this object; hold it to see one consistent state."""
        return self._lock

    # ------------------------------------------------------------ open/replay
    def _load(self) -> None:
        """Load the manifest's snapshots (or start empty), then replay the doc store."""
        m = self.manifest
        self.dense, self.sparse, self.applied = DenseIndex(m.dimension, m.dense_config), SparseIndex(m.sparse), 0
        if m.files:
            try:
                self.dense, self.sparse = self._read_snapshots(m)
                self.applied = m.applied_seq
            except (SnapshotError, OSError, RuntimeError, ValueError, KeyError) as exc:
                logger.warning("index %s/%s: snapshot unusable (%s); rebuilding from the doc store",
                               m.index, m.version, exc)
        self.snapshot_seq = self.applied
        self.catch_up()
        self.dense.mark_stale_except(self.docs.live_labels())
        db = self.docs.counts()
        if self.dense.live != db["dense"] or len(self.sparse) != db["sparse"]:
            logger.warning("index %s/%s: after replay FAISS has %d, postings %d, SQLite %s; rebuilding",
                           m.index, m.version, self.dense.live, len(self.sparse), db)
            self.rebuild()

    def _read_snapshots(self, m: Manifest) -> tuple[DenseIndex, SparseIndex]:
        paths = {}
        for part in ("dense", "sparse"):
            info = m.files[part]
            p = self.path / info["file"]
            if not p.is_file():
                raise SnapshotError(f"{p.name} is missing")
            if self.verify_checksums and sha256_file(p) != info["sha256"]:
                raise SnapshotError(f"{p.name} does not match its checksum in the manifest")
            paths[part] = p
        return (DenseIndex.load(paths["dense"], m.dimension, m.dense_config),
                SparseIndex.load(paths["sparse"], m.sparse))

    def catch_up(self) -> None:
        """Apply every write committed after `applied` (ours or another process's)."""
        seq = self.docs.seq()
        if seq == self.applied:
            return
        if 0 < self.applied < self.docs.pruned_upto():
            # Another process snapshotted and forgot removals we have not seen: reload.
            self.manifest = Manifest.load(self.path)
            self._load()
            return
        with self.docs.reading():
            seq = self.docs.seq()
            dead = self.docs.dead_since(self.applied)
            self._remove(dead)
            for batch in self.docs.rows_since(self.applied):
                self._add(batch)
        self.applied = seq

    def _add(self, rows: list[tuple[int, np.ndarray | None, Sparse | None]]) -> None:
        with_dense = [(lab, d) for lab, d, _ in rows if d is not None]
        bad = next((lab for lab, d in with_dense if d.shape != (self.manifest.dimension,)), None)
        if bad is not None:
            raise IndexCorruptError(f"index {self.name}/{self.version}: the doc store holds vectors that do not "
                                    f"have the manifest's {self.manifest.dimension} dimensions (label {bad}); "
                                    "the manifest was changed by hand or the files were mixed")
        if with_dense:
            self.dense.add(np.array([lab for lab, _ in with_dense], dtype=np.int64),
                           np.stack([d for _, d in with_dense]))
        for lab, _, s in rows:
            if s is not None:
                self.sparse.add(lab, s[0], s[1])

    def _remove(self, labels) -> None:
        labels = np.asarray(labels, dtype=np.int64)
        self.dense.remove(labels)
        for lab in labels.tolist():
            self.sparse.remove(lab)

    def _apply(self, change: Change) -> None:
        """Apply our own committed write; fall back to a replay if someone else wrote in between."""
        try:
            if change.base != self.applied:
                self.catch_up()
                return
            self._remove(change.removed)
            self._add(change.added)
            self.applied = change.seq
        except Exception:
            logger.exception("index %s/%s: applying a write failed; rebuilding from the doc store",
                             self.name, self.version)
            self.rebuild()

    def rebuild(self) -> None:
        """Rebuild FAISS and the postings from the doc store (the source of truth)."""
        with self._lock:
            m = self.manifest
            self.dense, self.sparse, self.applied = DenseIndex(m.dimension, m.dense_config), SparseIndex(m.sparse), 0
            self.catch_up()

    # ----------------------------------------------------------------- writes
    def pending(self, docs: list[Document]) -> list[bool]:
        """For each document: does it need (new) vectors? False when its text is already stored."""
        with self._lock:
            known = self.docs.hashes([d.id for d in docs])
        return [known.get(d.id, (None,))[0] != content_hash(d.text) for d in docs]

    def upsert(self, docs: list[Document], dense: list[np.ndarray | None], sparse: list[Sparse | None],
               identity: ModelIdentity) -> Change:
        """Insert or replace documents with the vectors `identity`'s model made for them."""
        validate_documents(docs)
        if not len(docs) == len(dense) == len(sparse):
            raise ValidationError(f"{len(docs)} documents but {len(dense)} dense and {len(sparse)} sparse vectors")
        with self._lock:
            self.manifest.check(identity, "write to")
            for i, (d, s) in enumerate(zip(dense, sparse)):
                if d is None and s is None:
                    continue
                check_vectors(self.manifest, i, d, s)
            change = self.docs.upsert(docs, dense, sparse)
            self._apply(change)
            self._maybe_snapshot()
        return change

    def delete(self, ext_ids: list[str], identity: ModelIdentity | None = None) -> Change:
        """Delete documents (every part); unknown ids are reported as `missing`."""
        with self._lock:
            if identity is not None:
                self.manifest.check(identity, "write to")
            change = self.docs.delete(list(dict.fromkeys(ext_ids)))
            self._apply(change)
            self._maybe_snapshot()
        return change

    # ----------------------------------------------------------------- search
    def search(self, query: search_mod.Query, identity: ModelIdentity) -> list[search_mod.Hit]:
        """Search with vectors `identity`'s model made for the query."""
        with self._lock:
            self.manifest.check(identity, "search")
            if query.dense is not None and np.asarray(query.dense).shape != (self.manifest.dimension,):
                raise ConflictError(f"dimension mismatch: the index has {self.manifest.dimension}, the query "
                                    f"vector has {np.asarray(query.dense).shape}", param="dimension")
            self.catch_up()
            return search_mod.run(query, self.dense, self.sparse, self.docs)

    # -------------------------------------------------------------- snapshots
    def _maybe_snapshot(self) -> None:
        due = max(self.snapshot_min_ops, self.dense.live // 10)
        if self.applied - self.snapshot_seq >= due and self.applied >= self._snapshot_after:
            try:
                self.snapshot()
            except StorageFullError:
                # Said once per episode where it arose. Not retried on every write meanwhile:
                # each try would write a whole snapshot again until the volume refuses it.
                self._snapshot_after = self.applied + due
            except (OSError, RuntimeError):
                # The write is committed (and acknowledged); a snapshot only shortens the next replay.
                logger.exception("index %s/%s: snapshot failed; the next open replays from SQLite",
                                 self.name, self.version)

    def snapshot(self) -> bool:
        """Write FAISS + postings under new names, then commit them by replacing the manifest.
        Returns False when the files on disk already hold every write. On failure (a full volume:
        StorageFullError) the files it wrote are removed and the manifest is the one before."""
        with self._lock, file_lock(self.path / TEMP_LOCK):
            self.catch_up()
            on_disk = Manifest.load(self.path)
            if on_disk.files and on_disk.applied_seq >= self.applied:
                self.snapshot_seq = self.applied
                return False
            if self.dense.needs_compaction():
                logger.info("index %s/%s: compacting %d stale HNSW entries", self.name, self.version,
                            len(self.dense.stale))
                self.rebuild()
            seq = self.applied
            files = {"dense": f"dense-{seq:012d}.faiss", "sparse": f"sparse-{seq:012d}.npz"}
            try:
                self.dense.save(self.path / files["dense"])
                self.sparse.save(self.path / files["sparse"])
                m = on_disk
                m.files = {part: {"file": f, "sha256": sha256_file(self.path / f),
                                  "bytes": (self.path / f).stat().st_size} for part, f in files.items()}
                m.applied_seq = seq
                m.counts = self.counts()
                m.save(self.path)              # the commit point
            except BaseException:
                self._drop_uncommitted(files.values())
                raise
            self.manifest = m
            for p in list(self.path.glob("dense-*.faiss")) + list(self.path.glob("sparse-*.npz")):
                if p.name not in files.values():
                    p.unlink(missing_ok=True)
            try:
                self.docs.prune_dead(seq)
            except StorageFullError:
                pass        # the snapshot is committed; the removals it holds are forgotten next time
            self.snapshot_seq = seq
            logger.debug("index %s/%s: snapshot at seq %d", self.name, self.version, seq)
            return True

    def _drop_uncommitted(self, names) -> None:
        """Remove snapshot files a failed snapshot wrote, unless the manifest on disk names them
        (it does when only the fsync after its rename failed)."""
        try:
            keep = {info["file"] for info in Manifest.load(self.path).files.values()}
        except Exception:                       # unreadable: keep everything, replay repairs it
            return
        for name in names:
            if name not in keep:
                (self.path / name).unlink(missing_ok=True)

    # ------------------------------------------------------------------ state
    def counts(self) -> dict[str, int]:
        """Live documents in SQLite, vectors in FAISS (stale HNSW entries excluded), rows in the postings."""
        with self._lock:
            return {"documents": self.docs.counts()["documents"], "dense": self.dense.live,
                    "sparse": len(self.sparse)}

    def describe(self) -> dict:
        """Manifest with live counts (`counts`; the manifest's own, the last snapshot's, as
        `snapshot_counts`): what `GET /v1/indexes/{name}` returns."""
        with self._lock:
            self.catch_up()
            info = json.loads(self.manifest.to_json())
            info["snapshot_counts"] = info["counts"]
            info["counts"] = info["live_counts"] = self.counts()    # live_counts: the older name
            info["sequence"] = self.applied
            info["stale_dense"] = len(self.dense.stale)
            return info

    def close(self, snapshot: bool = True) -> None:
        """Snapshot what the files do not hold yet (unless told not to), then close the doc store."""
        with self._lock:
            if self._closed:
                return
            if snapshot and self.applied != self.snapshot_seq:
                try:
                    self.snapshot()
                except StorageFullError:
                    logger.warning("index %s/%s: no room for a snapshot on close; the next open replays the "
                                   "doc store", self.name, self.version)
                except (OSError, RuntimeError):
                    logger.exception("index %s/%s: snapshot on close failed (replayed on next open)",
                                     self.name, self.version)
            self.docs.close()
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def validate_documents(docs: list[Document]) -> None:
    """Ids unique, non-empty and short; text non-empty; metadata a JSON object."""
    seen = set()
    for i, d in enumerate(docs):
        if not isinstance(d.id, str) or not d.id or len(d.id) > MAX_ID_CHARS:
            raise ValidationError(f"document {i}: `id` must be a non-empty string of at most {MAX_ID_CHARS} "
                                  "characters", param="documents")
        if d.id in seen:
            raise ValidationError(f"document {i}: id {d.id!r} appears twice in this request; send each id once",
                                  param="documents")
        seen.add(d.id)
        if not isinstance(d.text, str) or not d.text.strip():
            raise ValidationError(f"document {i} ({d.id!r}): `text` must be a non-empty string", param="documents")
        if not isinstance(d.metadata, dict):
            raise ValidationError(f"document {i} ({d.id!r}): `metadata` must be a JSON object", param="documents")
        try:
            size = len(json.dumps(d.metadata, allow_nan=False).encode())
        except (TypeError, ValueError) as exc:
            raise ValidationError(f"document {i} ({d.id!r}): metadata is not JSON ({exc})", param="documents") from None
        if size > MAX_METADATA_BYTES:
            raise ValidationError(f"document {i} ({d.id!r}): metadata is {size} bytes; the limit is "
                                  f"{MAX_METADATA_BYTES}", param="documents")
        try:
            d.text.encode("utf-8")
            d.id.encode("utf-8")
        except UnicodeEncodeError:
            raise ValidationError(f"document {i}: contains an unpaired UTF-16 surrogate; send valid Unicode",
                                  param="documents") from None


def check_vectors(m: Manifest, i: int, d, s) -> None:
    """Refuse document `i`'s vectors unless they fit the manifest (both parts, its dimension, finite, its norm)."""
    if d is None or s is None:
        raise ValidationError(f"document {i} needs both its dense vector and its {m.sparse} terms",
                              param="documents")
    d = np.asarray(d)
    if d.shape != (m.dimension,):
        raise ConflictError(f"document {i}: dimension mismatch: the index has {m.dimension}, the vector has "
                            f"{d.shape[-1] if d.ndim else 0}", param="dimension")
    if not np.isfinite(d).all():
        raise ValidationError(f"document {i}: the dense vector has NaN or infinite values", param="documents")
    norm = float(np.linalg.norm(d))
    if m.normalize and abs(norm - 1.0) > NORM_TOLERANCE:
        raise ConflictError(f"document {i}: normalization mismatch: the index holds unit vectors "
                            f"(normalize=True), this vector has norm {norm:.6f}", param="normalization")
    if norm == 0.0:
        raise ValidationError(f"document {i}: the dense vector is all zeros", param="documents")
    ids, w = s
    if len(ids) != len(w) or len(np.unique(ids)) != len(ids) or (len(w) and not np.isfinite(w).all()):
        raise ValidationError(f"document {i}: sparse terms need unique ids and finite weights",
                              param="documents")
