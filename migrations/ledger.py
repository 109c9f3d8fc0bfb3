"""The index's migration ledger: one JSON line per migration or rollback that went live
("a row in the table always means it was applied", and every swap of `CURRENT` has its row).

A swap is recorded in two steps around the move of `CURRENT`, so that a kill at any instant
leaves a ledger that can be completed from the files on disk:

    begin(entry)      the whole entry, status "swapping"      (before any marker or CURRENT moves)
    CURRENT moves     the one atomic rename that makes the swap happen
    complete(entry)   status "applied"

`recover` settles an entry left "swapping" by a killed process: `CURRENT` names its version →
applied; otherwise the swap never happened → the entry is dropped and the `RETIRED` markers
the swap had begun to move are put back. `history` does that first (unless a migration is
running), then returns the applied entries only.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from index.core import TEMP_LOCK
from index.docstore import RETIRED
from index.durable import atomic_write, file_lock
from index.store import CURRENT

from .errors import MigrationError
from .lock import migration_lock

logger = logging.getLogger(__name__)

LEDGER = "ledger.jsonl"
SWAPPING, APPLIED = "swapping", "applied"


def history(index_dir: Path, *, resolve: bool = True) -> list[dict]:
    """The applied entries, oldest first. With `resolve`, an entry a killed migration left
    unfinished is first completed or dropped (see `recover`), unless a migration holds the
    index's lock now (its entry is then still in flight and not shown)."""
    index_dir = Path(index_dir)
    if resolve and any(e.get("status") == SWAPPING for e in _read(index_dir)):
        try:
            with migration_lock(index_dir, index_dir.name):
                recover(index_dir)
        except MigrationError as exc:
            if exc.code != "migration_running":
                raise
    return [e for e in _read(index_dir) if e.get("status", APPLIED) == APPLIED]


def begin(index_dir: Path, entry: dict) -> dict:
    """Record `entry` as "swapping", before `CURRENT` moves; returns the entry as written.
    The caller holds the migration lock."""
    entry = {**entry, "status": SWAPPING}
    _write(index_dir, _read(index_dir) + [entry])
    return entry


def complete(index_dir: Path, entry: dict) -> dict:
    """Mark `entry` (as `begin` returned it) applied, once `CURRENT` has moved; returns it."""
    done = {**entry, "status": APPLIED}
    entries = _read(index_dir)
    key = (entry["kind"], entry["parent"], entry["version"])
    # the migration lock is held from `begin` on, and `recover` ran before it: this is the one
    # unfinished entry
    i = next(i for i in range(len(entries) - 1, -1, -1)
             if entries[i].get("status") == SWAPPING and (entries[i]["kind"], entries[i]["parent"],
                                                           entries[i]["version"]) == key)
    entries[i] = done
    _write(index_dir, entries)
    return done


def recover(index_dir: Path) -> int:
    """Settle every "swapping" entry from the state on disk (the caller holds the migration
    lock): applied if `CURRENT` names its version; else dropped, with the live version's
    `RETIRED` marker removed and a rollback's target retired again, as before the swap began.
    Returns how many entries it settled."""
    index_dir = Path(index_dir)
    entries = _read(index_dir)
    if not any(e.get("status") == SWAPPING for e in entries):
        return 0
    current = (index_dir / CURRENT).read_text().strip()
    kept, settled = [], 0
    for e in entries:
        if e.get("status") != SWAPPING:
            kept.append(e)
            continue
        settled += 1
        if e["version"] == current:
            logger.warning("index %s: the %s to %s went live but its process died before recording it; "
                           "recorded now", index_dir.name, e["kind"], e["version"])
            kept.append({**e, "status": APPLIED})
        else:
            logger.warning("index %s: a %s to %s was stopped before it went live (%s is live); dropped "
                           "from the ledger", index_dir.name, e["kind"], e["version"], current)
            _restore_markers(index_dir, e, current)
    _write(index_dir, kept)
    return settled


def _restore_markers(index_dir: Path, entry: dict, current: str) -> None:
    """Undo what a swap that never happened did to the `RETIRED` markers: the live version takes
    writes again; a rollback's target (out of service before it began) is retired again."""
    if current != entry["parent"]:
        logger.warning("index %s: %s is live, neither side of the unfinished %s (%s -> %s); markers left as "
                       "they are", index_dir.name, current, entry["kind"], entry["parent"], entry["version"])
        return
    live_marker = index_dir / current / RETIRED
    try:
        if live_marker.read_text().strip() == entry["version"]:
            live_marker.unlink()
    except FileNotFoundError:
        pass
    target = index_dir / entry["version"]
    if entry["kind"] == "rollback" and target.is_dir() and not (target / RETIRED).exists():
        with file_lock(target / TEMP_LOCK):          # a temp file there: hold its temp lock
            atomic_write(target / RETIRED, f"{current}\n".encode())


def _read(index_dir: Path) -> list[dict]:
    """Every entry, whatever its status (entries written before statuses existed were applied)."""
    path = Path(index_dir) / LEDGER
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _write(index_dir: Path, entries: list[dict]) -> None:
    """Replace the ledger atomically (the whole file under a temp name, renamed)."""
    lines = [json.dumps(e, ensure_ascii=False, sort_keys=True) for e in entries]
    atomic_write(Path(index_dir) / LEDGER, ("\n".join(lines) + "\n").encode("utf-8") if lines else b"")


def last_migration(history: list[dict], name: str, live: str) -> dict:
    """The applied reindex that made `live` live (from the ledger's `history`)."""
    last = next((e for e in reversed(history) if e.get("version") == live and e.get("kind") == "reindex"), None)
    if last is None:
        raise MigrationError(f"index {name!r}: no migration produced the live version {live}; nothing to "
                             "roll back", code="nothing_to_roll_back")
    return last


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def reindex_entry(name, old_manifest, live, version, embedder, ck, report, t0: float, engine) -> dict:
    """The ledger entry of a reindex into `version` (either backend's), before its status."""
    seconds = max(time.time() - t0, 1e-9)
    before, after = old_manifest.prompt_texts(), embedder.identity.prompt_texts()
    changed = {k: {"from": before.get(k), "to": after.get(k)} for k in sorted(set(before) | set(after))
               if before.get(k) != after.get(k)}
    return {"kind": "reindex", "index": name, "parent": live, "version": version, "prompts_changed": changed,
            "from_model": old_manifest.model, "from_fingerprint": old_manifest.fingerprint,
            "to_model": embedder.identity.model, "to_fingerprint": embedder.identity.fingerprint,
            "documents": report.documents, "embedded": ck.embedded, "gate": report.to_dict(),
            "swap_seq": ck.swap_seq, "started_at": iso(ck.started_at), "finished_at": iso(time.time()),
            "docs_per_s": round(ck.embedded / seconds, 1), "engine": "ray" if engine is not None else "in-process"}


def rollback_entry(name: str, live: str, last: dict, carried: int, t0: float) -> dict:
    """The ledger entry of a rollback of `live` to the parent of `last` (the migration it undoes)."""
    return {"kind": "rollback", "index": name, "parent": live, "version": last["parent"],
            "from_model": last["to_model"], "to_model": last["from_model"], "carried": carried,
            "finished_at": iso(time.time()), "seconds": round(time.time() - t0, 4)}
