"""One index version in PostgreSQL: a row of `versions` (manifest, write sequence, retired
marker, a migration's checkpoint) and a table of documents of its own:

    ext_id text PK · label bigint UNIQUE (the write that made its vectors) · wseq bigint (its last
    write, text or metadata) · text · metadata jsonb · content_hash · dense vector(d) (halfvec(d)
    past 2,000 dimensions) · lexical: the model's lexical weights as a sparsevec, or — for models
    without a sparse head — the document's length in tokens, its term counts in a postings table
    `lex_<id>` (token, label, tf) for BM25 · created_at, updated_at

There is no in-memory state to replay: the table is the index (HNSW on `dense` with inner
product when the manifest asks for `hnsw`, exact scans for `flat`). A write locks the version's
row — which serializes the version's writers, orders their sequence numbers by commit, and
waits for a swap that is retiring the version — reads the manifest and checks the model's
identity in that same transaction; a search reads the manifest in the snapshot it searches.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np

from ..core import check_vectors, validate_documents
from ..docstore import Change, Document, Sparse, content_hash
from ..errors import ConflictError, NotFoundError, RetiredError, ValidationError
from ..manifest import Manifest, ModelIdentity
from ..search import Hit, Query
from .db import Database
from .vectors import SPARSE_DIM, dense_type

def _has_nul(value) -> bool:
    """Whether a string, or any key or string inside a JSON value, holds U+0000."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


@dataclass(slots=True)
class VersionRow:
    id: int
    index: str
    version: str
    manifest: Manifest


