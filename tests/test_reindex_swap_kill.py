"""A reindex or rollback SIGKILLed at the swap itself — right before `CURRENT` moves and right
after (the test-only fault points `EMBEDSERVE_FAULT_INJECT=before_swap|after_swap`) — leaves a
ledger that `index history`, a rerun and `--rollback` complete from the files on disk: each
behaves as after a clean swap or a clean refusal, and the ledger holds exactly one entry per
applied swap ("an entry means it was applied, and every applied swap has one")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from embedserve.embedders import ModelEmbedder
from index.docstore import RETIRED, Document
from index.errors import RetiredError
from index.ops import upsert_documents
from index.store import IndexStore
from migrations import ledger
from migrations.reindex import FAULT_INJECT_ENV
from helpers import build_wiki_index, copy_index as _copy, reindex_cli as _run_cli


@pytest.fixture(scope="module")
def small40(tmp_path_factory, minilm_model):
    """A MiniLM index of 40 documents (copied per test)."""
    return build_wiki_index(tmp_path_factory.mktemp("small40"), minilm_model, 40)


def _reindex(root: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    """`embedserve reindex --to-model multilingual-e5-small` (test_reindex's flags), optionally
    killed at a fault point."""
    env_before = os.environ.get(FAULT_INJECT_ENV)
    if fault:
        os.environ[FAULT_INJECT_ENV] = fault     # _run_cli's child inherits it
    try:
        proc = _run_cli(root)
    finally:
        if env_before is None:
            os.environ.pop(FAULT_INJECT_ENV, None)
        else:
            os.environ[FAULT_INJECT_ENV] = env_before
    out, _ = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def _cli(root: Path, *args, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != FAULT_INJECT_ENV}
    env["EMBEDSERVE_THREADS"] = "2"
    if fault:
        env[FAULT_INJECT_ENV] = fault
    return subprocess.run([sys.executable, "-m", "embedserve.cli", *args, "--index-dir", str(root)],
                          env=env, capture_output=True, text=True, timeout=300)


def _rollback(root: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    return _cli(root, "reindex", "--index", "wiki", "--rollback", fault=fault)


def _history(root: Path) -> list[tuple[str, str, str]]:
    """`embedserve index history wiki` as (kind, parent, version) rows."""
    p = _cli(root, "index", "history", "wiki")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    return [(e["kind"], e["parent"], e["version"]) for e in json.loads(p.stdout)]


def _raw_ledger(store: IndexStore) -> list[dict]:
    """Every line of the ledger file, whatever its status."""
    path = store.index_dir("wiki") / ledger.LEDGER
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _killed(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == -signal.SIGKILL, (p.returncode, (p.stdout or "")[-2000:], (p.stderr or "")[-2000:])


def _writable(store: IndexStore, version: str, emb: ModelEmbedder) -> bool:
    with store.open("wiki", version=version) as ix:
        try:
            upsert_documents(ix, [Document("probe", "A probe written to see whether this version takes writes.", {})],
                             emb)
        except RetiredError:
            return False
        ix.delete(["probe"])
        return True


def test_killed_right_after_the_swap(small40, tmp_path, minilm_model):
    store = _copy(small40, tmp_path)
    root = store.root

    _killed(_reindex(root, "after_swap"))               # CURRENT moved, the ledger not completed
    assert store.current("wiki") == "v2"
    assert [e["status"] for e in _raw_ledger(store)] == ["swapping"]
    assert _history(root) == [("reindex", "v1", "v2")]  # completed from CURRENT, as after a clean swap
    assert [e["status"] for e in _raw_ledger(store)] == ["applied"]

    rerun = _reindex(root)                              # the same model again: a clean refusal
    assert rerun.returncode == 1 and "already built with 'multilingual-e5-small'" in rerun.stdout, rerun.stdout[-2000:]

    _killed(_rollback(root, "after_swap"))              # the rollback's own swap, killed the same way
    assert store.current("wiki") == "v1"
    assert _history(root) == [("reindex", "v1", "v2"), ("rollback", "v2", "v1")]
    assert (store.version_dir("wiki", "v2") / RETIRED).exists()
    assert _writable(store, "v1", ModelEmbedder(minilm_model))

    again = _rollback(root)                             # v1 is not a migration's product: refused
    assert again.returncode == 1 and "nothing to roll back" in again.stderr, again.stderr
    assert store.current("wiki") == "v1"
    assert [(e["kind"], e["status"]) for e in _raw_ledger(store)] == [("reindex", "applied"), ("rollback", "applied")]


def test_killed_right_before_the_swap(small40, tmp_path, minilm_model, e5_model):
    store = _copy(small40, tmp_path)
    root = store.root

    _killed(_reindex(root, "before_swap"))              # the old version already marked retired
    assert store.current("wiki") == "v1"
    assert (store.version_dir("wiki", "v1") / RETIRED).exists()
    assert _history(root) == []                         # never went live: no entry ...
    assert _raw_ledger(store) == []
    assert not (store.version_dir("wiki", "v1") / RETIRED).exists()   # ... and v1 takes writes again
    assert _writable(store, "v1", ModelEmbedder(minilm_model))

    refused = _rollback(root)                           # nothing was applied: nothing to roll back
    assert refused.returncode == 1 and "nothing to roll back" in refused.stderr, refused.stderr

    rerun = _reindex(root)                              # resumes the same v2 and swaps it in
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert store.current("wiki") == "v2" and store.versions("wiki") == ["v1", "v2"]
    assert _history(root) == [("reindex", "v1", "v2")]

    _killed(_rollback(root, "before_swap"))             # the rollback killed before CURRENT moves
    assert store.current("wiki") == "v2"
    assert _history(root) == [("reindex", "v1", "v2")]
    assert (store.version_dir("wiki", "v1") / RETIRED).exists()       # still out of service
    assert _writable(store, "v2", ModelEmbedder(e5_model))

    back = _rollback(root)                              # and then done cleanly
    assert back.returncode == 0, back.stderr
    assert store.current("wiki") == "v1"
    assert _history(root) == [("reindex", "v1", "v2"), ("rollback", "v2", "v1")]
    assert [e["status"] for e in _raw_ledger(store)] == ["applied", "applied"]
