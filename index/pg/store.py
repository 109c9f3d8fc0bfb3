"""All indexes in one PostgreSQL schema: the `IndexStore` interface over tables.

    <schema>.indexes    name → live_version: the row a swap updates (the local backend's CURRENT)
    <schema>.versions   (index, version) → manifest, write sequence, retired_by, checkpoint, id
    <schema>.docs_<id>  one table of documents per version (index.pg.version)
    <schema>.lex_<id>   BM25 versions: their postings (token, label, tf)
    <schema>.ledger     one row per swap that went live, written in the swap's own transaction

Creating an index or a version (rows, table, its indexes) and deleting one are single
transactions: another replica sees all of it or none of it.
"""

from __future__ import annotations

import json
import logging

from ..errors import ConflictError, NotFoundError
from ..manifest import DenseConfig, Manifest, ModelIdentity
from ..store import check_name, check_version
from .db import Database, redact
from .vectors import dense_type
from .version import PgIndex, VersionRow

logger = logging.getLogger(__name__)


class PgStore:
    """The indexes of one database schema (thread-safe; one pool per store)."""

    backend = "postgres"

    def __init__(self, url: str, *, schema: str = "embedserve", pool_size: int = 16):
        self.db = Database(url, schema=schema, max_size=pool_size)
        self.url = url
        self.root = None                    # no directory: nothing of the index is on this machine

    def __repr__(self) -> str:
        return f"PgStore({redact(self.url)}, schema={self.db.schema})"

    def describe(self) -> str:
        return f"postgres ({redact(self.url)}, schema {self.db.schema})"

    def sql(self, text: str, **ids):
        return self.db.sql.SQL(text).format(indexes=self.db.name("indexes"), versions=self.db.name("versions"),
                                            ledger=self.db.name("ledger"), **ids)

    def _query(self, text: str, params=(), **ids) -> list[tuple]:
        self.db.ensure_schema()
        return self.db.fetch(self.sql(text, **ids), params)

    # ------------------------------------------------------------------ reads
    def exists(self, name: str) -> bool:
        return bool(self._query("SELECT 1 FROM {indexes} WHERE name = %s", (check_name(name),)))

    def names(self) -> list[str]:
        return [r[0] for r in self._query("SELECT name FROM {indexes} ORDER BY name")]

    def current(self, name: str) -> str:
        rows = self._query("SELECT live_version FROM {indexes} WHERE name = %s", (check_name(name),))
        if not rows:
            raise NotFoundError(f"index {name!r} does not exist; create it first, or list the indexes there are",
                                param="name", code="index_not_found")
        return check_version(rows[0][0])

    def versions(self, name: str) -> list[str]:
        rows = self._query("SELECT version FROM {versions} WHERE index_name = %s", (check_name(name),))
        if not rows and not self.exists(name):
            raise NotFoundError(f"index {name!r} does not exist", param="name", code="index_not_found")
        return sorted((r[0] for r in rows), key=lambda v: int(v[1:]))

    def live(self, name: str) -> tuple[str, int]:
        """(live version, its row id), in one statement: the id tells a version apart from one
        of the same name made after the index was deleted and created again."""
        rows = self._query("SELECT i.live_version, v.id FROM {indexes} i JOIN {versions} v ON v.index_name = i.name "
                           "AND v.version = i.live_version WHERE i.name = %s", (check_name(name),))
        if not rows:
            raise NotFoundError(f"index {name!r} does not exist; create it first, or list the indexes there are",
                                param="name", code="index_not_found")
        return check_version(rows[0][0]), int(rows[0][1])

    def _row(self, name: str, version: str) -> VersionRow:
        key = (check_name(name), check_version(version))
        rows = self._query("SELECT id, manifest FROM {versions} WHERE index_name = %s AND version = %s", key)
        if not rows:
            raise NotFoundError(f"index {name!r} has no version {version!r}", param="version", code="index_not_found")
        return VersionRow(int(rows[0][0]), name, version, Manifest(**rows[0][1]))

    def manifest(self, name: str, version: str | None = None) -> Manifest:
        return self._row(name, version or self.current(name)).manifest

    def version_id(self, name: str, version: str) -> int:
        return self._row(name, version).id

    def open(self, name: str, identity: ModelIdentity | None = None, version: str | None = None, **_kw) -> PgIndex:
        """A version (default: the live one); with `identity`, refused on a manifest mismatch (409)."""
        return PgIndex(self.db, self._row(name, version or self.current(name)), identity)

    def counts(self, name: str, version: str) -> dict[str, int]:
        return self.open(name, version=version).counts()

    # ----------------------------------------------------------------- writes
    def create(self, name: str, identity: ModelIdentity, dense: DenseConfig | None = None, **_kw) -> PgIndex:
        """Create index `name` with an empty v1 bound to `identity`'s model, and open it."""
        check_name(name)
        self.db.ensure_schema()
        dense = dense or DenseConfig()
        with self.db.transaction() as cur:
            cur.execute(self.sql("INSERT INTO {indexes} (name, live_version) VALUES (%s, 'v1') ON CONFLICT (name) "
                                  "DO NOTHING RETURNING name"), (name,))
            if cur.fetchone() is None:
                raise ConflictError(f"index {name!r} already exists; pick another name or delete it first",
                                    param="name", code="index_exists")
            self._add_version(cur, name, "v1", identity, dense)
        logger.info("created index %s (model %s, %s) in %s", name, identity.model, dense.kind, self.describe())
        return self.open(name, identity)

    def add_version(self, name: str, identity: ModelIdentity, dense: DenseConfig | None = None, *,
                    ann: bool = True) -> str:
        """A new, empty version beside the others (not live until a swap makes it so). With
        `ann=False` its HNSW index is left for `build_ann` (a reindex fills the table first: one
        bulk build is far cheaper than an insert into the graph per document)."""
        self.db.ensure_schema()
        dense = dense or DenseConfig(**self.manifest(name).dense_index)
        with self.db.transaction() as cur:
            cur.execute(self.sql("SELECT 1 FROM {indexes} WHERE name = %s FOR UPDATE"), (check_name(name),))
            if cur.fetchone() is None:
                raise NotFoundError(f"index {name!r} does not exist", param="name", code="index_not_found")
            cur.execute(self.sql("SELECT version FROM {versions} WHERE index_name = %s"), (name,))
            version = f"v{max((int(r[0][1:]) for r in cur.fetchall()), default=0) + 1}"
            self._add_version(cur, name, version, identity, dense, ann=ann)
        return version

    def _add_version(self, cur, name: str, version: str, identity: ModelIdentity, dense: DenseConfig, *,
                     ann: bool = True) -> int:
        m = Manifest.new(name, version, identity, dense)
        cur.execute(self.sql("INSERT INTO {versions} (index_name, version, manifest) VALUES (%s, %s, %s::jsonb) "
                              "RETURNING id"), (name, version, m.to_json().decode()))
        vid = int(cur.fetchone()[0])
        t = self.db.table(vid)
        sql = self.db.sql
        kind = dense_type(m.dimension)
        weights = m.sparse == "lexical_weights"
        # lexical weights: a sparsevec; BM25: the document's length (Σ term counts) here, its
        # terms in a postings table of the version's own, read per query term like the local postings
        cur.execute(sql.SQL(
            "CREATE TABLE {t} (ext_id text PRIMARY KEY, label bigint NOT NULL UNIQUE, wseq bigint NOT NULL, "
            "text text NOT NULL, metadata jsonb NOT NULL, content_hash text NOT NULL, dense {kind}({dim}), "
            "lexical {lexical}, created_at double precision NOT NULL, updated_at double precision NOT NULL)").format(
                t=t, kind=sql.SQL(kind), dim=sql.Literal(int(m.dimension)),
                lexical=sql.SQL("sparsevec" if weights else "real")))
        cur.execute(sql.SQL("CREATE INDEX ON {t} (wseq)").format(t=t))
        cur.execute(sql.SQL("CREATE INDEX ON {t} USING gin (metadata jsonb_path_ops)").format(t=t))
        if not weights:
            lex = self.db.postings(vid)
            cur.execute(sql.SQL("CREATE TABLE {p} (token integer NOT NULL, label bigint NOT NULL, tf real NOT NULL, "
                                "PRIMARY KEY (token, label))").format(p=lex))
            cur.execute(sql.SQL("CREATE INDEX ON {p} (label)").format(p=lex))
        if ann:
            self._create_ann(cur, vid, m)
        return vid

    def _create_ann(self, cur, vid: int, m: Manifest) -> None:
        """The version's HNSW index (inner product), if its manifest asks for one."""
        dense = m.dense_config
        if dense.kind != "hnsw":
            return
        sql = self.db.sql
        cur.execute(sql.SQL("CREATE INDEX IF NOT EXISTS {name} ON {t} USING hnsw (dense {ops}) "
                            "WITH (m = {m}, ef_construction = {ef})").format(
            name=sql.Identifier(f"docs_{int(vid)}_hnsw"), t=self.db.table(vid),
            ops=sql.SQL(f"{dense_type(m.dimension)}_ip_ops"), m=sql.Literal(int(dense.hnsw_m)),
            ef=sql.Literal(int(dense.ef_construction))))

    def build_ann(self, name: str, version: str) -> None:
        """Build a version's HNSW index now (after a bulk load; no statement timeout: it takes as
        long as the table is large; `maintenance_work_mem` on the server sizes it)."""
        row = self._row(name, version)
        with self.db.transaction() as cur:
            cur.execute("SET LOCAL statement_timeout = 0")
            self._create_ann(cur, row.id, row.manifest)

    def delete(self, name: str) -> None:
        """Remove an index: its rows, tables and ledger, in one transaction."""
        self.db.ensure_schema()
        with self.db.transaction() as cur:
            cur.execute(self.sql("SELECT 1 FROM {indexes} WHERE name = %s FOR UPDATE"), (check_name(name),))
            if cur.fetchone() is None:
                raise NotFoundError(f"index {name!r} does not exist", param="name", code="index_not_found")
            cur.execute(self.sql("SELECT id FROM {versions} WHERE index_name = %s"), (name,))
            for (vid,) in cur.fetchall():
                self._drop_tables(cur, vid)
            cur.execute(self.sql("DELETE FROM {indexes} WHERE name = %s"), (name,))
            cur.execute(self.sql("DELETE FROM {ledger} WHERE index_name = %s"), (name,))
        logger.info("deleted index %s", name)

    def drop_version(self, cur, name: str, version: str) -> None:
        """Inside the caller's transaction: drop a (non-live) version's table and row."""
        cur.execute(self.sql("DELETE FROM {versions} WHERE index_name = %s AND version = %s RETURNING id"),
                    (name, version))
        row = cur.fetchone()
        if row is not None:
            self._drop_tables(cur, row[0])

    def _drop_tables(self, cur, vid: int) -> None:
        cur.execute(self.db.sql.SQL("DROP TABLE IF EXISTS {t}, {p}").format(t=self.db.table(vid),
                                                                          p=self.db.postings(vid)))

    # ------------------------------------------------------------- migrations
    def checkpoint(self, name: str, version: str) -> dict | None:
        rows = self._query("SELECT checkpoint FROM {versions} WHERE index_name = %s AND version = %s",
                           (name, version))
        return rows[0][0] if rows else None

    def save_checkpoint(self, name: str, version: str, checkpoint: dict, cur=None) -> None:
        q = self.sql("UPDATE {versions} SET checkpoint = %s::jsonb WHERE index_name = %s AND version = %s")
        params = (json.dumps(checkpoint), name, version)
        if cur is not None:
            cur.execute(q, params)
            return
        with self.db.transaction() as c:
            c.execute(q, params)

    def history(self, name: str) -> list[dict]:
        """The ledger: every swap that went live, oldest first."""
        check_name(name)
        self.current(name)
        return [r[0] for r in self._query("SELECT entry FROM {ledger} WHERE index_name = %s ORDER BY id", (name,))]

    def close(self) -> None:
        self.db.close()
