"""Kill-and-restart soak: the server is SIGKILLed under mixed load (embeddings, generation,
index upserts) `--kills` times and restarted; after every kill the index is opened offline
(crash recovery), every acknowledged upsert must be there and be the top hit of a search by its
own stored vector, and the index must verify; after every restart a sample of acknowledged
documents must be found by their own text through the server. Loopback only,
bounded in time and count. Prints kills survived and acknowledged writes lost (target: 0).

    .venv/bin/python tests/soak.py --kills 20            # about 6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from helpers import free_port, spawn_server  # noqa: E402


def start(index_dir: Path, port: int) -> subprocess.Popen:
    """The server on `port` (the same port after every restart), once ready."""
    try:
        return spawn_server("--model", "all-MiniLM-L6-v2", "--dtype", "float32", "--index-dir", str(index_dir),
                            "--kv-cache-memory", "100000000", "--max-model-len", "1024", "--log-level", "warning",
                            port=port, cwd=ROOT).proc
    except RuntimeError as exc:
        raise SystemExit(f"the server did not start: {str(exc)[-2000:]}") from None


class Load:
    """Mixed load from a few threads; `acked` holds every upsert the server acknowledged."""

    def __init__(self, base: str, acked: dict[str, str], seed: int):
        self.base, self.acked, self.rng = base, acked, random.Random(seed)
        self.stop = threading.Event()
        self.counts = {"upserts": 0, "embeddings": 0, "generations": 0, "errors": 0}
        self.lock = threading.Lock()

    def _upserts(self):
        with httpx.Client(base_url=self.base, timeout=30) as c:
            while not self.stop.is_set():
                with self.lock:
                    n = len(self.acked) + self.counts["upserts"] * 5
                docs = [{"id": f"doc-{n}-{i}-{self.rng.random():.6f}",
                         "text": f"Soak document {n + i}: the river {self.rng.choice(RIVERS)} flows past "
                                 f"{self.rng.choice(CITIES)} in season {self.rng.randint(1, 10**6)}."}
                        for i in range(5)]
                try:
                    r = c.post("/v1/indexes/soak/documents", json={"documents": docs})
                except httpx.HTTPError:
                    return                                          # the server is gone
                if r.status_code == 200:
                    with self.lock:
                        self.acked.update({d["id"]: d["text"] for d in docs})
                        self.counts["upserts"] += 1

    def _embeddings(self):
        with httpx.Client(base_url=self.base, timeout=30) as c:
            while not self.stop.is_set():
                try:
                    r = c.post("/v1/embeddings", json={"input": ["mixed load", "长江流经上海。"] * 8})
                except httpx.HTTPError:
                    return
                with self.lock:
                    self.counts["embeddings" if r.status_code == 200 else "errors"] += 1

    def _generations(self):
        with httpx.Client(base_url=self.base, timeout=60) as c:
            while not self.stop.is_set():
                try:
                    r = c.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "Name a river."}], "max_tokens": 16})
                except httpx.HTTPError:
                    return
                with self.lock:
                    self.counts["generations" if r.status_code == 200 else "errors"] += 1

    def run(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=f, daemon=True)
                   for f in (self._upserts, self._upserts, self._embeddings, self._generations)]
        for t in threads:
            t.start()
        return threads


RIVERS = ["Danube", "Rhine", "Yangtze", "Nile", "Amazon", "Volga", "Seine", "Loire"]
CITIES = ["Vienna", "Basel", "Shanghai", "Cairo", "Manaus", "Kazan", "Paris", "Nantes"]


def check_offline(index_dir: Path, acked: dict[str, str]) -> tuple[int, int, bool]:
    """Open the index as the next start would (crash recovery): (acknowledged documents lost from
    the doc store, acknowledged documents the recovered vector index does not return as the top
    hit for their own stored vector, whether it verifies)."""
    from index.search import Query
    from index.store import IndexStore
    from index.verify import verify_index
    with IndexStore(index_dir).open("soak") as ix:
        stored = ix.docs.ids()
        unfound = 0
        for doc_id in sorted(set(acked) & stored):            # every acknowledged one, not a sample
            _, dense, _ = ix.docs.vector_of(doc_id)
            hits = ix.search(Query(dense=dense, top_k=1), ix.manifest.identity)
            unfound += not hits or hits[0].id != doc_id
        report = verify_index(ix, sample=100)
    return len(set(acked) - stored), unfound, report.ok


def check_searchable(base: str, acked: dict[str, str], rng: random.Random, n: int = 5) -> int:
    """Acknowledged documents (a sample) not found as the top hit by their own text."""
    missing = 0
    for doc_id in rng.sample(sorted(acked), min(n, len(acked))):
        r = httpx.post(base + "/v1/search", json={"index": "soak", "query": acked[doc_id], "top_k": 1, "mode": "hybrid"}, timeout=30)
        missing += r.status_code != 200 or r.json()["data"][0]["id"] != doc_id
    return missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--min-load-s", type=float, default=2.0)
    ap.add_argument("--max-load-s", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    os.environ.setdefault("EMBEDSERVE_THREADS", "2")
    rng = random.Random(args.seed)
    index_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    acked: dict[str, str] = {}
    proc = start(index_dir, port)
    httpx.post(base + "/v1/indexes", json={"name": "soak"}).raise_for_status()
    lost_total, unfound_total, unverified, unsearchable, survived = 0, 0, 0, 0, 0
    totals = {"upserts": 0, "embeddings": 0, "generations": 0, "errors": 0}
    t_start = time.time()
    for k in range(args.kills):
        load = Load(base, acked, seed=rng.randint(0, 10**9))
        threads = load.run()
        time.sleep(rng.uniform(args.min_load_s, args.max_load_s))
        proc.send_signal(signal.SIGKILL)                          # mid-request, mid-write
        proc.wait()
        load.stop.set()
        for t in threads:
            t.join(30)
        for key in totals:
            totals[key] += load.counts[key]
        lost, unfound, ok = check_offline(index_dir, acked)
        lost_total += lost
        unfound_total += unfound
        unverified += not ok
        proc = start(index_dir, port)
        miss = check_searchable(base, acked, rng)
        unsearchable += miss
        survived += 1
        print(json.dumps({"kill": k + 1, "acknowledged": len(acked), "lost": lost,
                          "not_found_by_own_vector": unfound, "verifies": ok,
                          "not_found_by_own_text": miss, **load.counts}), flush=True)
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    result = {"kills_survived": survived, "acknowledged_writes": len(acked), "acknowledged_writes_lost": lost_total,
              "acknowledged_not_found_by_own_vector": unfound_total,
              "versions_failing_verify": unverified, "sampled_docs_not_found_by_own_text": unsearchable,
              "requests": totals, "seconds": round(time.time() - t_start, 1), "exit_status_after_sigterm": proc.returncode}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if lost_total == unfound_total == unverified == unsearchable == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
