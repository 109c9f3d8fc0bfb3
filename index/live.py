"""The indexes a long-running process keeps open: one per name, following the live version
(`CURRENT` on disk, the `indexes` row in PostgreSQL), read on every access, so a version swap
(a reindex migration, made by any process) is picked up on the next request.

Requests hold the version they use by a lease (`with live.lease(name) as ix:`, or `acquire` /
`release`). A version `CURRENT` moved away from (or an index being deleted) leaves the open set
at once and is closed — SQLite handles closed, FAISS and postings dropped — when its last
lease is released, so a request in flight at a swap finishes on the version it took and no
replaced version outlives its requests.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .core import Index
from .manifest import ModelIdentity
from .store import IndexStore

logger = logging.getLogger(__name__)


class LiveIndexes:
    """A store and its open indexes (thread-safe): the local one under `root`, or `store` (any
    backend's, e.g. `index.backend.open_store(url)`'s)."""

    def __init__(self, root: str | Path | None = None, store=None):
        self.root = Path(root) if root is not None else None
        self._store = store
        self._open: dict[str, Index] = {}
        self._leases: dict[Index, int] = {}    # leases held on each open or replaced version
        self._replaced: set[Index] = set()     # out of the open set, closed when their last lease goes
        self._lock = threading.Lock()

    @property
    def store(self) -> IndexStore:
        if self._store is None:
            self._store = IndexStore(self.root)
        return self._store

    @contextmanager
    def lease(self, name: str, identity: ModelIdentity | None = None) -> Iterator[Index]:
        """The live version of `name`, held for the block (see `acquire`)."""
        ix = self.acquire(name, identity)
        try:
            yield ix
        finally:
            self.release(ix)

    def acquire(self, name: str, identity: ModelIdentity | None = None) -> Index:
        """Lease the live version of `name`, (re)opened when `CURRENT` moved; refused on
        mismatch. Every `acquire` is paired with one `release` of the index it returned."""
        version, key = self.store.live(name)
        doomed = None
        with self._lock:
            ix = self._open.get(name)
            if ix is not None and ix.key != key:
                logger.info("index %s: current moved %s -> %s; reopening", name, ix.version, version)
                doomed = self._retire(self._open.pop(name))
                ix = None
            if ix is None:
                ix = self.store.open(name, version=version)
                self._open[name] = ix
            self._hold(ix)
        if doomed is not None:
            self._close_replaced(doomed)
        if identity is not None:
            try:
                ix.manifest.check(identity, "open")
            except BaseException:
                self.release(ix)
                raise
        return ix

    def release(self, ix: Index) -> None:
        """Give back a lease `acquire` handed out; the last one of a replaced version closes it."""
        with self._lock:
            left = self._leases[ix] - 1
            if left:
                self._leases[ix] = left
                return
            del self._leases[ix]
            if ix not in self._replaced:
                return
            self._replaced.discard(ix)
        self._close_replaced(ix)

    def _hold(self, ix: Index) -> None:
        """One more lease on `ix` (under the lock)."""
        self._leases[ix] = self._leases.get(ix, 0) + 1

    def _retire(self, ix: Index) -> Index | None:
        """Take `ix` out of service (under the lock): returned to be closed now if no lease holds
        it, else closed by the release of its last lease."""
        if self._leases.get(ix):
            self._replaced.add(ix)
            return None
        return ix

    def _close_replaced(self, ix: Index) -> None:
        # No snapshot: the version is no longer the live one (a migration retired it, or the index
        # is being deleted); what it applied is in its doc store and replayed if it is opened again.
        ix.close(snapshot=False)
        logger.info("index %s/%s: closed (replaced; no request holds it any more)", ix.name, ix.version)

    def open_versions(self) -> list[tuple[str, str, int]]:
        """(name, version, leases) of every version held open: the live ones and the replaced
        ones requests still hold."""
        with self._lock:
            held = list(self._open.values()) + list(self._replaced)
            return [(ix.name, ix.version, self._leases.get(ix, 0)) for ix in held]

    def create(self, name: str, identity: ModelIdentity, dense) -> dict:
        """Create `name` bound to `identity`'s model; its description."""
        self.store.create(name, identity, dense).close()
        with self.lease(name, identity) as ix:
            return ix.describe()

    def summaries(self, why_not) -> list[dict]:
        """One line per index; `why_not(manifest)` says why no served model may use it (or None)."""
        out = []
        for name in self.store.names():
            m = self.store.manifest(name)
            out.append({"name": name, "version": m.version, "model": m.model, "dimension": m.dimension,
                        "dense_index": m.dense_index["kind"], "sparse": m.sparse, "counts": self._counts(name, m),
                        "compatible": why_not(m) is None})
        return out

    def _counts(self, name: str, m) -> dict:
        """Live counts: the open index's, else its doc store's (the manifest's are the last snapshot's)."""
        with self._lock:
            ix = self._open.get(name)
            if ix is not None and ix.version == m.version:
                self._hold(ix)
            else:
                ix = None
        if ix is None:
            return self.store.counts(name, m.version)
        try:
            return ix.counts()
        finally:
            self.release(ix)

    def delete(self, name: str) -> None:
        """Delete `name`; its open version closes (no snapshot: it is going away) once the
        requests holding it finish."""
        with self._lock:
            ix = self._open.pop(name, None)
            doomed = self._retire(ix) if ix is not None else None
        if doomed is not None:
            self._close_replaced(doomed)
        self.store.delete(name)

    def close_all(self) -> None:
        """Snapshot and close everything (on shutdown, so the next start replays little)."""
        with self._lock:
            items, self._open = list(self._open.values()), {}
            replaced, self._replaced = self._replaced, set()
        for ix in items:
            ix.close()
        for ix in replaced:
            ix.close(snapshot=False)
        close = getattr(self._store, "close", None)       # a database store's connection pool
        if close is not None:
            close()
