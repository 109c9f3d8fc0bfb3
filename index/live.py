"""The indexes a long-running process keeps open: one per name, following `CURRENT`, so a
version swap (a reindex migration) is picked up on the next access."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from .core import Index
from .docstore import DB_NAME, read_counts
from .manifest import ModelIdentity
from .store import IndexStore

logger = logging.getLogger(__name__)


class LiveIndexes:
    """The store under `root` and its open indexes (thread-safe)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._store: IndexStore | None = None
        self._open: dict[str, Index] = {}
        self._replaced: list[Index] = []       # versions CURRENT moved away from; requests may still use them
        self._lock = threading.Lock()

    @property
    def store(self) -> IndexStore:
        if self._store is None:
            self._store = IndexStore(self.root)
        return self._store

    def get(self, name: str, identity: ModelIdentity | None) -> Index:
        """The live version of `name`, (re)opened when `CURRENT` moved; refused on mismatch."""
        version = self.store.current(name)
        with self._lock:
            ix = self._open.get(name)
            if ix is not None and ix.version != version:
                logger.info("index %s: current moved %s -> %s; reopening", name, ix.version, version)
                self._replaced.append(self._open.pop(name))
                ix = None
            if ix is None:
                ix = self.store.open(name, version=version)
                self._open[name] = ix
        if identity is not None:
            ix.manifest.check(identity, "open")
        return ix

    def create(self, name: str, identity: ModelIdentity, dense) -> dict:
        """Create `name` bound to `identity`'s model; its description."""
        self.store.create(name, identity, dense).close()
        return self.get(name, identity).describe()

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
            return ix.counts()
        return read_counts(self.store.version_dir(name, m.version) / DB_NAME)

    def delete(self, name: str) -> None:
        """Close (no snapshot: it is going away) and delete `name`."""
        with self._lock:
            ix = self._open.pop(name, None)
        if ix is not None:
            ix.close(snapshot=False)
        self.store.delete(name)

    def close_all(self) -> None:
        """Snapshot and close everything (on shutdown, so the next start replays little)."""
        with self._lock:
            items, self._open = list(self._open.values()), {}
            replaced, self._replaced = self._replaced, []
        for ix in items:
            ix.close()
        for ix in replaced:
            ix.close(snapshot=False)
