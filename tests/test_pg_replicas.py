"""Servers that share one PostgreSQL (`embedserve serve --index-url`), from outside, over HTTP:

- the database stopped and started again under load: while it is down only 503s with
  `Retry-After`, and 200s again within 5 s of its return, with nothing else in between;
- two replicas: writers through A, searchers through B, a reindex swap in the middle and A
  SIGKILLed three times: every acknowledged document is found through B by its own text, every
  search is a 200 from one (model, version) pair, and after the swap B answers with the new model.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest

from helpers import server_env, spawn_server, wiki_docs

pytestmark = [pytest.mark.postgres, pytest.mark.server]

FLAGS = ("--dtype", "float32", "--generate-model", "none", "--log-level", "warning")


def _server(url: str, tmp_path, *models: str):
    flags = [x for m in models for x in ("--model", m)]
    return spawn_server(*flags, *FLAGS, "--index-url", url, "--index-dir", str(tmp_path / "unused"), timeout=180)


def _fill(base: str, name: str, docs, model: str) -> None:
    with httpx.Client(base_url=base, timeout=120) as h:
        assert h.post("/v1/indexes", json={"name": name, "model": model}).status_code == 201
        for i in range(0, len(docs), 20):
            r = h.post(f"/v1/indexes/{name}/documents",
                       json={"documents": [{"id": d.id, "text": d.text} for d in docs[i:i + 20]]})
            assert r.status_code == 200, r.text


def test_postgres_stopped_and_started_under_load(pg_server, pg_url, tmp_path):
    docs = wiki_docs(80)
    srv = _server(pg_url, tmp_path, "all-MiniLM-L6-v2")
    try:
        _fill(srv.base, "kb", docs[:40], "all-MiniLM-L6-v2")
        log, stop = [], threading.Event()

        def client(k: int):
            with httpx.Client(base_url=srv.base, timeout=30) as h:
                i = 0
                while not stop.is_set():
                    i += 1
                    t0 = time.monotonic()
                    if k % 2:
                        d = docs[40 + (k * 20 + i) % 40]
                        r = h.post("/v1/indexes/kb/documents", json={"documents": [{"id": d.id, "text": d.text}]})
                    else:
                        r = h.post("/v1/search", json={"index": "kb", "query": docs[i % 40].text[:80], "top_k": 3})
                    log.append((t0, time.monotonic(), r.status_code, r.headers.get("retry-after"),
                                r.json().get("error", {}).get("code") if r.status_code != 200 else None))
        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(3)
        down = time.monotonic()
        pg_server.stop()
        time.sleep(4)
        pg_server.start()
        up = time.monotonic()
        time.sleep(8)
        stop.set()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert {s for _, _, s, _, _ in log} <= {200, 503}, sorted({s for _, _, s, _, _ in log})
        refused = [x for x in log if x[2] == 503]
        assert refused, "no request met the database down"
        for t0, t1, _, retry, code in refused:
            assert retry is not None and int(retry) >= 1 and code == "index_backend_unavailable"
            assert down - 1 <= t1 <= up + 5, (t0 - down, t1 - up)        # only while it was down (or returning)
        assert all(s == 200 for t0, _, s, _, _ in log if t0 > up + 5), "not back to 200 within 5 s"
        assert any(s == 200 for t0, _, s, _, _ in log if up < t0 <= up + 5)
        assert all(s == 200 for t0, t1, s, _, _ in log if t1 < down)
    finally:
        srv.stop()


@pytest.mark.slow
def test_two_replicas_writers_searchers_a_swap_and_three_kills(pg_url, tmp_path):
    models = ("all-MiniLM-L6-v2", "multilingual-e5-small")
    corpus = wiki_docs(200)          # 100 written under load: through all three kills and the swap
    a = _server(pg_url, tmp_path, *models)
    b = _server(pg_url, tmp_path, *models)
    try:
        _fill(a.base, "live", corpus[:100], models[0])
        acked: dict[str, str] = {d.id: d.text for d in corpus[:100]}
        searches, stop, lock = [], threading.Event(), threading.Lock()
        where = {"a": a.base}

        def writer(w: int):
            mine = corpus[100 + w::2]
            i = 0
            with httpx.Client(timeout=60) as h:
                while not stop.is_set() and i < len(mine):
                    batch = mine[i:i + 3]
                    try:
                        r = h.post(where["a"] + "/v1/indexes/live/documents",
                                   json={"documents": [{"id": d.id, "text": d.text} for d in batch]})
                    except httpx.TransportError:               # A was killed under us: not acknowledged
                        time.sleep(0.3)
                        continue
                    if r.status_code == 200:
                        with lock:
                            acked.update({d.id: d.text for d in batch})
                        i += len(batch)
                    else:
                        assert r.status_code == 503 and r.headers.get("retry-after"), r.text
                        time.sleep(0.2)

        def searcher(s: int):
            rng = random.Random(s)
            with httpx.Client(base_url=b.base, timeout=60) as h:
                while not stop.is_set():
                    with lock:
                        doc_id = rng.choice(list(acked))
                        text = acked[doc_id]
                    t0 = time.monotonic()
                    r = h.post("/v1/search", json={"index": "live", "query": text[:120], "top_k": 3})
                    body = r.json()
                    searches.append((t0, r.status_code, body.get("model"), body.get("version")))
                    time.sleep(0.1)     # a steady stream, not a flood: the reindex shares these cores

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
        threads += [threading.Thread(target=searcher, args=(s,)) for s in range(2)]
        for t in threads:
            t.start()
        t_start = time.monotonic()
        kills, reindex, swapped_at = 0, None, None
        while (time.monotonic() - t_start < 45 or swapped_at is None
               or time.monotonic() - swapped_at < 6):            # and B searched a while after the swap
            elapsed = time.monotonic() - t_start
            if reindex is None and elapsed > 12:
                reindex = subprocess.Popen([sys.executable, "-m", "embedserve.cli", "reindex", "--index", "live",
                                            "--to-model", models[1], "--dtype", "float32", "--batch-docs", "40",
                                            "--sample", "40", "--index-url", pg_url],
                                           env=server_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if kills < 3 and elapsed > 6 + 12 * kills:
                a.kill()
                kills += 1
                a = _server(pg_url, tmp_path, *models)
                where["a"] = a.base
            if reindex is not None and swapped_at is None and reindex.poll() is not None:
                swapped_at = time.monotonic()
            assert elapsed < 900, "the scenario did not finish"     # a hang guard, not a speed bound
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(120)
        out = reindex.stdout.read()
        assert reindex.returncode == 0, out
        entry = json.loads(out[out.index("{\n"):])
        assert entry["swapped"] and entry["to_model"] == models[1] and kills == 3

        assert {s for _, s, _, _ in searches} == {200}, [x for x in searches if x[1] != 200][:3]
        pairs = {(m, v) for _, _, m, v in searches}
        assert pairs <= {(models[0], "v1"), (models[1], "v2")} and (models[1], "v2") in pairs, pairs
        late = [(m, v) for t0, _, m, v in searches if t0 > swapped_at + 1]
        assert late and set(late) == {(models[1], "v2")}, set(late)
        # every acknowledged document, found through B by its own text
        missing = []
        with httpx.Client(base_url=b.base, timeout=60) as h:
            for doc_id, text in acked.items():
                r = h.post("/v1/search", json={"index": "live", "query": text, "top_k": 5})
                assert r.status_code == 200 and r.json()["model"] == models[1]
                if doc_id not in [x["id"] for x in r.json()["data"]]:
                    missing.append(doc_id)
            info = h.get("/v1/indexes/live").json()
        assert not missing, f"{len(missing)} of {len(acked)} acknowledged documents not found: {missing[:5]}"
        assert info["counts"]["documents"] >= len(acked) > 100
    finally:
        a.stop()
        b.stop()
