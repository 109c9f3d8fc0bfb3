"""Vector index: FAISS dense + sparse postings + SQLite doc store, guarded by a manifest."""
