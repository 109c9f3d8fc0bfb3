"""Reindex migrations on PostgreSQL (`--index-url postgresql://…`): the same steps and CLI as
`migrations.reindex`, with the database doing what files and locks do there.

    one migration per index        a session advisory lock (released if the process dies)
    checkpoint                     `versions.checkpoint` of the new version, saved per batch
    HNSW of the new version        built once after the bulk copy, not grown per inserted row
    copy, catch-up, gate           `migrations.reindex`'s own (`_copy`, `_drop_deleted`, `run_gate`)
    swap                           ONE transaction: the live version's row locked (its writers
                                   wait), the last catch-up, `indexes.live_version` moved, the old
                                   version retired, the checkpoint finished, the ledger row written

A kill before the commit leaves nothing moved and nothing recorded; after it, everything is.
There is no "swapping" ledger state and nothing to settle: the window between the swap and its
record that the local backend closes with `ledger.recover` does not exist here.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import asdict

from index.pg.store import PgStore

from .errors import GateFailed, MigrationError
from .gate import run_gate
from .ledger import last_migration, reindex_entry, rollback_entry
from .reindex import (Checkpoint, _carry, _copy, _drop_deleted, _fault_point, carry_passes, copy_passes,
                      live_to_migrate, writes_since_swap as _writes_since_swap)

logger = logging.getLogger(__name__)


@contextmanager
def migration_lock(store: PgStore, name: str):
    """Hold the index's migration lock (a session advisory lock) or refuse, as the local lock does."""
    key = f"embedserve:migration:{store.db.schema}:{name}"
    with store.db.session() as conn:
        got = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (key,)).fetchone()[0]
        conn.commit()
        if not got:
            raise MigrationError(f"a migration of index {name!r} is already running (another process holds its "
                                 "lock in the database); wait for it or stop it first", code="migration_running")
        try:
            yield
        finally:
            if not conn.closed:
                conn.rollback()
                conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (key,))
                conn.commit()


def history(store: PgStore, name: str) -> list[dict]:
    return store.history(name)


def _target(store: PgStore, name: str, live: str, embedder) -> tuple[str, Checkpoint]:
    """The unfinished version a previous run left (never one that went live), else a new one."""
    applied = {e["version"] for e in store.history(name) if e["kind"] == "reindex"}
    for version in reversed(store.versions(name)):
        raw = store.checkpoint(name, version)
        ck = Checkpoint(**raw) if raw else None
        if (ck and not ck.finished and version not in applied and ck.parent == live
                and ck.to_fingerprint == embedder.identity.fingerprint):
            logger.info("index %s: resuming the reindex into %s after write %d", name, version, ck.copied_upto)
            return version, ck
    version = store.add_version(name, embedder.identity, ann=False)      # HNSW built once, after the copy
    ck = Checkpoint(parent=live, version=version, to_model=embedder.identity.model,
                    to_fingerprint=embedder.identity.fingerprint)
    store.save_checkpoint(name, version, asdict(ck))
    return version, ck


def reindex(store: PgStore, name: str, embedder, *, batch_docs: int = 256, sample: int = 1000,
            dry_run: bool = False, old_embedder=None, on_batch=None, max_passes: int = 5, engine=None) -> dict:
    """`migrations.reindex.reindex` on PostgreSQL: same arguments, same ledger entry."""
    with migration_lock(store, name):
        live, old_manifest = live_to_migrate(store, name, embedder)
        version, ck = _target(store, name, live, embedder)
        t0 = time.time()
        old = store.open(name, version=live)
        new = store.open(name, embedder.identity, version=version)

        def save(c: Checkpoint) -> None:
            store.save_checkpoint(name, version, asdict(c))
        settled = copy_passes(old, new, embedder, ck, save, batch_docs, on_batch, engine, max_passes)
        store.build_ann(name, version)           # one bulk build (a resumed run may find it built)
        report = run_gate(old, new, embedder, sample=sample, old_embedder=old_embedder, settled_seq=settled)
        if not report.ok:
            raise GateFailed(f"the gate refused {name}/{version}; {live} stays live: " + "; ".join(report.failures()),
                             report)

        def entry() -> dict:
            return {**reindex_entry(name, old_manifest, live, version, embedder, ck, report, t0, engine),
                    "status": "applied"}
        if dry_run:
            return {**entry(), "swapped": False}
        # catch up with what was written while the gate ran, so little is left for the held writers
        copy_passes(old, new, embedder, ck, save, batch_docs, None, None, max_passes)
        with store.db.transaction() as cur:
            _hold_writers(store, cur, old.id)
            _copy(old, new, embedder, ck, save, batch_docs, None)
            _drop_deleted(old, new)
            n_old, n_new = old.docs.counts()["documents"], new.docs.counts()["documents"]
            if n_old != n_new:
                report.check("counts_at_swap", False, f"live {n_old}, new {n_new}")
                raise GateFailed(f"counts differ at the swap (live {n_old}, new {n_new}); nothing swapped", report)
            ck.swap_seq = new.docs.seq()
            ck.finished = True
            done = entry()
            _move_live(store, cur, name, live, old.id, version, new.id, done)
            store.save_checkpoint(name, version, asdict(ck), cur=cur)
            _fault_point("before_swap")            # killed here: the transaction never commits
        _fault_point("after_swap")
        logger.info("index %s: %s is live (%s -> %s)", name, version, old_manifest.model, embedder.identity.model)
        return {**done, "swapped": True}


