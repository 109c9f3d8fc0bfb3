"""Where indexes live: the backend interface and the choice between its two implementations.

    local     (default) a directory per index: FAISS + sparse postings + a SQLite doc store per
              version, `CURRENT` moved by an atomic rename (index.store, index.core). One server
              process owns it.
    postgres  an index URL `postgresql://…`: tables in one schema, pgvector's HNSW, the live
              version a row (index.pg). Any number of replicas share it.

What every caller (the HTTP routes through `LiveIndexes`, `index.ops`, `migrations`, the CLI)
uses of a store — `IndexStore` and `PgStore` both have it:

    names() exists(name) current(name) live(name) versions(name) manifest(name, version=None)
    open(name, identity=None, version=None) -> version   create(name, identity, dense) -> version
    add_version(name, identity, dense) -> str   counts(name, version)   delete(name)   describe()

and of an open version (`Index`, `PgIndex`): name version key manifest, pending(docs),
upsert(docs, dense, sparse, identity) and delete(ids, identity) -> Change (with the write
sequence), search(Query, identity), counts(), describe(), snapshot(), close(), and `docs` with
the reads a migration makes (seq, counts, ids, documents_after, writes_after, live_labels,
fetch, iter_docs, source). The migration steps that differ (lock, checkpoint, swap, ledger,
prune) are in `migrations.reindex` (local) and `migrations.pg_reindex` (postgres).

psycopg is imported only when a PostgreSQL URL is given.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ValidationError

URL_ENV = "EMBEDSERVE_INDEX_URL"
SCHEMES = ("postgresql://", "postgres://")


def is_postgres(url: str | None) -> bool:
    return bool(url) and url.startswith(SCHEMES)


def check_url(url: str | None) -> str | None:
    """None (the local backend) or a PostgreSQL URL; anything else is refused, naming the flag."""
    if url in (None, ""):
        return None
    if not is_postgres(url):
        raise ValidationError(f"index URL {url[:40]!r}: give a PostgreSQL URL (postgresql://user@host:5432/db) or "
                              "none (indexes on local disk, under --index-dir)", param="index_url",
                              code="invalid_index_url")
    return url


def open_store(url: str | None = None, root: str | os.PathLike | None = None, *, schema: str = "embedserve",
               pool_size: int = 16):
    """The store `url` names (PostgreSQL), else the local one under `root`."""
    if check_url(url):
        from .pg.store import PgStore
        return PgStore(url, schema=schema, pool_size=pool_size)
    from .store import IndexStore
    if root is None:
        raise ValidationError("a local index store needs its root directory", param="index_dir")
    return IndexStore(Path(root))


def read_documents(source: str, after: int, upto: int):
    """(wseq, document) of a version's live documents with `after` < wseq <= `upto`, in write
    order, over a connection of its own (a reindex shard read by a worker process): `source` is
    a version's `docs.source`, a SQLite path or `postgresql://…#schema.docs_<id>`."""
    if is_postgres(source):
        from .pg.read import read_documents as pg_read
        return pg_read(source, after, upto)
    from .docstore import read_documents as sqlite_read
    return sqlite_read(Path(source), after, upto)
