"""The PostgreSQL + pgvector backend (`--index-url postgresql://…`): `PgStore`, `PgIndex`.
Needs the `postgres` extra (psycopg 3, psycopg_pool, pgvector); nothing imports this package
unless an index URL names PostgreSQL."""
