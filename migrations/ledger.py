"""The index's migration ledger: one JSON line per completed migration or rollback, written
only once it has fully succeeded ("a row in the table always means it was applied")."""

from __future__ import annotations

import json
from pathlib import Path

from index.durable import atomic_write

LEDGER = "ledger.jsonl"


def history(index_dir: Path) -> list[dict]:
    """Every entry, oldest first."""
    path = Path(index_dir) / LEDGER
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def append(index_dir: Path, entry: dict) -> None:
    """Add `entry` atomically (the whole file is rewritten under a temp name and renamed)."""
    lines = [json.dumps(e, ensure_ascii=False, sort_keys=True) for e in history(index_dir) + [entry]]
    atomic_write(Path(index_dir) / LEDGER, ("\n".join(lines) + "\n").encode("utf-8"))
