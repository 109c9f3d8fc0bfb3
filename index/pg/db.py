"""The connection to PostgreSQL: a psycopg 3 pool, pgvector's adapter on every connection,
statement and lock timeouts, the schema embedserve keeps its tables in, and one translation of
database failures into the index library's errors.

    database unreachable, restarting, a connection lost      BackendUnavailableError (HTTP 503, Retry-After)
    a statement or lock wait past its timeout                 BackendUnavailableError (retryable)
    a version's table dropped under a request (prune/delete)  NotFoundError

Nothing here formats an identifier into SQL: the schema name and the per-version table names
(generated from a version's numeric id, never from input) go through `psycopg.sql.Identifier`.
This module is imported only when an index URL names PostgreSQL (`index.backend.open_store`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from ..errors import BackendBusyError, BackendUnavailableError, ConflictError, NotFoundError, ValidationError

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'embedserve[postgres]'"
SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
SCHEMA_VERSION = "1"
# How long a request waits for a pooled connection before it is a 503: short, so a database that
# is gone answers at once instead of piling requests up behind the pool.
POOL_WAIT_S = 3.0
CONNECT_TIMEOUT_S = 3
STATEMENT_TIMEOUT_MS = 30_000
LOCK_TIMEOUT_MS = 10_000
RETRY_AFTER_S = 2


def import_psycopg():
    """psycopg, psycopg_pool and pgvector's adapter, or a clear error naming the extra."""
    try:
        import psycopg
        import psycopg_pool
        from pgvector.psycopg import register_vector
    except ImportError as exc:
        raise ValidationError(f"a PostgreSQL index URL needs psycopg 3, psycopg_pool and pgvector, which are not "
                              f"installed ({exc}); install them with {INSTALL_HINT}", param="index_url",
                              code="postgres_missing") from None
    return psycopg, psycopg_pool, register_vector


def redact(url: str) -> str:
    """The URL without its password (for logs and `plan`)."""
    return re.sub(r"(postgres(?:ql)?://[^:/@]*:)[^@]*@", r"\1***@", url)


def check_schema(schema: str) -> str:
    if not isinstance(schema, str) or not SCHEMA_RE.fullmatch(schema):
        raise ValidationError(f"index schema {schema!r}: use 1-63 lower-case letters, digits or '_', not starting "
                              "with a digit", param="index_schema", code="invalid_schema")
    return schema


DDL = """
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.meta (key text PRIMARY KEY, value text NOT NULL);
CREATE TABLE IF NOT EXISTS {schema}.indexes (
    name text PRIMARY KEY,
    live_version text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS {schema}.versions (
    id bigserial UNIQUE,
    index_name text NOT NULL REFERENCES {schema}.indexes (name) ON DELETE CASCADE,
    version text NOT NULL,
    manifest jsonb NOT NULL,
    seq bigint NOT NULL DEFAULT 0,
    lex_n bigint NOT NULL DEFAULT 0,
    lex_len double precision NOT NULL DEFAULT 0,
    retired_by text,
    checkpoint jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (index_name, version));
CREATE TABLE IF NOT EXISTS {schema}.ledger (
    id bigserial PRIMARY KEY,
    index_name text NOT NULL,
    entry jsonb NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now());
CREATE INDEX IF NOT EXISTS ledger_index_name ON {schema}.ledger (index_name, id);
"""


