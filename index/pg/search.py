"""Search of one version in PostgreSQL: dense | sparse | hybrid with a metadata filter, in the
caller's snapshot (one REPEATABLE READ transaction).

    dense    ORDER BY dense <#> q (negative inner product: vectors are unit length, so this is
             cosine) — pgvector's HNSW when the manifest says `hnsw` (`hnsw.ef_search` from the
             manifest, at least top_k; iterative scans when filtered, so a filter never starves
             the result), an exact scan for `flat`
    sparse   lexical_weights: sparsevec inner product, exact (pgvector's HNSW on sparsevec
             stops at 1,000 non-zeros, more than a long document's weights); no sparse head:
             Okapi BM25 (k1 1.2, b 0.75) over the model's tokens, the local backend's formula,
             computed in SQL from the version's postings table (the query's terms only), document
             frequencies counted there and N, the average length kept in the version's row
    hybrid   the top candidates of each side, both sides' exact scores for every candidate, then
             the same fusion as the local backend (`index.search.fuse`)

Filters are jsonb containment (`metadata @> {"key": value}`, a GIN index), OR-ed within a key;
null matches a missing key or a JSON null, as in the local backend. Keys and values travel as
parameters: nothing of a query is formatted into SQL.
"""

from __future__ import annotations

import json

import numpy as np

from ..docstore import filter_terms
from ..search import Hit, Query, fuse
from ..sparse import B, K1
from .vectors import SPARSE_DIM


def _where(flt: dict | None) -> tuple[str, list]:
    """The filter as a SQL condition over `metadata`, and its parameters."""
    if not flt:
        return "TRUE", []
    clauses, params = [], []
    for key, values in filter_terms(flt):
        parts = []
        for v in values:
            if v is None:
                parts.append("(NOT metadata ? %s OR metadata -> %s = 'null'::jsonb)")
                params += [key, key]
            else:
                parts.append("metadata @> %s::jsonb")
                params.append(json.dumps({key: v}))
        clauses.append("(" + " OR ".join(parts) + ")")
    return " AND ".join(clauses), params


def _q_dense(ix, q: np.ndarray):
    return ix.dense_param(np.asarray(q, dtype=np.float32))


def _q_sparse(ix, cur, s):
    """The query's sparse side as SQL parameters: a sparsevec (lexical weights), or for BM25
    the query terms with their weights and idf (from this snapshot's document frequencies)."""
    from pgvector import SparseVector
    ids, w = s
    if ix.lexical_weights:
        return SparseVector({int(i): float(x) for i, x in zip(ids, w)}, SPARSE_DIM)
    ids = [int(i) for i in ids]
    if not ids:
        return None
    cur.execute(ix.sql("SELECT lex_n, lex_len FROM {versions} WHERE id = %s"), (ix.id,))
    n, total = cur.fetchone()
    cur.execute(ix.sql("SELECT token, count(*) FROM {p} WHERE token = ANY(%s) GROUP BY token"), (ids,))
    df = dict(cur.fetchall())
    idf = [float(np.log1p((n - df.get(t, 0) + 0.5) / (df.get(t, 0) + 0.5))) for t in ids]
    return ids, [float(x) for x in w], idf, float(total) / max(int(n), 1)


_BM25 = ("SELECT p.label, sum(q.w * q.idf * p.tf * {k1p} / (p.tf + {k1} * (1 - {b} + {b} * d.lexical / %s))) AS s "
         "FROM {{p}} p JOIN unnest(%s::int[], %s::float8[], %s::float8[]) AS q(token, w, idf) ON p.token = q.token "
         "JOIN {{t}} d ON d.label = p.label WHERE ").format(k1p=K1 + 1, k1=K1, b=B)


def _bm25_params(qs) -> list:
    ids, w, idf, avgdl = qs
    return [max(avgdl, 1e-9), ids, w, idf]


def _dense_top(ix, cur, q, k: int, where: str, params: list) -> list[tuple[int, float]]:
    m = ix.manifest
    if m.dense_index.get("kind") == "hnsw":
        cur.execute("SELECT set_config('hnsw.ef_search', %s, true)",
                    (str(min(1000, max(int(m.dense_index.get("ef_search", 40)), k))),))
        if where != "TRUE":
            cur.execute("SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true)")
    cur.execute(ix.sql("SELECT label, -(dense <#> %s) AS s FROM {t} WHERE dense IS NOT NULL AND "
                        + where + " ORDER BY dense <#> %s LIMIT %s"), [q, *params, q, k])
    rows = [(int(r[0]), float(r[1])) for r in cur.fetchall()]
    return sorted(rows, key=lambda r: (-r[1], r[0]))       # relaxed order: exact order of what came back


def _sparse_top(ix, cur, q, k: int, where: str, params: list) -> list[tuple[int, float]]:
    if ix.lexical_weights:
        cur.execute(ix.sql("SELECT label, s FROM (SELECT label, -(lexical <#> %s) AS s FROM {t} WHERE lexical IS NOT "
                            "NULL AND " + where + ") c WHERE s > 0 ORDER BY s DESC, label LIMIT %s"), [q, *params, k])
    else:
        cur.execute(ix.sql(_BM25 + where + " GROUP BY p.label ORDER BY s DESC, p.label LIMIT %s"),
                    [*_bm25_params(q), *params, k])
    return [(int(r[0]), float(r[1])) for r in cur.fetchall() if float(r[1]) > 0]


