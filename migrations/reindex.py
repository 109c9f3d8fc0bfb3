"""Full reindex migration: re-embed every live document with a new model into a new version
beside the live one, resumably, then gate, swap `CURRENT` atomically, and record it.

    live vN ──read in write order (wseq)──▶ embed (new model) ──▶ vN+1 + checkpoint per batch
            ──catch-up (writes made meanwhile, metadata-only ones too: by wseq; deletions: by id)──▶ gate ──▶ CURRENT = vN+1
            ──▶ ledger entry;  vN stays for `rollback`

Kill it anywhere and run it again: the checkpoint names the last live write copied, and the
new version's doc store skips documents whose text it already holds, so each document is
embedded once. The last catch-up and the swap run under the live version's SQLite write lock,
and the old version is marked retired inside it, so a writer still holding the old version
after the swap is refused (retryable) instead of writing where no one reads.

The ledger entry of a swap (a reindex's or a rollback's) is written as "swapping" before any
marker or `CURRENT` moves and completed after; a process killed in between leaves it for the
next migration, rollback or `index history` to settle from `CURRENT` (`ledger.recover`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from index import ops
from index.core import TEMP_LOCK, Index
from index.docstore import DB_NAME, RETIRED
from index.durable import atomic_write, file_lock
from index.embedder import DocumentVectors
from index.store import IndexStore

from . import ledger
from .errors import GateFailed, MigrationError
from .gate import GateReport, run_gate
from .lock import migration_lock

logger = logging.getLogger(__name__)

CHECKPOINT = "reindex.json"
# Test-only aid: the kill tests set this to a fault point's name ("before_swap", "after_swap")
# and the process SIGKILLs itself there, as `kill -9` at that instant would. Nothing else sets it.
FAULT_INJECT_ENV = "EMBEDSERVE_FAULT_INJECT"


def _fault_point(where: str) -> None:
    """Die here, as `kill -9` would, when the (test-only) fault-injection variable names `where`."""
    if os.environ.get(FAULT_INJECT_ENV) == where:
        logger.warning("fault injection: SIGKILL at %s", where)
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(slots=True)
class Checkpoint:
    """Progress of one reindex, in the new version's directory."""

    parent: str
    version: str
    to_model: str
    to_fingerprint: str
    copied_upto: int = 0            # the live version's last write (wseq) copied into the new one
    embedded: int = 0               # documents embedded over every run (resumes included)
    swap_seq: int = 0               # the new version's last write when it went live
    started_at: float = field(default_factory=time.time)
    finished: bool = False

    def save(self, version_dir: Path) -> None:
        _write_in_version(version_dir, CHECKPOINT, json.dumps(asdict(self), indent=2))

    def save_to(self, version_dir: Path) -> Callable[["Checkpoint"], None]:
        return lambda ck: ck.save(version_dir)

    @classmethod
    def load(cls, version_dir: Path) -> "Checkpoint | None":
        try:
            return cls(**json.loads((version_dir / CHECKPOINT).read_text()))
        except (OSError, ValueError, TypeError):
            return None


@contextmanager
def _writers_held_off(version_dir: Path):
    """The version's temp lock, then SQLite's write lock on its doc store — the order a snapshot
    takes them, so a server snapshotting it meanwhile cannot deadlock with us: writers to it
    wait, readers go on. Yields the connection holding the lock (nothing is written through it)."""
    with file_lock(version_dir / TEMP_LOCK):
        lock = sqlite3.connect(str(version_dir / DB_NAME), timeout=60, isolation_level=None)
        try:
            lock.execute("BEGIN IMMEDIATE")
            yield lock
        finally:
            if lock.in_transaction:
                lock.execute("ROLLBACK")
            lock.close()


def _write_in_version(version_dir: Path, name: str, text: str) -> None:
    """Atomically write a file into a version directory, under its temp lock: a process opening
    that version meanwhile cleans stray temp files and must not take ours for a dead writer's."""
    with file_lock(version_dir / TEMP_LOCK):
        atomic_write(version_dir / name, text.encode())


