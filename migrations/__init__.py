"""Reindex migrations: `for_store(store)` is the module that migrates that store's indexes —
`migrations.reindex` (local files) or `migrations.pg_reindex` (PostgreSQL) — each with
`reindex`, `rollback`, `writes_since_swap`, `prune` and `history(store, name)`."""

from __future__ import annotations

from types import SimpleNamespace


def for_store(store):
    """The migration functions of `store`'s backend."""
    if getattr(store, "backend", "local") == "postgres":
        from . import pg_reindex
        return pg_reindex
    from . import ledger, reindex
    return SimpleNamespace(reindex=reindex.reindex, rollback=reindex.rollback, prune=reindex.prune,
                           writes_since_swap=reindex.writes_since_swap,
                           history=lambda store, name: ledger.history(store.index_dir(name)))