def _exact(ix, cur, labels: list[int], qd, qs) -> tuple[dict, dict]:
    """Both sides' exact scores of `labels` (the sparse side only where it is positive)."""
    cur.execute(ix.sql("SELECT label, -(dense <#> %s)" + (", -(lexical <#> %s)" if ix.lexical_weights else "")
                        + " FROM {t} WHERE label = ANY(%s)"), [qd, qs, labels] if ix.lexical_weights else [qd, labels])
    rows = cur.fetchall()
    d = {int(r[0]): float(r[1]) for r in rows if r[1] is not None}
    if ix.lexical_weights:
        s = {int(r[0]): float(r[2]) for r in rows if r[2] is not None and float(r[2]) > 0}
    else:
        cur.execute(ix.sql(_BM25 + "p.label = ANY(%s) GROUP BY p.label"), [*_bm25_params(qs), labels])
        s = {int(r[0]): float(r[1]) for r in cur.fetchall() if float(r[1]) > 0}
    return d, s


def dense_pipelined(ix, cur, query: Query, identity) -> list[Hit]:
    """A dense search in one round trip (pipeline mode): the manifest, the HNSW settings and the
    search with its documents, sent together in the caller's snapshot; the manifest is checked
    before any hit is returned."""
    from ..manifest import Manifest
    conn, m = cur.connection, ix.manifest
    if np.asarray(query.dense).shape != (m.dimension,):          # before the database sees it
        from ..errors import ConflictError
        raise ConflictError(f"dimension mismatch: the index has {m.dimension}, the query vector has "
                            f"{np.asarray(query.dense).shape}", param="dimension")
    where, params = _where(query.filter)
    q = ix.dense_param(np.asarray(query.dense, dtype=np.float32))
    with conn.pipeline():
        cur.execute(ix.sql("SELECT manifest FROM {versions} WHERE id = %s"), (ix.id,))
        if m.dense_index.get("kind") == "hnsw":
            conn.execute("SELECT set_config('hnsw.ef_search', %s, true), set_config('hnsw.iterative_scan', %s, true)",
                         (str(min(1000, max(int(m.dense_index.get("ef_search", 40)), query.top_k))),
                          "relaxed_order" if where != "TRUE" else "off"))
        hits = conn.cursor()
        hits.execute(ix.sql("SELECT label, -(dense <#> %s), ext_id, text, metadata FROM {t} WHERE dense IS NOT NULL AND "
                            + where + " ORDER BY dense <#> %s LIMIT %s"), [q, *params, q, query.top_k])
    row = cur.fetchone()
    if row is None:
        from ..errors import NotFoundError
        raise NotFoundError(f"index {ix.name!r} version {ix.version} was deleted; retry", code="index_not_found")
    manifest = Manifest(**row[0])
    manifest.check(identity, "search")
    rows = sorted(hits.fetchall(), key=lambda r: (-float(r[1]), int(r[0])))   # relaxed order: exact order
    return [Hit(r[2], float(r[1]), r[3], r[4], {"dense": float(r[1])}, int(r[0])) for r in rows]


def run(ix, cur, query: Query) -> list[Hit]:
    """Execute `query` in the caller's transaction (the manifest is checked)."""
    where, params = _where(query.filter)
    k = query.top_k
    qd = _q_dense(ix, query.dense) if query.dense is not None else None
    qs = _q_sparse(ix, cur, query.sparse) if query.sparse is not None else None
    if query.mode == "dense":
        ranked = [(lab, s, {"dense": s}) for lab, s in _dense_top(ix, cur, qd, k, where, params)]
    elif query.mode == "sparse":
        ranked = [] if qs is None else [(lab, s, {"sparse": s}) for lab, s in _sparse_top(ix, cur, qs, k, where, params)]
    else:
        n = max(4 * k, 50)
        d_top = _dense_top(ix, cur, qd, n, where, params)
        s_top = [] if qs is None else _sparse_top(ix, cur, qs, n, where, params)
        cands = list(dict.fromkeys([lab for lab, _ in d_top] + [lab for lab, _ in s_top]))
        if qs is None:
            d_score, s_score = dict(d_top), {}
        else:
            d_score, s_score = _exact(ix, cur, cands, qd, qs)
        s_max = max((s for _, s in s_top), default=0.0)
        ranked = fuse(query, ix.manifest.sparse, d_top, s_top, d_score, s_score, s_max)
    if not ranked:
        return []
    cur.execute(ix.sql("SELECT label, ext_id, text, metadata FROM {t} WHERE label = ANY(%s)"),
                ([lab for lab, _, _ in ranked],))
    found = {int(r[0]): r[1:] for r in cur.fetchall()}
    return [Hit(found[lab][0], float(score), found[lab][1], found[lab][2],
                {k_: float(v) for k_, v in parts.items()}, lab)
            for lab, score, parts in ranked if lab in found]