def _target(store: IndexStore, name: str, live: str, embedder) -> tuple[str, Checkpoint]:
    """The unfinished version a previous run of this migration left, else a new one. A version
    that went live once (its ledger entry says so) is never resumed, even if the run that
    swapped it in was killed before it marked its checkpoint finished."""
    applied = {e["version"] for e in ledger.history(store.index_dir(name), resolve=False) if e["kind"] == "reindex"}
    for version in reversed(store.versions(name)):
        ck = Checkpoint.load(store.version_dir(name, version))
        if (ck and not ck.finished and version not in applied and ck.parent == live
                and ck.to_fingerprint == embedder.identity.fingerprint):
            logger.info("index %s: resuming the reindex into %s after write %d", name, version, ck.copied_upto)
            return version, ck
    version = store.add_version(name, embedder.identity)
    ck = Checkpoint(parent=live, version=version, to_model=embedder.identity.model,
                    to_fingerprint=embedder.identity.fingerprint)
    ck.save(store.version_dir(name, version))
    return version, ck


def _copy(old: Index, new: Index, embedder, ck: Checkpoint, save: Callable[[Checkpoint], None], batch_docs: int,
          on_batch: Callable[[int], None] | None, engine=None) -> int:
    """Copy every live document written after the checkpoint (either backend's), embedded in process
    or (bulk) by `engine` (a `RayEngine`), `save`-ing the checkpoint per batch; returns how many."""
    if engine is not None:
        seqs = old.docs.writes_after(ck.copied_upto)
        batches = engine.batches(old.docs.source, seqs, ck.copied_upto, batch_docs,
                                 embedder.identity.fingerprint)
    else:
        batches = _local_batches(old, ck, batch_docs)
    total = 0
    for rows, vectors in batches:
        docs = [doc for _, doc in rows]
        if vectors is None:                   # in process: only new or changed texts are embedded
            result = ops.upsert_documents(new, docs, embedder)
            ck.embedded += result.added + result.replaced
        else:                                 # embedded elsewhere: keep what this version already holds
            todo = ops.plan_upsert(new, docs)
            cut = set(vectors.truncated)
            ops.commit_upsert(new, docs, todo, DocumentVectors([vectors.dense[i] for i in todo],
                                                               [vectors.sparse[i] for i in todo],
                                                               [j for j, i in enumerate(todo) if i in cut]),
                              embedder.identity)
            ck.embedded += len(docs)
        ck.copied_upto = rows[-1][0]
        save(ck)                              # after the batch is committed: at most this batch twice
        total += len(rows)
        if on_batch:
            on_batch(len(rows))
    return total


def copy_passes(old: Index, new: Index, embedder, ck: Checkpoint, save: Callable[[Checkpoint], None],
                batch_docs: int, on_batch, engine, max_passes: int) -> int:
    """The first pass copies everything (on `engine` if given); the next ones catch up with writes
    made meanwhile, until the gap is small (the last one runs at the swap). Either backend's.
    Returns the live version's sequence number when the last pass began: every write up to it
    is in `new` (the gate's `settled_seq`)."""
    settled = old.docs.seq()
    for p in range(max_passes):
        settled = old.docs.seq()
        moved = (_copy(old, new, embedder, ck, save, batch_docs, on_batch, engine if p == 0 else None)
                 + _drop_deleted(old, new))
        if moved <= batch_docs:
            break
    return settled


def live_to_migrate(store, name: str, embedder):
    """(live version, its manifest), refused when the live version is `embedder`'s model already."""
    live = store.current(name)
    old_manifest = store.manifest(name, live)
    new = embedder.identity
    if (old_manifest.fingerprint, old_manifest.sparse_fingerprint, old_manifest.prompt_texts()) == (
            new.fingerprint, new.sparse_fingerprint, new.prompt_texts()):
        raise MigrationError(f"index {name!r} is already built with {embedder.identity.model!r}; nothing to "
                             "reindex", code="same_model")
    return live, old_manifest


