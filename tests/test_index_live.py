"""`LiveIndexes` leases: a version `CURRENT` moved away from stays open while a request holds it
and closes (SQLite closed, the object and its FAISS index freed) when the last lease goes; the
live version stays open; a deleted index closes the same way."""

from __future__ import annotations

import sqlite3
import threading
import time
import weakref

import numpy as np
import pytest

from index.docstore import Document
from index.live import LiveIndexes
from index.search import Query
from index.store import IndexStore

from helpers import unit_identity, unit_vector

DIM = 8
IDENT = unit_identity(DIM)


def _vec(seed: int) -> np.ndarray:
    return unit_vector(seed, DIM)


def _terms(seed: int):
    return np.array([seed % 7, 7 + seed % 5], dtype=np.int64), np.array([1.0, 0.5], dtype=np.float32)


def _fill(ix, n: int = 20) -> None:
    ix.upsert([Document(f"d{i}", f"text {i}", {}) for i in range(n)], [_vec(i) for i in range(n)],
              [_terms(i) for i in range(n)], IDENT)


@pytest.fixture
def root(tmp_path):
    store = IndexStore(tmp_path)
    with store.create("kb", IDENT) as ix:
        _fill(ix)
    v2 = store.add_version("kb", IDENT)
    with store.open("kb", version=v2) as ix:
        _fill(ix, 10)
    return tmp_path


def _closed(ix) -> bool:
    try:
        ix.docs.conn.execute("SELECT 1")
    except sqlite3.ProgrammingError:         # "Cannot operate on a closed database."
        return True
    return False


def test_a_replaced_version_closes_when_its_last_lease_is_released_and_not_before(root):
    live = LiveIndexes(root)
    first, second = live.acquire("kb"), live.acquire("kb")
    assert first is second and first.version == "v1"
    gone = weakref.ref(first)

    live.store.set_current("kb", "v2")               # a swap while two requests hold v1
    with live.lease("kb") as ix:
        assert ix.version == "v2"
    assert not _closed(first)                        # still held: it answers as before
    assert [h.id for h in first.search(Query(dense=_vec(3), top_k=1), IDENT)] == ["d3"]
    assert sorted(live.open_versions()) == [("kb", "v1", 2), ("kb", "v2", 0)]

    live.release(second)
    assert not _closed(first)
    live.release(first)                              # the last lease: closed now
    assert _closed(first)
    assert live.open_versions() == [("kb", "v2", 0)]
    del first, second, ix
    assert gone() is None                            # nothing else keeps it (or its FAISS index) alive

    with live.lease("kb") as ix:                     # the live one stays open between requests
        pass
    assert not _closed(ix)
    live.close_all()
    assert _closed(ix)


def test_a_replaced_version_no_one_holds_closes_at_the_next_access(root):
    live = LiveIndexes(root)
    with live.lease("kb") as old:
        pass
    live.store.set_current("kb", "v2")
    assert not _closed(old)                          # nothing looked at CURRENT yet
    live.summaries(lambda m: None)                   # counts only: no reopen
    with live.lease("kb") as ix:
        assert ix.version == "v2" and _closed(old)
    live.store.set_current("kb", "v1")               # a rollback: v1 comes back fresh, v2 goes
    with live.lease("kb") as back:
        assert back.version == "v1" and back is not old and _closed(ix)
        assert back.counts()["documents"] == 20
    live.close_all()


def test_a_deleted_index_closes_after_its_last_request(root):
    live = LiveIndexes(root)
    ix = live.acquire("kb")
    live.delete("kb")
    assert not _closed(ix) and not live.store.exists("kb")
    live.release(ix)
    assert _closed(ix) and live.open_versions() == []


def test_leases_under_threads_leave_only_the_live_version_open(root):
    """Threads lease and search while CURRENT flips 40 times: every search answers, and at the
    end only the live version is open, with no lease left."""
    live = LiveIndexes(root)
    stop, errors, opened = threading.Event(), [], []

    def worker():
        while not stop.is_set():
            try:
                with live.lease("kb") as ix:
                    opened.append(ix)
                    assert ix.search(Query(dense=_vec(1), top_k=1), IDENT)[0].id == "d1"
            except Exception as exc:         # noqa: BLE001 - collected and asserted below
                errors.append(exc)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(40):
        live.store.set_current("kb", "v2" if i % 2 == 0 else "v1")
        threading.Event().wait(0.01)
    # the last flip (to v1) closes v2 at the next lease: let the workers take some after it (on
    # loaded cores 10 ms may pass with none)
    after = len(opened)
    deadline = time.monotonic() + 30
    while (len(opened) < after + 8 or opened[-1].version != "v1") and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    stop.set()
    for t in threads:
        t.join(30)
    assert errors == []
    assert live.open_versions() == [("kb", "v1", 0)]
    held = {id(ix): ix for ix in opened}
    assert sum(not _closed(ix) for ix in held.values()) == 1
    live.close_all()
