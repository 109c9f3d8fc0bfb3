"""Root logging for the long-running commands (serve, reindex)."""

from __future__ import annotations

import logging

# third-party loggers whose INFO lines read as trouble to an operator: faiss's loader logs
# "Could not load library with AVX2 support ... No module named 'faiss.swigfaiss_avx2'" at every
# start where the wheel ships one library for every CPU (faiss-cpu 1.15), then loads that one
QUIET_LOGGERS = ("faiss.loader",)


def setup_logging(level: str | int) -> None:
    """Root logging for the long-running commands (serve, reindex); the quiet loggers keep their
    warnings and say more only at DEBUG."""
    lvl = level if isinstance(level, int) else getattr(logging, str(level).upper(), logging.INFO)
    logging.basicConfig(level=lvl, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if lvl <= logging.DEBUG else logging.WARNING)