def _local_batches(old: Index, ck: Checkpoint, batch_docs: int):
    """Batches of live documents after the checkpoint (read as it advances), vectors left to the caller."""
    while rows := old.docs.documents_after(ck.copied_upto, batch_docs):
        yield rows, None


def _drop_deleted(old: Index, new: Index) -> int:
    """Delete from `new` what the live version deleted meanwhile (compared by id)."""
    gone = sorted(new.docs.ids() - old.docs.ids())
    if gone:
        new.delete(gone)
    return len(gone)


def reindex(store: IndexStore, name: str, embedder, *, batch_docs: int = 256, sample: int = 1000,
            dry_run: bool = False, old_embedder=None, on_batch: Callable[[int], None] | None = None,
            max_passes: int = 5, engine=None) -> dict:
    """Run (or resume) the migration of `name` to `embedder`'s model; returns its ledger entry
    (with `swapped: False` on a dry run). Raises GateFailed, leaving the live version untouched.
    With `engine` (a `migrations.ray_engine.RayEngine`) the first, bulk pass is embedded on Ray;
    the catch-up passes (small by then), the gate and the swap run here with `embedder`."""
    index_dir = store.index_dir(name)
    with migration_lock(index_dir, name):
        ledger.recover(index_dir)                   # a swap a killed run left unrecorded
        live, old_manifest = live_to_migrate(store, name, embedder)
        version, ck = _target(store, name, live, embedder)
        new_dir = store.version_dir(name, version)
        t0 = time.time()
        old = store.open(name, version=live)
        new = store.open(name, embedder.identity, version=version)
        try:
            settled = copy_passes(old, new, embedder, ck, ck.save_to(new_dir), batch_docs, on_batch, engine, max_passes)
            report = run_gate(old, new, embedder, sample=sample, old_embedder=old_embedder, settled_seq=settled)
            if not report.ok:
                raise GateFailed(f"the gate refused {name}/{version}; {live} stays live: "
                                 + "; ".join(report.failures()), report)

            def entry() -> dict:
                return ledger.reindex_entry(name, old_manifest, live, version, embedder, ck, report, t0, engine)
            if dry_run:
                return {**entry(), "swapped": False}
            # catch up with what was written while the gate ran, so little is left for the held writers
            copy_passes(old, new, embedder, ck, ck.save_to(new_dir), batch_docs, None, None, max_passes)
            with _settled_on_error(index_dir):
                begun = _swap_under_write_lock(store, name, old, new, embedder, ck, new_dir, batch_docs, report,
                                               lambda: ledger.begin(index_dir, entry()))
                done = ledger.complete(index_dir, begun)
            ck.finished = True
            ck.save(new_dir)
            return {**done, "swapped": True}
        finally:
            old.close(snapshot=False)
            new.close()


@contextmanager
def _settled_on_error(index_dir: Path):
    """An error between a ledger entry's `begin` and `complete` settles the entry at once from
    `CURRENT` (a kill leaves that to the next run, rollback or `index history`)."""
    try:
        yield
    except BaseException:
        try:
            ledger.recover(index_dir)
        except Exception:                                   # the original error matters more
            logger.exception("index %s: settling the unfinished ledger entry failed", index_dir.name)
        raise