def _hold_writers(store: PgStore, cur, version_id: int) -> int:
    """Lock a version's row for the rest of the transaction: its writers wait (and then find it
    retired); returns its write sequence."""
    cur.execute(store.sql("SELECT seq FROM {versions} WHERE id = %s FOR UPDATE"), (version_id,))
    return int(cur.fetchone()[0])


def _move_live(store: PgStore, cur, name: str, live: str, live_id: int, to: str, to_id: int, entry: dict) -> None:
    """Inside the swap's transaction: `to` live, `live` retired, the ledger row written."""
    cur.execute(store.sql("UPDATE {indexes} SET live_version = %s WHERE name = %s AND live_version = %s"),
                (to, name, live))
    if cur.rowcount != 1:
        raise MigrationError(f"index {name!r}: {live} stopped being live during the migration; nothing swapped",
                             code="live_moved")
    cur.execute(store.sql("UPDATE {versions} SET retired_by = %s WHERE id = %s"), (to, live_id))
    cur.execute(store.sql("UPDATE {versions} SET retired_by = NULL WHERE id = %s"), (to_id,))
    cur.execute(store.sql("INSERT INTO {ledger} (index_name, entry) VALUES (%s, %s::jsonb)"),
                (name, json.dumps(entry, ensure_ascii=False)))


def _set_retired(store: PgStore, version_id: int, by: str | None) -> None:
    with store.db.transaction() as cur:
        cur.execute(store.sql("UPDATE {versions} SET retired_by = %s WHERE id = %s"), (by, version_id))


def rollback(store: PgStore, name: str, embedder=None, *, batch_docs: int = 256) -> dict:
    """`migrations.reindex.rollback` on PostgreSQL: the version the last migration replaced is
    live again, with the writes made since the swap carried back, in one transaction."""
    with migration_lock(store, name):
        live = store.current(name)
        last = last_migration(store.history(name), name, live)
        parent, since = last["parent"], last.get("swap_seq", 0)
        t0 = time.time()
        cur_ix, back = store.open(name, version=live), store.open(name, version=parent)

        def entry(carried: int) -> dict:
            return {**rollback_entry(name, live, last, carried, t0), "status": "applied"}
        with store.db.transaction() as cur:
            untouched = bool(since) and _hold_writers(store, cur, cur_ix.id) == since   # nothing written since
            if untouched:
                done = entry(0)
                _move_live(store, cur, name, live, cur_ix.id, parent, back.id, done)
                _fault_point("before_swap")
        if untouched:
            return _after_swap(done)
        _set_retired(store, back.id, None)                  # it takes the writes we carry back
        swapped = False
        try:
            carried, upto = carry_passes(cur_ix, back, since, embedder, batch_docs)
            with store.db.transaction() as cur:
                _hold_writers(store, cur, cur_ix.id)
                moved, _ = _carry(cur_ix, back, upto, embedder, batch_docs)
                n_cur, n_back = cur_ix.docs.counts()["documents"], back.docs.counts()["documents"]
                if n_cur != n_back:
                    raise MigrationError(f"counts differ after carrying the writes back (live {n_cur}, {parent} "
                                         f"{n_back}); nothing rolled back", code="rollback_counts")
                done = entry(carried + moved)
                _move_live(store, cur, name, live, cur_ix.id, parent, back.id, done)
                _fault_point("before_swap")
            swapped = True
        finally:
            if not swapped:                                # the parent stays out of service
                _set_retired(store, back.id, live)
        return _after_swap(done)


def _after_swap(entry: dict) -> dict:
    _fault_point("after_swap")
    return entry


def writes_since_swap(store: PgStore, name: str) -> dict:
    return _writes_since_swap(store, name, store.history(name))


def prune(store: PgStore, name: str, keep: int) -> list[str]:
    """Delete all but the newest `keep` versions besides the live one (never the live one), under
    the migration lock, in one transaction."""
    with migration_lock(store, name):
        with store.db.transaction() as cur:
            cur.execute(store.sql("SELECT live_version FROM {indexes} WHERE name = %s FOR UPDATE"), (name,))
            row = cur.fetchone()
            if row is None:
                store.current(name)                          # the NotFoundError
            others = [v for v in store.versions(name) if v != row[0]]
            doomed = others[:max(0, len(others) - keep)]
            for v in doomed:
                store.drop_version(cur, name, v)
        return doomed