class Database:
    """A pool of connections to one database, embedserve's tables in `schema`."""

    def __init__(self, url: str, *, schema: str = "embedserve", max_size: int = 16):
        self.psycopg, pool_mod, self._register_vector = import_psycopg()
        from psycopg import sql

        self.sql = sql
        self.url = url
        self.schema = check_schema(schema)
        self.ident = sql.Identifier(self.schema)
        options = f"-c statement_timeout={STATEMENT_TIMEOUT_MS} -c lock_timeout={LOCK_TIMEOUT_MS}"
        self.pool = pool_mod.ConnectionPool(
            url, min_size=1, max_size=max_size, timeout=POOL_WAIT_S, open=False, name="embedserve-index",
            kwargs={"options": options, "connect_timeout": CONNECT_TIMEOUT_S, "application_name": "embedserve"},
            configure=self._configure, reconnect_timeout=24 * 3600.0)
        # No check on every checkout (a round trip per request): a connection found broken is
        # dropped when it is returned, and the first failure sweeps the idle ones (`_sweep`).
        self._ready = False
        self._init_lock = threading.Lock()
        self._swept = 0.0
        self.pool.open(wait=False)

    # -------------------------------------------------------------- connections
    def _configure(self, conn) -> None:
        try:
            self._register_vector(conn)
        except self.psycopg.ProgrammingError:
            # the extension is not in this database yet: create it (needs the database owner's rights)
            conn.rollback()
            try:
                with conn.cursor() as cur:
                    cur.execute("CREATE EXTENSION IF NOT EXISTS vector")
                conn.commit()
            except self.psycopg.Error as exc:
                conn.rollback()
                logger.error("the pgvector extension is not installed in this database and this role cannot create "
                             "it (%s): run CREATE EXTENSION vector as the database owner", str(exc).strip())
                raise
            self._register_vector(conn)
        conn.commit()

    def ensure_schema(self) -> None:
        """Create the extension, schema and tables if they are not there (once per process;
        concurrent processes serialize on an advisory lock)."""
        if self._ready:
            return
        with self._init_lock:
            if self._ready:
                return
            have = self._layout()           # there already: no DDL (a read-only standby can serve searches)
            if have is None:
                with self.transaction() as cur:
                    cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"embedserve:schema:{self.schema}",))
                    cur.execute(self.sql.SQL(DDL).format(schema=self.ident))
                    cur.execute(self.sql.SQL("INSERT INTO {}.meta VALUES ('schema_version', %s) ON CONFLICT (key) "
                                             "DO NOTHING").format(self.ident), (SCHEMA_VERSION,))
                have = self._layout()
            if have != SCHEMA_VERSION:
                raise ConflictError(f"schema {self.schema!r} holds embedserve tables of layout {have}; this release "
                                    f"uses layout {SCHEMA_VERSION}: use a matching release or another --index-schema",
                                    param="index_schema", code="schema_mismatch")
            self._ready = True

    def _layout(self) -> str | None:
        """The layout version of embedserve's tables in the schema, None if they are not there."""
        with self.errors(), self.pool.connection() as conn:
            exists = conn.execute("SELECT to_regclass(%s)", (f"{self.schema}.meta",)).fetchone()[0]
            if exists is None:
                return None
            row = conn.execute(self.sql.SQL("SELECT value FROM {}.meta WHERE key = 'schema_version'")
                               .format(self.ident)).fetchone()
            return row[0] if row else None

    @contextmanager
    def transaction(self, *, read_only: bool = False, snapshot: bool = False) -> Iterator:
        """A cursor inside one transaction on a pooled connection, committed on success.
        `snapshot`: REPEATABLE READ, so every statement sees one committed state."""
        with self.errors():
            with self.pool.connection() as conn:
                if snapshot or read_only:
                    conn.isolation_level = (self.psycopg.IsolationLevel.REPEATABLE_READ if snapshot
                                            else self.psycopg.IsolationLevel.READ_COMMITTED)
                    conn.read_only = read_only
                try:
                    with conn.transaction(), conn.cursor() as cur:
                        yield cur
                finally:
                    if snapshot or read_only:
                        if not conn.closed and conn.info.transaction_status == 0:   # idle: reset for the pool
                            conn.isolation_level, conn.read_only = None, None

    def fetch(self, query, params=()) -> list[tuple]:
        """The rows of one read-only statement, outside a transaction block (autocommit: one
        round trip; it is its own snapshot)."""
        with self.errors(), self.pool.connection() as conn:
            conn.autocommit = True
            try:
                return conn.execute(query, params).fetchall()
            finally:
                if not conn.closed:
                    conn.autocommit = False

    def _sweep(self) -> None:
        """After a connection failed: test the idle ones in the background (at most once a
        second), so connections to a database that restarted are replaced before requests meet them."""
        now = time.monotonic()
        if now - self._swept < 1.0:
            return
        self._swept = now
        threading.Thread(target=self._check_quietly, name="embedserve-pool-check", daemon=True).start()

    def _check_quietly(self) -> None:
        try:
            self.pool.check()
        except Exception:                        # the pool closing under us, the database still gone
            logger.debug("pool check failed", exc_info=True)

    @contextmanager
    def session(self) -> Iterator:
        """A connection of its own for the whole block (advisory locks, long transactions)."""
        with self.errors():
            with self.pool.connection() as conn:
                yield conn

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Database failures as the index library's errors (see the module's table)."""
        psycopg = self.psycopg
        from psycopg_pool import PoolTimeout
        try:
            yield
        except PoolTimeout:
            stats = self.pool.get_stats()
            if stats.get("pool_size", 0) >= self.pool.max_size and not stats.get("pool_available", 0):
                raise BackendBusyError(f"all {self.pool.max_size} connections to the index database are busy; retry "
                                       "shortly, or raise --index-pool-size", retry_after=1) from None
            raise BackendUnavailableError(
                f"the index database is unreachable (no connection within {POOL_WAIT_S:g} s); retry shortly",
                retry_after=RETRY_AFTER_S) from None
        except psycopg.errors.ReadOnlySqlTransaction:
            raise BackendUnavailableError("the index database is a read-only standby: this server can search, but "
                                          "writes, index changes and migrations go to a server whose --index-url "
                                          "is the primary", retry_after=RETRY_AFTER_S, code="index_read_only") from None
        except psycopg.errors.DataError as exc:        # a value PostgreSQL cannot hold (checked earlier where known)
            raise ValidationError(f"the index database refused a value of this request: "
                                  f"{str(exc).strip().splitlines()[0]}", code="invalid_value") from None
        except psycopg.errors.UndefinedTable:
            raise NotFoundError("this index version was deleted while the request used it; retry (it goes to "
                                "the live version)", code="index_not_found") from None
        except (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable) as exc:
            raise BackendUnavailableError(f"the index database timed out ({type(exc).__name__}); retry shortly",
                                          retry_after=RETRY_AFTER_S) from None
        except (psycopg.OperationalError, psycopg.errors.AdminShutdown, psycopg.errors.CannotConnectNow) as exc:
            self._sweep()
            logger.warning("index database unavailable: %s", str(exc).strip().splitlines()[0] if str(exc) else exc)
            raise BackendUnavailableError("the index database is unavailable (connection lost or refused); retry "
                                          "shortly", retry_after=RETRY_AFTER_S) from None

    def table(self, version_id: int):
        """The identifier of a version's document table (named by its numeric id, never by input)."""
        return self.sql.Identifier(self.schema, f"docs_{int(version_id)}")

    def postings(self, version_id: int):
        """The identifier of a BM25 version's postings table (token, label, tf)."""
        return self.sql.Identifier(self.schema, f"lex_{int(version_id)}")

    def name(self, table: str):
        """One of embedserve's own tables (a fixed name) in the schema."""
        assert table in ("meta", "indexes", "versions", "ledger"), table
        return self.sql.Identifier(self.schema, table)

    def close(self) -> None:
        self.pool.close()
