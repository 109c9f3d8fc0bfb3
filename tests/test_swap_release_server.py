"""A running server through 50 swaps and rollbacks of `CURRENT` under 4 searching clients:
every answer is 200, and the server's open file descriptors and RSS come back to within a
small bound of where they started — each replaced version is closed once the requests that
took it finish (a version held open keeps its SQLite descriptors — database, WAL, shared
memory — and its FAISS index and postings in memory)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers import spawn_server, wait_ready
from embedserve.embedders import ModelEmbedder
from index.docstore import Document
from index.ops import upsert_documents
from index.store import IndexStore
from migrations.reindex import reindex, rollback
from helpers import wiki_docs as _wiki_docs

pytestmark = pytest.mark.slow

N_DOCS = 16                   # short texts: a reindex is cheap, the versions still go by
CYCLES = 25                   # each a reindex (MiniLM -> e5) and a rollback: 50 swaps
# Measured on the 2-core dev machine: with leases, fds 21 -> 21 and RSS +18.5 MB, flat over the
# last 18 cycles (allocator warm-up); with replaced versions kept open, fds 36 -> 161 (+5 a cycle)
# and RSS +72 MB, growing ~2 MB a cycle.
FD_BOUND = 6                  # descriptors above the start; one leaked cycle alone is 5
RSS_BOUND_MB = 30.0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.server
def test_fifty_swaps_under_load_release_every_replaced_version(tmp_path, minilm_model, e5_model):
    root = tmp_path / "ix"
    store = IndexStore(root)
    docs = [Document(d.id, d.text[:100], {}) for d in _wiki_docs(N_DOCS)]
    with store.create("kb", ModelEmbedder(minilm_model).identity) as ix:
        upsert_documents(ix, docs, ModelEmbedder(minilm_model))
    e5 = ModelEmbedder(e5_model)

    log = tmp_path / "server.log"
    srv = spawn_server("--model", "all-MiniLM-L6-v2", "--model", "multilingual-e5-small", "--dtype", "float32",
                       "--generate-model", "none", "--index-dir", str(root), "--log-level", "warning",
                       log=log, ready=False)
    proc, base = srv.proc, srv.base
    statuses: list[int] = []
    versions: set[str] = set()
    stop, running = threading.Event(), threading.Event()

    def search(k: int) -> None:
        with httpx.Client(base_url=base, timeout=60) as h:
            while not stop.is_set():
                if not running.wait(0.05):
                    continue
                r = h.post("/v1/search", json={"index": "kb", "query": docs[k * 3].text[:60], "top_k": 3})
                statuses.append(r.status_code)
                if r.status_code == 200:
                    versions.add(r.json()["version"])
                time.sleep(0.01)                 # steady load that leaves the reindexes some CPU

    def quiet() -> None:
        """Let the clients pick up the last swap, then pause them (their connections stay open)."""
        time.sleep(0.5)
        running.clear()
        time.sleep(0.5)

    def cycle(dwell: float = 0.1) -> None:
        assert reindex(store, "kb", e5, batch_docs=64, sample=8)["swapped"]
        time.sleep(dwell)
        rollback(store, "kb")
        time.sleep(dwell)

    threads = [threading.Thread(target=search, args=(k,)) for k in range(4)]
    try:
        wait_ready(proc, base, 240, srv.output)
        for t in threads:
            t.start()
        running.set()
        for _ in range(3):                       # warm-up: both models' engines at every batch size
            cycle(dwell=1.0)
        quiet()
        fd0, rss0 = _fds(proc.pid), _rss_mb(proc.pid)
        running.set()
        t0 = time.time()
        trace = []
        for _ in range(CYCLES):
            cycle()
            trace.append((_fds(proc.pid), round(_rss_mb(proc.pid), 1)))
        quiet()
        fd1, rss1 = _fds(proc.pid), _rss_mb(proc.pid)
        elapsed = time.time() - t0
    finally:
        stop.set()
        running.set()
        for t in threads:
            t.join(60)
        srv.stop()
    print(f"\n{2 * CYCLES} swaps in {elapsed:.1f} s, {len(statuses)} searches; "
          f"fds {fd0} -> {fd1}, RSS {rss0:.1f} -> {rss1:.1f} MB; per cycle (fds, RSS MB): {trace}")
    assert statuses and set(statuses) == {200}, (sorted(set(statuses)), log.read_text()[-3000:])
    assert len(versions) > CYCLES // 2, sorted(versions)     # the clients really saw the versions go by
    assert store.current("kb") == "v1"
    assert fd1 <= fd0 + FD_BOUND, (fd0, fd1)
    assert rss1 <= rss0 + RSS_BOUND_MB, (rss0, rss1)
