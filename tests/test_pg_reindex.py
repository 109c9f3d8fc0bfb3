"""`embedserve reindex` on PostgreSQL (`--index-url`), as a user runs it: all-MiniLM-L6-v2 ->
multilingual-e5-small over real Wikipedia summaries, through the CLI in a process of its own —
the swap, the ledger, the old version retired, `--rollback` carrying back what was written
since, `index prune`; SIGKILLed at 10, 50 and 99 % of the copy and resumed to the same result
with each document embedded once; SIGKILLed right before and right after the swap's commit
(nothing moved and nothing recorded, or both); a second migration refused while one runs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from embedserve.embedders import ModelEmbedder
from index.backend import open_store
from index.docstore import Document
from index.errors import RetiredError
from index.ops import search_text, upsert_documents
from migrations.pg_reindex import migration_lock
from migrations.reindex import FAULT_INJECT_ENV

from helpers import server_env, wiki_docs

pytestmark = pytest.mark.postgres
N = 60


@pytest.fixture
def wiki(pg_url, minilm_model):
    """A MiniLM index `wiki` of N documents in a fresh database; its URL."""
    emb = ModelEmbedder(minilm_model)
    ix = open_store(pg_url).create("wiki", emb.identity)
    upsert_documents(ix, wiki_docs(N), emb)
    return pg_url


def command(url: str, *args: str, batch: int = 10) -> list[str]:
    cmd = [sys.executable, "-m", "embedserve.cli", *args, "--index-url", url]
    if args[0] == "reindex":
        cmd += ["--dtype", "float32", "--batch-docs", str(batch), "--sample", "30"]
    return cmd


def cli(url: str, *args: str, fault: str | None = None, wait: bool = True, batch: int = 10):
    env = server_env({FAULT_INJECT_ENV: fault} if fault else None)
    if not fault:
        env.pop(FAULT_INJECT_ENV, None)
    cmd = command(url, *args, batch=batch)
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def to_e5(url: str, **kw):
    return cli(url, "reindex", "--index", "wiki", "--to-model", "multilingual-e5-small", **kw)


def history(url: str) -> list[tuple[str, str, str]]:
    p = cli(url, "index", "history", "wiki")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    return [(e["kind"], e["parent"], e["version"]) for e in json.loads(p.stdout)]


def test_reindex_swap_ledger_rollback_and_prune(wiki, minilm_model, e5_model):
    p = to_e5(wiki)
    assert p.returncode == 0, p.stdout + p.stderr
    entry = json.loads(p.stdout[p.stdout.index("{"):])
    assert entry["swapped"] and entry["version"] == "v2" and entry["gate"]["ok"] and entry["documents"] == N
    assert entry["gate"]["self_hit_rate"] >= 0.99 and entry["embedded"] == N
    store = open_store(wiki)
    assert store.current("wiki") == "v2" and history(wiki) == [("reindex", "v1", "v2")]
    e5 = ModelEmbedder(e5_model)
    docs = wiki_docs(N)
    live = store.open("wiki", e5.identity)
    assert search_text(live, e5, docs[7].text, top_k=1)[0].id == docs[7].id
    with pytest.raises(RetiredError):                         # the old version takes no more writes
        upsert_documents(store.open("wiki", version="v1"), [Document("late", "too late")], ModelEmbedder(minilm_model))
    # written on the new version after the swap: rolled back with the old model
    upsert_documents(live, [Document("new", "Der Rhein ist ein Strom in Mitteleuropa."),
                            Document(docs[0].id, docs[0].text, {"changed": True})], e5)
    live.delete([docs[1].id], e5.identity)
    p = cli(wiki, "reindex", "--index", "wiki", "--rollback")
    assert p.returncode == 0, p.stdout + p.stderr
    back = json.loads(p.stdout[p.stdout.index("{"):])
    assert back["kind"] == "rollback" and back["version"] == "v1" and back["carried"] == 3
    assert store.current("wiki") == "v1"
    assert history(wiki) == [("reindex", "v1", "v2"), ("rollback", "v2", "v1")]
    old = store.open("wiki", ModelEmbedder(minilm_model).identity)
    assert old.counts()["documents"] == N
    assert search_text(old, ModelEmbedder(minilm_model), "Der Rhein ist ein Strom in Mitteleuropa.", top_k=1)[0].id == "new"
    assert json.loads(old.docs.hashes([docs[0].id])[docs[0].id][1]) == {"changed": True}
    assert docs[1].id not in old.docs.ids()
    p = cli(wiki, "index", "prune", "wiki", "--keep", "0")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["deleted_versions"] == ["v2"] and store.versions("wiki") == ["v1"]
    with store.db.transaction() as cur:                       # its table went with it
        cur.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'embedserve' AND tablename LIKE 'docs_%%'")
        assert cur.fetchone()[0] == 1


def test_killed_at_10_50_99_percent_resumes_to_the_same_result(wiki):
    """Killed three times in a row (each run resumed from the last one's checkpoint), then run to
    the end: the same result as one run, each document embedded once but for the batch in flight
    at each kill."""
    store = open_store(wiki)
    kills = 0
    for at in (0.1, 0.5, 0.99):
        proc = to_e5(wiki, wait=False, batch=3)
        target = max(1, int(N * at))
        t0 = time.monotonic()
        try:
            while True:
                ck = store.checkpoint("wiki", "v2") if "v2" in store.versions("wiki") else None
                copied = len(store.open("wiki", version="v2").docs.ids()) if ck else 0
                if copied >= target:
                    break
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() - t0 < 240
                time.sleep(0.05)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        kills += 1
        assert store.current("wiki") == "v1" and history(wiki) == []
    p = to_e5(wiki)
    assert p.returncode == 0, p.stdout + p.stderr
    entry = json.loads(p.stdout[p.stdout.index("{"):])
    assert entry["version"] == "v2" and entry["documents"] == N and store.versions("wiki") == ["v1", "v2"]
    assert entry["embedded"] <= N + 3 * kills                  # each document once, each batch in flight at most twice
    assert store.open("wiki").counts() == {"documents": N, "dense": N, "sparse": N}
    assert history(wiki) == [("reindex", "v1", "v2")]


def test_killed_at_the_swap_leaves_all_or_nothing(wiki):
    store = open_store(wiki)
    p = to_e5(wiki, fault="before_swap")
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    assert store.current("wiki") == "v1" and history(wiki) == []          # nothing moved, nothing recorded
    assert store.checkpoint("wiki", "v2")["finished"] is False
    p = to_e5(wiki, fault="after_swap")
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    assert store.current("wiki") == "v2" and history(wiki) == [("reindex", "v1", "v2")]   # both
    assert store.checkpoint("wiki", "v2")["finished"] is True
    p = to_e5(wiki)
    assert p.returncode == 1 and "already built" in p.stderr, p.stderr
    p = cli(wiki, "reindex", "--index", "wiki", "--rollback", fault="before_swap")
    assert p.returncode == -signal.SIGKILL
    assert store.current("wiki") == "v2" and len(history(wiki)) == 1
    p = cli(wiki, "reindex", "--index", "wiki", "--rollback")
    assert p.returncode == 0, p.stdout + p.stderr
    assert store.current("wiki") == "v1" and history(wiki) == [("reindex", "v1", "v2"), ("rollback", "v2", "v1")]
    with store.db.transaction() as cur:                   # exactly one ledger row per applied swap
        cur.execute("SELECT count(*) FROM embedserve.ledger")
        assert cur.fetchone()[0] == 2


def test_a_second_migration_is_refused_while_one_runs(wiki):
    store = open_store(wiki)
    with migration_lock(store, "wiki"):
        p = to_e5(wiki)
    assert p.returncode == 1 and "already running" in p.stderr, p.stderr
    assert store.current("wiki") == "v1" and "Traceback" not in p.stderr
    p = cli(wiki, "reindex", "--index", "nope", "--to-model", "multilingual-e5-small")
    assert p.returncode == 1 and "does not exist" in p.stderr and "Traceback" not in p.stderr


def test_the_cli_refuses_a_bad_url_and_an_unreachable_database(tmp_path):
    p = subprocess.run([sys.executable, "-m", "embedserve.cli", "index", "list", "--index-url", "mysql://x"],
                       env=server_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "PostgreSQL URL" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "embedserve.cli", "index", "list", "--index-url",
                        "postgresql://nobody@127.0.0.1:1/none"], env=server_env(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and "unreachable" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_ray_engine_reads_the_shards_from_postgres(wiki, e5_model):
    """`--engine ray` on a local Ray: the shards are read from the database by Ray tasks (the
    version's `docs.source`), embedded by the actor pool, committed in write order; the vectors
    are e5's own for each text (as in process), the gate passes, the swap is recorded."""
    import numpy as np
    pytest.importorskip("ray.data", reason="the ray extra: pip install 'embedserve[ray]' (CI installs it)")
    proc = subprocess.Popen(command(wiki, "reindex", "--index", "wiki", "--to-model", "multilingual-e5-small",
                                    "--engine", "ray", batch=20),
                            env=server_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    entry = json.loads(out[out.rindex("\n{") + 1:])
    assert entry["engine"] == "ray" and entry["embedded"] == N and entry["gate"]["ok"], entry
    store = open_store(wiki)
    assert store.current("wiki") == "v2" and history(wiki) == [("reindex", "v1", "v2")]
    docs = {d.id: d.text for d in wiki_docs(N)}
    got = {r[1]: r[4] for batch in store.open("wiki").docs.iter_docs() for r in batch}
    assert got.keys() == docs.keys()
    want = ModelEmbedder(e5_model).embed_documents(list(docs.values())).dense
    assert max(float(np.abs(got[k] - w).max()) for k, w in zip(docs, want)) <= 1e-5


class _RandomVectors:
    """e5's identity and queries, random document vectors: a model that lost its weights."""

    def __init__(self, real):
        self.real, self.identity = real, real.identity

    def embed_documents(self, texts):
        import numpy as np

        from index.embedder import DocumentVectors
        out = self.real.embed_documents(texts)
        rng = np.random.default_rng(len(texts))
        dense = [v / np.linalg.norm(v) for v in rng.standard_normal((len(texts), self.identity.dimension)).astype("f4")]
        return DocumentVectors(dense, out.sparse)

    def embed_query(self, text, mode):
        return self.real.embed_query(text, mode)


def test_the_gate_refuses_and_the_live_version_keeps_serving(wiki, minilm_model, e5_model):
    import numpy as np

    from migrations.errors import GateFailed
    from migrations.pg_reindex import reindex
    store = open_store(wiki)
    with pytest.raises(GateFailed) as exc:
        reindex(store, "wiki", _RandomVectors(ModelEmbedder(e5_model)), batch_docs=30, sample=60)
    assert "self_hit" in exc.value.message and "v1 stays live" in exc.value.message
    assert store.current("wiki") == "v1" and store.history("wiki") == []
    assert search_text(store.open("wiki"), ModelEmbedder(minilm_model), "glacier", top_k=3)
    # vectors damaged in the table after they were written: the gate reads every one
    e5 = ModelEmbedder(e5_model)
    store.delete("wiki")
    ix = store.create("wiki", ModelEmbedder(minilm_model).identity)
    upsert_documents(ix, wiki_docs(N), ModelEmbedder(minilm_model))
    dry = reindex(store, "wiki", e5, batch_docs=30, sample=60, dry_run=True)
    assert dry["gate"]["ok"] and not dry["swapped"] and store.current("wiki") == "v1"
    v2 = store.open("wiki", version="v2")
    with store.db.transaction() as cur:
        cur.execute(v2.sql("UPDATE {t} SET dense = %s WHERE ext_id = %s"), (np.zeros(384, "f4"), wiki_docs(1)[0].id))
    with pytest.raises(GateFailed) as exc:                   # the rerun resumes v2 and gates it again
        reindex(store, "wiki", e5, batch_docs=30, sample=60)
    assert exc.value.report.checks["vectors"]["detail"] == "bad vectors: zero 1"
    assert store.current("wiki") == "v1" and store.history("wiki") == []


def test_an_hnsw_index_is_rebuilt_once_after_the_copy(pg_url, minilm_model, e5_model):
    """The new version's table is filled without its HNSW index, which is built in one pass
    before the gate: the gate (and every search after the swap) uses it."""
    from index.manifest import DenseConfig
    from migrations.pg_reindex import reindex
    mini, e5 = ModelEmbedder(minilm_model), ModelEmbedder(e5_model)
    store = open_store(pg_url)
    upsert_documents(store.create("wiki", mini.identity, DenseConfig(kind="hnsw", hnsw_m=16, ef_construction=64)),
                     wiki_docs(N), mini)
    entry = reindex(store, "wiki", e5, batch_docs=20, sample=N)
    assert entry["gate"]["ok"] and entry["gate"]["self_hit_rate"] >= 0.99
    v2 = store.open("wiki", e5.identity)
    with store.db.transaction() as cur:
        cur.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s AND indexdef LIKE '%%hnsw%%'",
                    (f"docs_{v2.id}",))
        (name, definition), = cur.fetchall()
    assert name == f"docs_{v2.id}_hnsw" and "vector_ip_ops" in definition and "m='16'" in definition.replace(" ", "")
    assert v2.manifest.dense_index["kind"] == "hnsw"
    assert search_text(v2, e5, wiki_docs(N)[5].text, top_k=1)[0].id == wiki_docs(N)[5].id
