"""The test PostgreSQL itself (tests/pg_testserver.py): the versions it brings, pgvector's HNSW index on inner
product, and a crash (SIGKILL) it comes back from with its committed data."""

from __future__ import annotations

import psycopg
import pytest


def test_the_server_is_postgres_18_with_pgvector_0_8_5(pg_server):
    with psycopg.connect(pg_server.url) as conn:
        assert conn.execute("SHOW server_version").fetchone()[0].startswith("18")
        ext = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
        assert ext == ("0.8.5",)
        assert conn.execute("SHOW fsync").fetchone() == ("on",)
        assert conn.execute("SELECT current_database()").fetchone() == ("embedserve",)


def test_hnsw_inner_product_finds_the_nearest(pg_url):
    rows = [(1, "[1,0,0]"), (2, "[0,1,0]"), (3, "[0,0,1]"), (4, "[0.6,0.8,0]"), (5, "[-1,0,0]")]
    with psycopg.connect(pg_url) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, v vector(3))")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO items VALUES (%s, %s)", rows)
        conn.execute("CREATE INDEX ON items USING hnsw (v vector_ip_ops)")
        conn.execute("SET enable_seqscan = off")                     # the index answers, not a scan
        query = "SELECT id, v <#> %s AS d FROM items ORDER BY v <#> %s LIMIT 2"
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + query, ("[0.5,0.9,0]",) * 2))
        assert "items_v_idx" in plan
        got = conn.execute(query, ("[0.5,0.9,0]",) * 2).fetchall()
    # <#> is the negative inner product: [0.6,0.8,0] scores 1.02, [0,1,0] 0.9
    assert [r[0] for r in got] == [4, 2]
    assert abs(got[0][1] + 1.02) < 1e-6


@pytest.mark.postgres
def test_killed_server_comes_back_with_its_committed_data(tmp_path):
    from pg_testserver import start_postgres

    srv = start_postgres(tmp_path)          # its own cluster: the session one stays up for the others
    try:
        with psycopg.connect(srv.url, autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (id int PRIMARY KEY, v vector(2))")
            conn.execute("INSERT INTO kept VALUES (1, '[1,2]'), (2, '[3,4]')")
            srv.kill()
            assert not srv.running()
            try:
                conn.execute("SELECT 1")
                raise AssertionError("a connection to a killed server still answered")
            except psycopg.OperationalError:
                pass
        srv.kill()                          # idempotent, and so is stop()
        srv.stop()
        srv.start()
        assert srv.running()
        with psycopg.connect(srv.url) as conn:
            assert conn.execute("SELECT id, v::text FROM kept ORDER BY id").fetchall() == [(1, "[1,2]"), (2, "[3,4]")]
        srv.restart()
        with psycopg.connect(srv.url) as conn:
            assert conn.execute("SELECT count(*) FROM kept").fetchone() == (2,)
    finally:
        srv.close()
    assert not srv.running()