class PgIndex:
    """One version, open for reading and writing (thread-safe: every call is its own transaction)."""

    def __init__(self, db: Database, row: VersionRow, identity: ModelIdentity | None = None):
        self.db = db
        self.id = row.id
        self.manifest = row.manifest
        self.table = db.table(row.id)
        self.postings = db.postings(row.id)
        self.docs = PgDocs(self)
        self.backend = "postgres"
        if identity is not None:
            self.manifest.check(identity, "open")
        m = self.manifest
        self.halfvec = dense_type(m.dimension) == "halfvec"
        self.lexical_weights = m.sparse == "lexical_weights"

    @property
    def name(self) -> str:
        return self.manifest.index

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def key(self) -> int:
        """What tells this version apart from any other, ever (its row id)."""
        return self.id

    def sql(self, text: str):
        return self.db.sql.SQL(text).format(t=self.table, p=self.postings, versions=self.db.name("versions"))

    def dense_param(self, v):
        from pgvector import HalfVector
        v = np.asarray(v, dtype=np.float32)
        return HalfVector(v) if self.halfvec else v

    def _sparse_value(self, s: Sparse):
        """The `lexical` column of a document: its lexical weights, or (BM25) its length in tokens."""
        from pgvector import SparseVector
        ids, w = s
        if not self.lexical_weights:
            return float(np.asarray(w, dtype=np.float64).sum())
        order = np.argsort(np.asarray(ids, dtype=np.int64))
        return SparseVector({int(ids[j]): float(w[j]) for j in order}, SPARSE_DIM)

    # ----------------------------------------------------------------- writes
    def _lock_version(self, cur) -> tuple[int, Manifest]:
        """Inside a write transaction: lock this version's row (writers queue here, and a swap
        retiring it holds it), refuse a retired or deleted version, return (seq, manifest)."""
        cur.execute(self.sql("SELECT seq, manifest, retired_by FROM {versions} WHERE id = %s FOR UPDATE"),
                    (self.id,))
        row = cur.fetchone()
        if row is None:
            raise NotFoundError(f"index {self.name!r} version {self.version} was deleted; retry against the live "
                                "version", code="index_not_found")
        if row[2] is not None:
            raise RetiredError(f"this index version was replaced by {row[2]}; retry the write (it goes to the live "
                               "version)", code="version_retired")
        return int(row[0]), Manifest(**row[1])

    def pending(self, docs: list[Document]) -> list[bool]:
        """For each document: does it need (new) vectors? False when its text is already stored."""
        known = self.docs.hashes([d.id for d in docs])
        return [known.get(d.id, (None,))[0] != content_hash(d.text) for d in docs]

    def upsert(self, docs: list[Document], dense: list, sparse: list, identity: ModelIdentity) -> Change:
        """Insert or replace documents with the vectors `identity`'s model made for them, in one
        transaction (the manifest checked inside it)."""
        validate_documents(docs)
        if not len(docs) == len(dense) == len(sparse):
            raise ValidationError(f"{len(docs)} documents but {len(dense)} dense and {len(sparse)} sparse vectors")
        for i, d in enumerate(docs):
            if _has_nul(d.id) or _has_nul(d.text) or _has_nul(d.metadata):
                raise ValidationError(f"document {i} ({d.id!r}) holds a NUL character (U+0000), which PostgreSQL "
                                      "cannot store in text or JSON; remove it", param="documents", code="nul_character")
        now = time.time()
        with self.db.transaction() as cur:
            seq, manifest = self._lock_version(cur)
            manifest.check(identity, "write to")
            for i, (d, s) in enumerate(zip(dense, sparse)):
                if d is not None or s is not None:
                    check_vectors(manifest, i, d, s)
            cur.execute(self.sql("SELECT ext_id, label, content_hash, metadata, lexical FROM {t} WHERE ext_id = ANY(%s)"),
                        ([d.id for d in docs],))
            stored = {r[0]: r[1:] for r in cur.fetchall()}
            change = Change(base=seq, seq=seq)
            meta_rows, rows, postings = [], [], []
            n_delta, len_delta = 0, 0.0
            for doc, d, s in zip(docs, dense, sparse):
                old = stored.get(doc.id)
                if old is not None and old[1] == content_hash(doc.text):
                    if old[2] != doc.metadata:
                        seq += 1
                        meta_rows.append((json.dumps(doc.metadata, ensure_ascii=False), now, seq, doc.id))
                    change.outcomes[doc.id] = "metadata" if old[2] != doc.metadata else "unchanged"
                    continue
                if d is None and s is None:
                    raise ConflictError(f"document {doc.id!r} changed while it was being embedded; retry the upsert",
                                        param="documents", code="concurrent_change")
                seq += 1
                lexical = self._sparse_value(s)
                rows.append((doc.id, seq, seq, doc.text, json.dumps(doc.metadata, ensure_ascii=False),
                             content_hash(doc.text), self.dense_param(d), lexical, now, now))
                if not self.lexical_weights:
                    postings += [(int(t), seq, float(w)) for t, w in zip(s[0], s[1])]
                    n_delta += old is None
                    len_delta += lexical - (float(old[3] or 0.0) if old is not None else 0.0)
                if old is not None:
                    change.removed.append(int(old[0]))
                change.outcomes[doc.id] = "added" if old is None else "replaced"
                change.added.append((seq, None, None))
            if meta_rows:
                cur.executemany(self.sql("UPDATE {t} SET metadata = %s::jsonb, updated_at = %s, wseq = %s "
                                          "WHERE ext_id = %s"), meta_rows)
            if rows:
                cur.executemany(self.sql(
                    "INSERT INTO {t} (ext_id, label, wseq, text, metadata, content_hash, dense, lexical, created_at, "
                    "updated_at) VALUES (%s, %s, %s, %s, %s::jsonb, %s, %s, %s, %s, %s) "
                    "ON CONFLICT (ext_id) DO UPDATE SET label = EXCLUDED.label, wseq = EXCLUDED.wseq, "
                    "text = EXCLUDED.text, metadata = EXCLUDED.metadata, content_hash = EXCLUDED.content_hash, "
                    "dense = EXCLUDED.dense, lexical = EXCLUDED.lexical, updated_at = EXCLUDED.updated_at"), rows)
            if not self.lexical_weights:
                self._write_postings(cur, change.removed, postings)
            if seq != change.base:
                cur.execute(self.sql("UPDATE {versions} SET seq = %s, lex_n = lex_n + %s, lex_len = lex_len + %s "
                                      "WHERE id = %s"), (seq, n_delta, len_delta, self.id))
            change.seq = seq
        return change

    def _write_postings(self, cur, removed: list[int], rows: list[tuple[int, int, float]]) -> None:
        """BM25: drop the postings of replaced or deleted labels, add the new ones (COPY)."""
        if removed:
            cur.execute(self.sql("DELETE FROM {p} WHERE label = ANY(%s)"), (removed,))
        if rows:
            with cur.copy(self.sql("COPY {p} (token, label, tf) FROM STDIN")) as copy:
                for r in rows:
                    copy.write_row(r)

    def delete(self, ext_ids: list[str], identity: ModelIdentity | None = None) -> Change:
        """Delete documents; unknown ids are reported as `missing`."""
        ext_ids = list(dict.fromkeys(ext_ids))
        with self.db.transaction() as cur:
            seq, manifest = self._lock_version(cur)
            if identity is not None:
                manifest.check(identity, "write to")
            cur.execute(self.sql("DELETE FROM {t} WHERE ext_id = ANY(%s) RETURNING ext_id, label, lexical"),
                        (ext_ids,))
            gone = {r[0]: r[1:] for r in cur.fetchall()}
            change = Change(base=seq, seq=seq)
            for ext_id in ext_ids:
                if ext_id in gone:
                    seq += 1
                    change.removed.append(int(gone[ext_id][0]))
                    change.outcomes[ext_id] = "deleted"
                else:
                    change.outcomes[ext_id] = "missing"
            n_delta = len_delta = 0
            if not self.lexical_weights and gone:
                self._write_postings(cur, change.removed, [])
                n_delta = -len(gone)
                len_delta = -sum(float(v[1] or 0.0) for v in gone.values())
            if seq != change.base:
                cur.execute(self.sql("UPDATE {versions} SET seq = %s, lex_n = lex_n + %s, lex_len = lex_len + %s "
                                      "WHERE id = %s"), (seq, n_delta, len_delta, self.id))
            change.seq = seq
        return change

    # ----------------------------------------------------------------- search
    def search(self, query: Query, identity: ModelIdentity) -> list[Hit]:
        """Search with vectors `identity`'s model made for the query, in one snapshot (the
        manifest read and checked in it)."""
        from .search import dense_pipelined, run
        if query.mode == "dense":
            with self.db.transaction(read_only=True, snapshot=True) as cur:
                return dense_pipelined(self, cur, query, identity)
        with self.db.transaction(read_only=True, snapshot=True) as cur:
            cur.execute(self.sql("SELECT manifest FROM {versions} WHERE id = %s"), (self.id,))
            row = cur.fetchone()
            if row is None:
                raise NotFoundError(f"index {self.name!r} version {self.version} was deleted; retry",
                                    code="index_not_found")
            manifest = Manifest(**row[0])
            manifest.check(identity, "search")
            if query.dense is not None and np.asarray(query.dense).shape != (manifest.dimension,):
                raise ConflictError(f"dimension mismatch: the index has {manifest.dimension}, the query vector has "
                                    f"{np.asarray(query.dense).shape}", param="dimension")
            return run(self, cur, query)

    # ------------------------------------------------------------------ state
    def counts(self) -> dict[str, int]:
        return self.docs.counts()

    def verify(self, sample: int = 200, seed: int = 0):
        """`embedserve index verify` of this version (index.pg.verify)."""
        from .verify import verify
        return verify(self, sample, seed)

    def describe(self) -> dict:
        """The manifest with live counts (what `GET /v1/indexes/{name}` returns)."""
        with self.db.transaction(read_only=True, snapshot=True) as cur:
            cur.execute(self.sql("SELECT seq FROM {versions} WHERE id = %s"), (self.id,))
            row = cur.fetchone()
            if row is None:
                raise NotFoundError(f"index {self.name!r} version {self.version} was deleted", code="index_not_found")
            counts = self.docs.counts(cur)
        info = json.loads(self.manifest.to_json())
        info.update(counts=counts, live_counts=counts, snapshot_counts=counts, sequence=int(row[0]), stale_dense=0,
                    backend="postgres")
        return info

    def snapshot(self) -> bool:
        return False                                 # every write is durable where it is committed

    def close(self, snapshot: bool = True) -> None:
        pass                                         # nothing held: the pool belongs to the store

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class PgDocs:
    """The reads a migration, the gate and `verify` make of a version's documents (the local
    doc store's names, so they run on either backend)."""

    def __init__(self, ix: PgIndex):
        self.ix = ix
        self.db = ix.db

    @property
    def source(self) -> str:
        """Where a worker process reads this version's documents (`index.backend.read_documents`)."""
        return f"{self.db.url}#{self.db.schema}.docs_{self.ix.id}"

    def _all(self, text: str, params=()) -> list[tuple]:
        return self.db.fetch(self.ix.sql(text), params)

    def seq(self) -> int:
        rows = self._all("SELECT seq FROM {versions} WHERE id = %s", (self.ix.id,))
        return int(rows[0][0]) if rows else 0

    def counts(self, cur=None) -> dict[str, int]:
        q = "SELECT count(*), count(dense), count(lexical) FROM {t}"
        if cur is not None:
            cur.execute(self.ix.sql(q))
            n, d, s = cur.fetchone()
        else:
            n, d, s = self._all(q)[0]
        return {"documents": int(n), "dense": int(d), "sparse": int(s)}

    def hashes(self, ext_ids: list[str]) -> dict[str, tuple[str, str]]:
        rows = self._all("SELECT ext_id, content_hash, metadata FROM {t} WHERE ext_id = ANY(%s)", (list(ext_ids),))
        return {r[0]: (r[1], json.dumps(r[2], ensure_ascii=False, sort_keys=True)) for r in rows}   # as the local one

    def ids(self) -> set[str]:
        return {r[0] for r in self._all("SELECT ext_id FROM {t}")}

    def live_labels(self) -> np.ndarray:
        return np.array([r[0] for r in self._all("SELECT label FROM {t}")], dtype=np.int64)

    def fetch(self, labels) -> dict[int, tuple[str, str, dict]]:
        rows = self._all("SELECT label, ext_id, text, metadata FROM {t} WHERE label = ANY(%s)",
                         ([int(x) for x in labels],))
        return {int(r[0]): (r[1], r[2], r[3]) for r in rows}

    def documents_after(self, seq: int, limit: int = 1024) -> list[tuple[int, Document]]:
        rows = self._all("SELECT wseq, ext_id, text, metadata FROM {t} WHERE wseq > %s ORDER BY wseq LIMIT %s",
                         (int(seq), int(limit)))
        return [(int(r[0]), Document(r[1], r[2], r[3])) for r in rows]

    def writes_after(self, seq: int) -> np.ndarray:
        rows = self._all("SELECT wseq FROM {t} WHERE wseq > %s ORDER BY wseq", (int(seq),))
        return np.array([r[0] for r in rows], dtype=np.int64)

    def iter_docs(self, batch: int = 1024):
        """(label, ext_id, text, content_hash, dense, sparse) of every document, in batches;
        `sparse` is None for BM25 indexes (their terms are in the postings table)."""
        last = -1
        while True:
            rows = self._all("SELECT label, ext_id, text, content_hash, dense::real[], "
                             + ("lexical" if self.ix.lexical_weights else "NULL")
                             + " FROM {t} WHERE label > %s ORDER BY label LIMIT %s", (last, batch))
            if not rows:
                return
            out = []
            for r in rows:
                s = None
                if r[5] is not None:
                    s = (np.array(r[5].indices(), dtype=np.int64), np.array(r[5].values(), dtype=np.float32))
                out.append((int(r[0]), r[1], r[2], r[3], None if r[4] is None else np.array(r[4], np.float32), s))
            yield out
            last = rows[-1][0]
