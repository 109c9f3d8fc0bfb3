"""The reindex gate while the live version keeps taking writes, on both backends, with a
deterministic embedder (no model): a document written after the last copy pass and before the
gate is not a failed copy — the gate passes, says so, and the document is copied before the swap
(which checks the counts exactly under the writers' lock) — while a document the copy lost is
still refused."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

import migrations
from index.backend import open_store
from index.docstore import Document
from index.embedder import DocumentVectors
from index.search import Query
from migrations import pg_reindex, reindex as local_reindex
from migrations.errors import GateFailed

from helpers import unit_identity, unit_terms, unit_vector

DIM = 16


class HashEmbedder:
    """Unit vectors seeded by the text's hash: each document is its own top hit."""

    def __init__(self, name: str):
        base = unit_identity(DIM)
        self.identity = replace(base, model=name, fingerprint=hashlib.sha256(name.encode()).hexdigest())

    @staticmethod
    def _seed(text: str) -> int:
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")

    def embed_documents(self, texts):
        return DocumentVectors([unit_vector(self._seed(t), DIM) for t in texts],
                               [unit_terms(self._seed(t)) for t in texts])

    def embed_query(self, text, mode):
        return unit_vector(self._seed(text), DIM), unit_terms(self._seed(text))


OLD, NEW = HashEmbedder("old"), HashEmbedder("new")


@pytest.fixture(params=["local", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request, tmp_path):
    url = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    st = open_store(url, str(tmp_path / "ix"))
    ix = st.create("kb", OLD.identity)
    docs = [Document(f"d{i}", f"document number {i} about rivers") for i in range(30)]
    v = OLD.embed_documents([d.text for d in docs])
    ix.upsert(docs, v.dense, v.sparse, OLD.identity)
    ix.close()
    return st


def _gate_module(store):
    return pg_reindex if getattr(store, "backend", "local") == "postgres" else local_reindex


def _write(store, doc: Document) -> None:
    ix = store.open("kb", OLD.identity)
    try:
        v = OLD.embed_documents([doc.text])
        ix.upsert([doc], v.dense, v.sparse, OLD.identity)
    finally:
        ix.close()


def test_a_write_between_the_last_pass_and_the_gate_passes_it_and_is_copied_at_the_swap(store, monkeypatch):
    mod = _gate_module(store)
    real, seen = mod.run_gate, []

    def write_then_gate(old, new, embedder, **kw):
        _write(store, Document("late", "a document written while the gate was about to run"))
        report = real(old, new, embedder, **kw)
        seen.append(report)
        return report
    monkeypatch.setattr(mod, "run_gate", write_then_gate)
    entry = migrations.for_store(store).reindex(store, "kb", NEW, batch_docs=8, sample=10)
    assert entry["swapped"]
    counts = seen[0].checks["counts"]
    assert counts["ok"] and "live 31 documents, new 30" in counts["detail"], counts
    assert "1 added" in counts["detail"] and "checks the counts again" in counts["detail"]
    ix = store.open("kb", NEW.identity)
    try:
        assert ix.counts()["documents"] == 31
        hit = ix.search(Query(dense=NEW.embed_query("a document written while the gate was about to run",
                                                    "dense")[0], top_k=1), NEW.identity)
        assert [h.id for h in hit] == ["late"]
    finally:
        ix.close()


def test_a_document_the_copy_lost_is_still_refused(store, monkeypatch):
    """Deleted from the new version behind the copy's back (a lost copy): the counts differ by a
    document written *before* the last pass, so the gate refuses and the live version stays."""
    mod = _gate_module(store)
    real = mod.run_gate

    def lose_then_gate(old, new, embedder, **kw):
        new.delete(["d3"])
        return real(old, new, embedder, **kw)
    monkeypatch.setattr(mod, "run_gate", lose_then_gate)
    with pytest.raises(GateFailed) as err:
        migrations.for_store(store).reindex(store, "kb", NEW, batch_docs=8, sample=10)
    assert "counts: live 30 documents, new 29" in str(err.value)
    assert store.current("kb") == "v1"


def test_without_writes_the_counts_must_be_equal(store):
    entry = migrations.for_store(store).reindex(store, "kb", NEW, batch_docs=8, sample=10)
    assert entry["swapped"] and entry["gate"]["checks"]["counts"] == {
        "ok": True, "detail": "live 30 documents, new 30 (dense vectors 30)"}


def test_many_rewrites_during_the_last_pass_do_not_hide_a_late_document(store, monkeypatch):
    """1,100 documents rewritten (metadata only) after the last pass began, then one added: the
    gate reads back every live document written since, not a fixed number of them."""
    ix = store.open("kb", OLD.identity)
    try:
        docs = [Document(f"m{i}", f"more text number {i} on lakes") for i in range(1100)]
        v = OLD.embed_documents([d.text for d in docs])
        ix.upsert(docs, v.dense, v.sparse, OLD.identity)
    finally:
        ix.close()
    mod = _gate_module(store)
    real, seen = mod.run_gate, []

    def rewrite_then_gate(old, new, embedder, **kw):
        rewritten = [Document(f"m{i}", f"more text number {i} on lakes", {"pass": "late"}) for i in range(1100)]
        ix = store.open("kb", OLD.identity)
        try:
            v = OLD.embed_documents([d.text for d in rewritten])
            ix.upsert(rewritten, v.dense, v.sparse, OLD.identity)
        finally:
            ix.close()
        _write(store, Document("late", "the last document, written after the rewrites"))
        seen.append(real(old, new, embedder, **kw))
        return seen[-1]
    monkeypatch.setattr(mod, "run_gate", rewrite_then_gate)
    entry = migrations.for_store(store).reindex(store, "kb", NEW, batch_docs=256, sample=10)
    assert entry["swapped"] and seen[0].checks["counts"]["ok"], seen[0].checks["counts"]
    assert "live 1131 documents, new 1130" in seen[0].checks["counts"]["detail"]