def _swap_under_write_lock(store, name, old, new, embedder, ck, new_dir, batch_docs, report: GateReport,
                           begin: Callable[[], dict]) -> dict:
    """The last catch-up and the swap, with writers to the live version held off; returns the
    ledger entry `begin()` wrote ("swapping") just before the swap."""
    with _writers_held_off(old.path):
        _copy(old, new, embedder, ck, ck.save_to(new_dir), batch_docs, None)
        _drop_deleted(old, new)
        n_old, n_new = old.docs.counts()["documents"], new.docs.counts()["documents"]
        if n_old != n_new:
            report.check("counts_at_swap", False, f"live {n_old}, new {n_new}")
            raise GateFailed(f"counts differ at the swap (live {n_old}, new {n_new}); nothing swapped", report)
        new.snapshot()
        ck.swap_seq = new.docs.seq()              # a rollback carries back the writes after it
        entry = begin()                           # from here a kill is settled from CURRENT
        atomic_write(old.path / RETIRED, f"{new.version}\n".encode())   # we hold its temp lock
        _fault_point("before_swap")
        store.set_current(name, new.version)
        _fault_point("after_swap")
    return entry


def rollback(store: IndexStore, name: str, embedder=None, *, batch_docs: int = 256) -> dict:
    """Move `CURRENT` back to the version the last migration replaced, carrying over the writes
    made to the live version since the swap (documents added or changed: re-embedded by
    `embedder`, the parent's model, needed only when some text changed, see `writes_since_swap`;
    metadata changes and deletions need no model). With nothing written since the swap it is a
    move of `CURRENT` under the write lock, well under a second. Recorded in the ledger."""
    index_dir = store.index_dir(name)
    with migration_lock(index_dir, name):
        ledger.recover(index_dir)                   # a swap a killed run left unrecorded
        live = store.current(name)
        last = ledger.last_migration(ledger.history(index_dir, resolve=False), name, live)
        parent, since = last["parent"], last.get("swap_seq", 0)
        t0 = time.time()

        def begin(carried: int) -> dict:
            return ledger.begin(index_dir, ledger.rollback_entry(name, live, last, carried, t0))
        with _settled_on_error(index_dir):
            begun = _move_back_if_untouched(store, name, live, parent, since, begin) or \
                _carry_back(store, name, live, parent, since, embedder, batch_docs, begin)
            return ledger.complete(index_dir, begun)


def _move_back_if_untouched(store: IndexStore, name: str, live: str, parent: str, since: int,
                            begin: Callable[[int], dict]) -> dict | None:
    """If nothing was written to `live` since the swap (its doc store's sequence number is still
    `since`), make `parent` live again, holding writers off while we look, and return the ledger
    entry `begin(0)` wrote before the move; else None."""
    live_dir = store.version_dir(name, live)
    with _writers_held_off(live_dir) as lock:
        if since == 0 or int(lock.execute("SELECT value FROM meta WHERE key='seq'").fetchone()[0]) != since:
            return None
        entry = begin(0)                                                 # settled from CURRENT after a kill
        (store.version_dir(name, parent) / RETIRED).unlink(missing_ok=True)
        atomic_write(live_dir / RETIRED, f"{parent}\n".encode())        # we hold its temp lock
        _fault_point("before_swap")
        store.set_current(name, parent)
        _fault_point("after_swap")
        return entry


def _carry_back(store: IndexStore, name: str, live: str, parent: str, since: int, embedder,
                batch_docs: int, begin: Callable[[int], dict]) -> dict:
    """Copy the writes made to `live` after its write `since` into `parent` (passes until the
    gap is small, the last under the write lock), then make `parent` live; returns the ledger
    entry `begin(documents carried)` wrote before the move. On failure `parent` stays retired
    and `live` live."""
    parent_dir = store.version_dir(name, parent)
    (parent_dir / RETIRED).unlink(missing_ok=True)          # it takes the writes we carry back
    cur = store.open(name, version=live)
    back = store.open(name, version=parent)
    swapped = False
    try:
        carried, upto = carry_passes(cur, back, since, embedder, batch_docs)
        with _writers_held_off(cur.path):
            moved, _ = _carry(cur, back, upto, embedder, batch_docs)
            n_cur, n_back = cur.docs.counts()["documents"], back.docs.counts()["documents"]
            if n_cur != n_back:
                raise MigrationError(f"counts differ after carrying the writes back (live {n_cur}, "
                                     f"{parent} {n_back}); nothing rolled back", code="rollback_counts")
            back.snapshot()
            entry = begin(carried + moved)                           # settled from CURRENT after a kill
            atomic_write(cur.path / RETIRED, f"{parent}\n".encode())    # we hold its temp lock
            _fault_point("before_swap")
            store.set_current(name, parent)
            swapped = True
            _fault_point("after_swap")
        return entry
    finally:
        cur.close(snapshot=False)
        back.close()
        if not swapped:                                      # the parent stays out of service
            _write_in_version(parent_dir, RETIRED, f"{live}\n")


