"""Crash safety: a child process upserts, deletes and snapshots in a loop and is SIGKILLed at
random moments (sometimes while it is still opening and replaying). After every kill, every
acknowledged write is there: each live id is its own top hit when searched with its own
vector, deleted ids are gone, and SQLite, FAISS and the postings agree.

The child prints `BEGIN` before each write and `ACK` after its commit; a write killed between
the two may or may not have happened, so only its ids may be in either state.

On both backends: local files (where replay and snapshots are what is tested) and a real
PostgreSQL (where the transaction is: the child's connection dies with it mid-write).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

DIM = 32
POOL = 60          # document ids d0..d59, written over and over
KILLS = 22


def _identity():
    from index.manifest import ModelIdentity
    return ModelIdentity(model="crash-test", fingerprint="c" * 64, dimension=DIM, normalize=True,
                         pooling="mean", query_prefix="", passage_prefix="", has_sparse=True)


def _vectors(k: int, v: int):
    """Deterministic dense + sparse vectors of version v of document k."""
    rng = np.random.default_rng(k * 100_003 + v)
    d = rng.standard_normal(DIM).astype(np.float32)
    ids = np.unique(rng.integers(0, 500, size=6))
    return d / np.linalg.norm(d), (ids.astype(np.int64), rng.random(len(ids)).astype(np.float32) + 0.01)


def _child(root: str, seed: int, url: str | None) -> None:
    from index.backend import open_store
    from index.docstore import Document

    ident = _identity()
    ix = open_store(url, root).open("crash", ident, snapshot_min_ops=7)
    print("READY", flush=True)
    rng = random.Random(seed)
    while True:
        r = rng.random()
        if r < 0.7:
            ks = rng.sample(range(POOL), rng.randint(1, 4))
            vs = [rng.randrange(1_000_000) for _ in ks]
            ops = " ".join(f"{k}:{v}" for k, v in zip(ks, vs))
            print(f"BEGIN U {ops}", flush=True)
            vecs = [_vectors(k, v) for k, v in zip(ks, vs)]
            ix.upsert([Document(f"d{k}", f"d{k} v{v}", {"v": v}) for k, v in zip(ks, vs)],
                      [d for d, _ in vecs], [s for _, s in vecs], ident)
            print(f"ACK U {ops}", flush=True)
        elif r < 0.9:
            ks = rng.sample(range(POOL), rng.randint(1, 2))
            ops = " ".join(str(k) for k in ks)
            print(f"BEGIN D {ops}", flush=True)
            ix.delete([f"d{k}" for k in ks], ident)
            print(f"ACK D {ops}", flush=True)
        else:
            ix.snapshot()


def _parse(op: str, args: list[str]) -> dict[int, int | None]:
    if op == "U":
        return {int(a.split(":")[0]): int(a.split(":")[1]) for a in args}
    return {int(a): None for a in args}


def _run_child(root: Path, seed: int, rng: random.Random, url: str | None) -> list[str]:
    proc = subprocess.Popen([sys.executable, __file__, str(root), str(seed), url or ""], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    lines: list[str] = []
    ready = threading.Event()

    def reader():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("READY"):
                ready.set()
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    if rng.random() < 0.2:
        time.sleep(rng.uniform(0.0, 0.4))        # maybe still importing, opening or replaying
    else:
        assert ready.wait(30), proc.stderr.read() if proc.poll() is not None else "child never got ready"
        time.sleep(rng.uniform(0.01, 0.3))
    assert proc.poll() is None, f"child died by itself: {proc.stderr.read()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t.join(5)
    proc.stderr.close()
    return lines


@pytest.mark.parametrize("backend", ["local", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_acknowledged_writes_survive_sigkill(tmp_path, caplog, request, backend):
    from index.backend import open_store
    from index.search import Query

    ident = _identity()
    url = request.getfixturevalue("pg_url") if backend == "postgres" else None
    open_store(url, tmp_path).create("crash", ident).close()
    rng = random.Random(1234)
    state: dict[int, int | None] = {}            # k -> acknowledged version (None: deleted / never written)
    acked_writes = 0
    for round_ in range(KILLS):
        lines = _run_child(tmp_path, seed=round_, rng=rng, url=url)
        maybe: dict[int, int | None] = {}
        for line in lines:
            kind, *rest = line.split(" ")
            if kind == "BEGIN":
                maybe = _parse(rest[0], rest[1:])
            elif kind == "ACK":
                state.update(_parse(rest[0], rest[1:]))
                acked_writes += 1
                maybe = {}

        caplog.clear()
        ix = open_store(url, tmp_path).open("crash", ident)
        # Replay alone must be right: the rebuild-from-SQLite safety net must not have been needed.
        assert not [r for r in caplog.records if "rebuilding" in r.getMessage()], caplog.text
        try:
            counts = ix.counts()
            assert counts["documents"] == counts["dense"] == counts["sparse"], counts
            if backend == "local":
                assert ix.docs.counts()["dense"] == ix.dense.live == len(ix.sparse)
            texts = {d.id: d.text for _, d in ix.docs.documents_after(0, 10 * POOL)}
            for k in range(POOL):
                text = texts.get(f"d{k}")
                actual = int(text.split(" v")[1]) if text else None
                allowed = {state.get(k)} | ({maybe[k]} if k in maybe else set())
                assert actual in allowed, f"round {round_}: d{k} is {actual}, acknowledged {state.get(k)}"
                state[k] = actual                 # an in-flight write resolved one way or the other
                if actual is not None:
                    d, s = _vectors(k, actual)
                    hits = ix.search(Query(dense=d, top_k=1), ident)
                    assert hits and hits[0].id == f"d{k}", f"round {round_}: d{k} is not its own top hit"
                    hits = ix.search(Query(sparse=s, mode="sparse", top_k=POOL), ident)
                    assert f"d{k}" in {h.id for h in hits}
            assert counts["documents"] == sum(v is not None for v in state.values())
        finally:
            ix.close(snapshot=round_ % 2 == 0)    # odd rounds: the next child replays our view too
    assert acked_writes >= 50, f"only {acked_writes} acknowledged writes: the children did too little"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent.parent))
    _child(sys.argv[1], int(sys.argv[2]), sys.argv[3] or None)
