"""HTTP layer (FastAPI): schemas and errors in, engine calls out."""