def writes_since_swap(store: IndexStore, name: str, history: list[dict] | None = None) -> dict:
    """What a rollback of `name` would carry back: the documents written on the live version
    since the swap (`written`), of which `texts` have a text the parent does not hold (these need
    the parent's model, `model`), and the documents deleted since. (`history`: the ledger, if read.)"""
    history = ledger.history(store.index_dir(name)) if history is None else history  # settles a killed swap
    live = store.current(name)
    last = ledger.last_migration(history, name, live)
    cur = store.open(name, version=live)
    back = store.open(name, version=last["parent"])
    try:
        out = {"written": 0, "texts": 0, "deleted": len(back.docs.ids() - cur.docs.ids()),
               "model": back.manifest.model, "sparse_model": back.manifest.sparse_model,
               "prompts": back.manifest.prompt_texts()}
        upto = last.get("swap_seq", 0)
        while rows := cur.docs.documents_after(upto, 1024):
            out["written"] += len(rows)
            out["texts"] += len(ops.plan_upsert(back, [d for _, d in rows]))
            upto = rows[-1][0]
        return out
    finally:
        cur.close(snapshot=False)
        back.close(snapshot=False)


def carry_passes(src: Index, dst: Index, after: int, embedder, batch_docs: int, passes: int = 5) -> tuple[int, int]:
    """`_carry` until a pass moves at most a batch (the last runs under the write lock, at the
    swap); returns (documents carried, the last write carried). Either backend's rollback."""
    carried = 0
    for _ in range(passes):
        moved, after = _carry(src, dst, after, embedder, batch_docs)
        carried += moved
        if moved <= batch_docs:
            break
    return carried, after


def _carry(src: Index, dst: Index, after: int, embedder, batch_docs: int) -> tuple[int, int]:
    """Write into `dst` what `src` took after its write `after` (deletions compared by id);
    returns (documents moved, the last write carried)."""
    moved = 0
    identity = dst.manifest.identity
    while rows := src.docs.documents_after(after, batch_docs):
        docs = [d for _, d in rows]
        todo = ops.plan_upsert(dst, docs)
        if todo and embedder is None:
            raise MigrationError(f"{len(todo)} document text(s) were added or changed on {src.version} since the "
                                 f"swap; rolling back re-embeds them with {dst.manifest.model!r}: give that "
                                 "model (the CLI loads it)", code="rollback_needs_model")
        if todo:
            embedder_identity = embedder.identity
            vectors = embedder.embed_documents([docs[i].text for i in todo])
        else:
            embedder_identity, vectors = identity, DocumentVectors([], [])
        ops.commit_upsert(dst, docs, todo, vectors, embedder_identity)
        after = rows[-1][0]
        moved += len(rows)
    return moved + _drop_deleted(src, dst), after


def prune(store: IndexStore, name: str, keep: int) -> list[str]:
    """Delete all but the newest `keep` versions besides the live one (never the live one)."""
    import shutil
    live = store.current(name)
    others = [v for v in store.versions(name) if v != live]
    doomed = others[:max(0, len(others) - keep)]
    for v in doomed:
        shutil.rmtree(store.version_dir(name, v))
    return doomed

