"""A version's documents read over a short connection of its own, by a process that holds no
pool (a Ray task reading one shard of a reindex)."""

from __future__ import annotations

import re

from ..docstore import Document
from .db import import_psycopg

_SOURCE = re.compile(r"^(?P<url>.+)#(?P<schema>[a-z_][a-z0-9_]{0,62})\.docs_(?P<id>[0-9]{1,18})$")


def read_documents(source: str, after: int, upto: int) -> list[tuple[int, Document]]:
    m = _SOURCE.match(source)
    if m is None:
        raise ValueError("not a PostgreSQL document source (url#schema.docs_<id>)")
    psycopg, _, _ = import_psycopg()
    from psycopg import sql
    table = sql.Identifier(m["schema"], f"docs_{int(m['id'])}")
    with psycopg.connect(m["url"], connect_timeout=10) as conn:
        rows = conn.execute(sql.SQL("SELECT wseq, ext_id, text, metadata FROM {} WHERE wseq > %s AND wseq <= %s "
                                    "ORDER BY wseq").format(table), (int(after), int(upto))).fetchall()
    return [(int(r[0]), Document(r[1], r[2], r[3])) for r in rows]
