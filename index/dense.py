"""Dense vectors in FAISS, keyed by label (the doc store's sequence number of the write).

`flat`: IndexFlatIP in an IndexIDMap, exact. `hnsw`: IndexHNSWFlat (inner product) in an id
map, approximate; HNSW cannot remove vectors, so removed labels stay in the graph as stale
entries that every search excludes with an IDSelector, until `rebuild` compacts them away.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import faiss
import numpy as np

from .durable import atomic_write_with
from .manifest import DenseConfig

logger = logging.getLogger(__name__)

# One OpenMP thread by default: searches are single queries, and FAISS's OpenMP threads spin
# against the embed engine's torch threads on the same cores. Measured on the 2-core dev
# machine under load: a 300-vector search took 8 ms with 2 threads, 47 µs with 1. The server
# sets it from its configuration (--faiss-threads) before any index opens.
_search_threads = 1


def search_threads() -> int:
    """OpenMP threads each FAISS search of a newly opened index takes."""
    return _search_threads


def set_search_threads(n: int) -> None:
    """Set the OpenMP threads of searches of indexes opened from now on (at least 1)."""
    global _search_threads
    if n < 1:
        raise ValueError(f"FAISS search threads must be at least 1, not {n}")
    _search_threads = n


@contextmanager
def omp_threads(n: int):
    """Run FAISS with `n` OpenMP threads, then restore the calling thread's setting. OpenMP
    keeps it per thread, and torch shares it (torch's libgomp is loaded globally): setting it
    for good would make the same thread's later torch work single-threaded."""
    prev = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(prev)


class DenseIndex:
    """FAISS index plus the bookkeeping of labels present (and, for HNSW, stale)."""

    def __init__(self, dim: int, config: DenseConfig, index: faiss.Index | None = None):
        self.dim = dim
        self.config = config
        self.index = index if index is not None else self._empty()
        # HNSW only: which labels the graph holds, to tell a removal that needs a tombstone.
        self._labels: set[int] = set(self.labels().tolist()) if config.kind == "hnsw" else set()
        self.stale: set[int] = set()
        self._selector_cache: tuple | None = None
        self.threads = _search_threads

    def _empty(self) -> faiss.Index:
        c = self.config
        if c.kind == "flat":
            base = faiss.IndexFlatIP(self.dim)
        else:
            base = faiss.IndexHNSWFlat(self.dim, c.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            base.hnsw.efConstruction = c.ef_construction
            base.hnsw.efSearch = c.ef_search
        return faiss.IndexIDMap(base)

    @property
    def live(self) -> int:
        return int(self.index.ntotal) - len(self.stale)

    # ----------------------------------------------------------------- writes
    def add(self, labels: np.ndarray, vectors: np.ndarray) -> None:
        if not len(labels):
            return
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(labels), self.dim)
        with omp_threads(self.threads):
            self.index.add_with_ids(vectors, np.asarray(labels, dtype=np.int64))
        if self.config.kind == "hnsw":
            self._labels.update(int(x) for x in labels)

    def remove(self, labels: np.ndarray) -> None:
        if not len(labels):
            return
        if self.config.kind == "flat":
            self.index.remove_ids(np.asarray(labels, dtype=np.int64))
            return
        # Only labels actually in the graph become stale (a label added and removed after the
        # snapshot was never added at all).
        self.stale.update(int(x) for x in labels if int(x) in self._labels)
        self._selector_cache = None

    def needs_compaction(self) -> bool:
        return self.config.kind == "hnsw" and len(self.stale) > max(1000, 0.2 * self.index.ntotal)

    # ----------------------------------------------------------------- search
    def search(self, queries: np.ndarray, k: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, labels) per query; label -1 pads when fewer than k exist."""
        queries = np.ascontiguousarray(queries, dtype=np.float32).reshape(-1, self.dim)
        k = max(1, min(k, max(self.live, 1)))
        params, keep = self._params(allowed)
        with omp_threads(self.threads):
            scores, labels = self.index.search(queries, k, params=params)
        del keep
        return scores, labels

    def _params(self, allowed: np.ndarray | None):
        """Search parameters with a selector: the allowed labels (a filter), else all but stale."""
        if allowed is not None:
            sel = faiss.IDSelectorBatch(np.asarray(allowed, dtype=np.int64))
        elif self.stale:
            if self._selector_cache is None:
                inner = faiss.IDSelectorBatch(np.fromiter(self.stale, dtype=np.int64, count=len(self.stale)))
                self._selector_cache = (faiss.IDSelectorNot(inner), inner)
            sel = self._selector_cache[0]
        else:
            sel = None
        if self.config.kind == "hnsw":
            params = faiss.SearchParametersHNSW(efSearch=self.config.ef_search)
        else:
            params = faiss.SearchParameters()
        if sel is not None:
            params.sel = sel
        # SWIG does not keep the selector alive through `params`: the caller holds `sel` too.
        return params, (sel, self._selector_cache)

    # -------------------------------------------------------------- snapshots
    def save(self, path: Path) -> None:
        """Write a snapshot (temp name, fsync, rename). Stale HNSW entries are saved too;
        the loader recomputes them from the doc store."""
        def write(tmp: Path):
            # Through a Python file, not faiss's own FILE*: faiss ignores an fclose() error (it
            # prints it), so a full volume could leave a truncated file that looks written.
            with open(tmp, "wb") as f:
                faiss.write_index(self.index, faiss.PyCallbackIOWriter(f.write))
        atomic_write_with(path, write)

    @classmethod
    def load(cls, path: Path, dim: int, config: DenseConfig) -> "DenseIndex":
        index = faiss.read_index(str(path))
        if index.d != dim:
            raise ValueError(f"{path} holds {index.d}-dimensional vectors, the manifest says {dim}")
        if config.kind == "hnsw":
            faiss.downcast_index(index.index).hnsw.efSearch = config.ef_search
        return cls(dim, config, index)

    def mark_stale_except(self, live: np.ndarray) -> None:
        """HNSW after loading a snapshot: every label in the graph that is no longer live is stale."""
        if self.config.kind == "hnsw":
            self.stale = self._labels - set(live.tolist())
            self._selector_cache = None

    def labels(self) -> np.ndarray:
        """Every label in the FAISS index (stale included)."""
        return faiss.vector_to_array(self.index.id_map).astype(np.int64)
