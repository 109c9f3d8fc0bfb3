"""A full volume under the index: out of space is a typed error (507 over HTTP) that names the
volume, nothing of the refused write is applied (SQLite rolled back, no half-written snapshot,
no temp file left), the connection takes the next write as soon as there is room, `/ready` and
`/metrics` say so while it lasts, and every acknowledged document survives a restart.

The small volume is a real tmpfs where this process may mount one (root with CAP_SYS_ADMIN);
elsewhere the test-only simulated volume of `index.durable` (EMBEDSERVE_TEST_VOLUME_QUOTA),
under which SQLite itself answers "database or disk is full". The server test runs on whichever
is available, never skipped; the index-level tests run on both where both are available."""

from __future__ import annotations

import errno
import functools
import logging
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from index import durable
from index.docstore import DocStore, Document
from index.durable import TMP_PREFIX, atomic_write, volume_state
from index.errors import StorageFullError
from index.manifest import MANIFEST, ModelIdentity
from index.store import IndexStore

from helpers import spawn_server, stop_process

DIM = 64
IDENT = ModelIdentity(model="unit", fingerprint="u" * 64, dimension=DIM, normalize=True, pooling="mean",
                      query_prefix="", passage_prefix="", has_sparse=True)
TEXT = "Rivers carry water from the mountains to the sea, and their valleys hold towns and fields. " * 40


# ----------------------------------------------------------------------------- small volumes
@functools.cache
def _can_mount_tmpfs() -> bool:
    """Whether this process may mount a tmpfs (root with CAP_SYS_ADMIN), tried once."""
    if os.geteuid() != 0:
        return False
    probe = Path(f"/tmp/{TMP_PREFIX}embedserve-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                          capture_output=True).returncode != 0:
            return False
        subprocess.run(["umount", str(probe)], check=True)
        return True
    except OSError:
        return False
    finally:
        probe.rmdir()


class Volume:
    """A small volume at `path`: `tmpfs` (mounted) or `simulated` (durable.QUOTA_ENV). The
    index root is `path/indexes`; `fill(room)` leaves about `room` bytes free, `free()` frees
    the volume again."""

    def __init__(self, kind: str, path: Path, size: int):
        self.kind, self.path, self.size = kind, path, size
        path.mkdir(parents=True, exist_ok=True)
        self.ballast = path / "ballast"
        self.quota = path / "quota"
        if kind == "tmpfs":
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
        else:
            self.quota.write_text(str(size))
        self.root = path / "indexes"

    @property
    def env(self) -> dict[str, str]:
        """What a server process needs to see this volume as such."""
        return {durable.QUOTA_ENV: str(self.quota)} if self.kind == "simulated" else {}

    def fill(self, room: int = 0) -> None:
        if self.kind == "simulated":
            self.quota.write_text(str(durable._used_bytes(self.path) + room))
            return
        free = durable.free_bytes(self.path) - room
        chunk = b"\0" * (1 << 16)
        with open(self.path / f"ballast-{time.monotonic_ns()}", "wb") as f:
            try:
                while free > 0:
                    free -= f.write(chunk[:min(len(chunk), free)])
                f.flush()
            except OSError as exc:          # room == 0: write until the volume says no
                assert exc.errno == errno.ENOSPC, exc

    def free(self) -> None:
        if self.kind == "simulated":
            self.quota.write_text(str(self.size * 4))
        for p in self.path.glob("ballast-*"):
            p.unlink()

    def temp_entries(self) -> list[Path]:
        return [p for p in self.root.rglob(f"{TMP_PREFIX}*")]

    def close(self) -> None:
        if self.kind == "tmpfs":
            if subprocess.run(["umount", str(self.path)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(self.path)])


def _volume(kind: str, tmp_path: Path, size: int, monkeypatch) -> Volume:
    if kind == "tmpfs" and not _can_mount_tmpfs():
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN); the simulated volume runs instead")
    if kind == "simulated":
        monkeypatch.setenv(durable.QUOTA_ENV, str(tmp_path / "vol" / "quota"))
    return Volume(kind, tmp_path / "vol", size)


@pytest.fixture(autouse=True)
def _forget_volumes():
    """Each test starts and ends with no volume known full: the state is per process, and a
    volume left "full" here would turn an in-process server's /ready to 503 in a later test."""
    durable._volumes.clear()
    durable._any_full = False
    yield
    durable._volumes.clear()
    durable._any_full = False


@pytest.fixture(params=["tmpfs", "simulated"])
def volume(request, tmp_path, monkeypatch):
    vol = _volume(request.param, tmp_path, 4 << 20, monkeypatch)
    yield vol
    vol.close()


def _vectors(n: int, seed: int):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((n, DIM)).astype(np.float32)
    dense /= np.linalg.norm(dense, axis=1, keepdims=True)
    sparse = [(np.arange(5, dtype=np.int64) + i, np.full(5, 0.5, np.float32)) for i in range(n)]
    return list(dense), sparse


def _put(ix, ids: list[str], seed: int):
    dense, sparse = _vectors(len(ids), seed)
    return ix.upsert([Document(i, f"{i}: {TEXT}") for i in ids], dense, sparse, IDENT)


def _full_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "index.durable" and "is full" in r.getMessage()]


# ----------------------------------------------------------------------------- the index
def test_writes_until_the_volume_is_full_then_room_again(volume, caplog):
    """Upserts until the volume refuses them: each succeeds whole or raises StorageFullError
    (naming the volume), logged once without a traceback; the refused ones left nothing (counts,
    search, temp files, a reopen on the full volume); freed, the same open index takes writes."""
    caplog.set_level(logging.INFO)
    store = IndexStore(volume.root)
    ix = store.create("t", IDENT, snapshot_min_ops=30)
    volume.fill(room=256 << 10)
    acked: list[str] = []
    refused = 0
    for b in range(200):
        ids = [f"b{b}-{i}" for i in range(12)]
        try:
            _put(ix, ids, b)
        except StorageFullError as exc:
            refused += 1
            assert exc.code == "storage_full" and exc.volume == str(volume.path)
            assert str(volume.path) in exc.message and "Free space" in exc.message
            if refused == 3:
                break
            continue
        acked += ids
    assert refused == 3 and acked, (refused, len(acked))
    st = volume_state(volume.root)
    assert st.full and st.refused >= 3 and st.volume == str(volume.path)
    assert len(_full_warnings(caplog)) == 1 and all(r.exc_info is None for r in caplog.records)
    assert ix.counts() == {"documents": len(acked), "dense": len(acked), "sparse": len(acked)}
    seq = ix.applied
    again = ix.upsert([Document(i, f"{i}: {TEXT}") for i in acked[:12]], [None] * 12, [None] * 12, IDENT)
    assert set(again.outcomes.values()) == {"unchanged"} and ix.applied == seq   # nothing to write: fine
    assert volume_state(volume.root).full                    # and no evidence of room either
    assert set(ix.docs.ids()) == set(acked)
    assert volume.temp_entries() == []
    snapshots = {info["file"] for info in store.manifest("t").files.values()}
    vdir = volume.root / "t" / "v1"
    on_disk = {p.name for p in [*vdir.glob("dense-*.faiss"), *vdir.glob("sparse-*.npz")]}
    assert on_disk == snapshots, (on_disk, snapshots)          # no snapshot file the manifest does not name

    ix.close()                                               # its snapshot may not fit: replayed instead
    ix = store.open("t", IDENT)
    assert set(ix.docs.ids()) == set(acked) and ix.counts()["dense"] == len(acked)
    volume.free()
    _put(ix, ["after"], 999)                                 # the same connection, no restart
    assert not volume_state(volume.root).full
    assert ix.snapshot() and volume.temp_entries() == []
    ix.close()
    with store.open("t", IDENT) as ix:
        assert set(ix.docs.ids()) == set(acked) | {"after"}


def test_sqlite_full_is_rolled_back_and_the_connection_takes_the_next_write(tmp_path):
    """SQLITE_FULL (here from max_page_count) inside a write: StorageFullError, nothing of the
    transaction applied, no transaction left open; the next write commits once there is room."""
    docs = DocStore(tmp_path / "docs.sqlite")
    dense, sparse = _vectors(3, 0)
    docs.upsert([Document(f"a{i}", "small") for i in range(3)], dense, sparse)
    pages = docs.conn.execute("PRAGMA page_count").fetchone()[0]
    default = docs.conn.execute("PRAGMA max_page_count").fetchone()[0]
    docs.conn.execute(f"PRAGMA max_page_count = {pages}")
    big = [Document(f"b{i}", TEXT) for i in range(20)]
    dense, sparse = _vectors(20, 1)
    with pytest.raises(StorageFullError) as e:
        docs.upsert(big, dense, sparse)
    assert isinstance(e.value.__cause__, sqlite3.OperationalError) and "full" in str(e.value.__cause__)
    assert not docs.conn.in_transaction
    assert docs.seq() == 3 and docs.counts()["documents"] == 3 and docs.ids() == {"a0", "a1", "a2"}
    docs.conn.execute(f"PRAGMA max_page_count = {default}")
    change = docs.upsert(big, dense, sparse)
    assert change.base == 3 and change.seq == 23 and docs.counts()["documents"] == 23
    docs.close()


@pytest.mark.parametrize("fails", ["write", "fsync", "rename"])
def test_atomic_write_out_of_space_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch, fails):
    """ENOSPC while writing the temp file, fsyncing it or renaming it: StorageFullError, the old
    content in place, no temp file."""
    target = tmp_path / "f.bin"
    atomic_write(target, b"old")

    def enospc(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def writer(tmp: Path):
        tmp.write_bytes(b"half of the new")
        if fails == "write":
            enospc()
    if fails == "fsync":
        monkeypatch.setattr(durable, "fsync_file", enospc)
    if fails == "rename":
        monkeypatch.setattr(durable.os, "replace", enospc)
    with pytest.raises(StorageFullError) as e:
        durable.atomic_write_with(target, writer)
    assert e.value.path == str(target) and e.value.volume == durable.volume_of(tmp_path)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]
    monkeypatch.undo()
    atomic_write(target, b"new")                                # room again: the episode ends
    assert target.read_bytes() == b"new" and not volume_state(tmp_path).full


@pytest.mark.parametrize("part", ["dense", "sparse", "manifest"])
def test_a_snapshot_that_does_not_fit_leaves_the_index_as_it_was(tmp_path, monkeypatch, part, caplog):
    """A snapshot that runs out of room at any of its files: nothing of it stays (no new snapshot
    file, no temp file, the manifest unchanged); the write that triggered it is acknowledged,
    no traceback is logged, and a reopen holds every document."""
    store = IndexStore(tmp_path)
    ix = store.create("t", IDENT, snapshot_min_ops=10)
    _put(ix, [f"a{i}" for i in range(10)], 0)                 # the first snapshot fits
    vdir = tmp_path / "t" / "v1"
    before = {p.name: p.read_bytes() for p in vdir.iterdir() if p.suffix in (".faiss", ".npz", ".json")}
    assert len(before) == 3
    real = durable.atomic_write_with
    target = {"dense": ".faiss", "sparse": ".npz", "manifest": MANIFEST}[part]

    def no_room(final: Path, writer):
        def partial(tmp: Path):
            writer(tmp)
            if final.name.endswith(target):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
        real(final, partial)
    for module in ("index.dense", "index.sparse", "index.manifest"):
        if hasattr(sys.modules[module], "atomic_write_with"):
            monkeypatch.setattr(sys.modules[module], "atomic_write_with", no_room)
    monkeypatch.setattr(durable, "atomic_write_with", no_room)
    caplog.set_level(logging.INFO)
    _put(ix, [f"b{i}" for i in range(10)], 1)                 # acknowledged; its snapshot does not fit
    after = {p.name: p.read_bytes() for p in vdir.iterdir() if p.suffix in (".faiss", ".npz", ".json")}
    assert after == before and not [p for p in vdir.iterdir() if p.name.startswith(TMP_PREFIX)]
    assert all(r.exc_info is None for r in caplog.records) and _full_warnings(caplog)
    monkeypatch.undo()
    ix.close(snapshot=False)
    with store.open("t", IDENT) as ix:
        assert ix.docs.ids() == {f"a{i}" for i in range(10)} | {f"b{i}" for i in range(10)}
        assert ix.counts()["dense"] == 20


def test_the_status_table_answers_507():
    from embedserve.api.errors import error_response, status_for
    exc = StorageFullError("full", volume="/v", path="/v/x")
    assert status_for(exc) == (507, "insufficient_storage")
    r = error_response(exc)
    assert r.status_code == 507 and b'"storage_full"' in r.body and "retry-after" not in r.headers


# ----------------------------------------------------------------------------- a real server
@pytest.mark.server
@pytest.mark.slow
def test_a_server_on_a_full_volume_answers_507_and_recovers_without_a_restart(tmp_path, monkeypatch):
    """The issue's operator run, on a small volume: upserts until it is full get 200 or 507 (never
    500); /ready and /metrics say so; the log says it once, without a traceback; once room is
    back the next write succeeds in the same process; a restart on a full volume has every
    acknowledged document (and none of the refused ones); no temp file is left."""
    # EMBEDSERVE_TEST_SIMULATED_VOLUME=1 runs the simulated variant where a tmpfs could be mounted
    kind = "tmpfs" if _can_mount_tmpfs() and not os.environ.get("EMBEDSERVE_TEST_SIMULATED_VOLUME") else "simulated"
    vol = _volume(kind, tmp_path, 6 << 20, monkeypatch)
    log, log2 = tmp_path / "server.log", tmp_path / "server2.log"
    try:
        proc, base = _start(vol, log)
        try:
            assert httpx.post(base + "/v1/indexes", json={"name": "kb"}).status_code == 201
            vol.fill(room=300 << 10)
            acked, statuses = _upsert_until_full(base)
            assert set(statuses) <= {200, 507} and statuses.count(507) >= 2 and acked, statuses
            said = log.read_text()
            assert said.count("is full (") == 1 and "Traceback" not in said, said[-4000:]     # once, no traceback
            ready = httpx.get(base + "/ready")
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "storage_full", ready.text
            assert str(vol.path) in ready.json()["error"]["message"]
            metrics = httpx.get(base + "/metrics").text
            assert _metric(metrics, "embedserve_storage_full_total") >= statuses.count(507)
            assert _metric(metrics, "embedserve_storage_full_now") == 1
            hit = httpx.post(base + "/v1/search", json={"index": "kb", "query": "rivers", "top_k": 3})
            assert hit.status_code == 200 and len(hit.json()["data"]) == 3      # searches still answer

            vol.free()
            r = _upsert(base, ["after-free"])
            assert r.status_code == 200, r.text                # the same process: no restart
            acked.append("after-free")
            assert httpx.get(base + "/ready").status_code == 200
            assert _metric(httpx.get(base + "/metrics").text, "embedserve_storage_full_now") == 0
            vol.fill()                                          # full again for the restart
        finally:
            _stop(proc)
        proc, base = _start(vol, log2)                          # on the full volume
        try:
            info = httpx.get(base + "/v1/indexes/kb").json()
            assert info["counts"]["documents"] == len(acked), info
            assert httpx.post(base + "/v1/search", json={"index": "kb", "query": "rivers"}).status_code == 200
        finally:
            _stop(proc)
        version = (vol.root / "kb" / "CURRENT").read_text().strip()
        assert _ids(vol, version) == set(acked)                 # every acknowledged one, none refused
        assert vol.temp_entries() == []
        for out in (log.read_text(), log2.read_text()):
            assert "Traceback" not in out, out[-4000:]
    finally:
        vol.close()


def _ids(vol: Volume, version: str) -> set[str]:
    conn = sqlite3.connect(f"file:{vol.root / 'kb' / version / 'docs.sqlite'}?mode=ro", uri=True)
    try:
        return {r[0] for r in conn.execute("SELECT ext_id FROM docs")}
    finally:
        conn.close()


def _start(vol: Volume, log: Path) -> tuple[subprocess.Popen, str]:
    srv = spawn_server("--model", "all-MiniLM-L6-v2", "--dtype", "float32", "--log-level", "warning",
                       "--index-dir", str(vol.root), env={"EMBEDSERVE_GENERATE_MODEL": "none", **vol.env},
                       log=log, timeout=120)
    return srv.proc, srv.base


_stop = stop_process


def _upsert(base: str, ids: list[str]) -> httpx.Response:
    docs = [{"id": i, "text": f"{i}: {TEXT[:1500]}"} for i in ids]
    return httpx.post(f"{base}/v1/indexes/kb/documents", json={"documents": docs}, timeout=60)


def _upsert_until_full(base: str) -> tuple[list[str], list[int]]:
    acked, statuses = [], []
    for b in range(60):
        ids = [f"b{b}-{i}" for i in range(16)]
        r = _upsert(base, ids)
        statuses.append(r.status_code)
        if r.status_code == 200:
            acked += ids
        else:
            assert r.status_code == 507, r.text
            err = r.json()["error"]
            assert err["code"] == "storage_full" and err["type"] == "insufficient_storage", err
            assert "Free space" in err["message"]
            if statuses.count(507) == 3:
                break
    return acked, statuses


def _metric(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} is not in /metrics")


@pytest.mark.parametrize("step", ["mkdir", "rename"])
def test_creating_an_index_or_version_without_room_is_507_and_leaves_nothing(tmp_path, monkeypatch, step):
    """ENOSPC while an index (or a new version) is being laid out: StorageFullError naming what
    was not created, no index and no temp directory left; with room again the same call works."""
    store = IndexStore(tmp_path / "ix")
    real = {"mkdir": Path.mkdir, "rename": os.rename}

    def enospc(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if step == "mkdir":
        monkeypatch.setattr(Path, "mkdir", lambda self, *a, **kw: enospc() if TMP_PREFIX in self.name
                            else real["mkdir"](self, *a, **kw))
    else:
        monkeypatch.setattr(os, "rename", enospc)
    with pytest.raises(StorageFullError, match="index 'docs' was not created"):
        store.create("docs", IDENT)
    assert store.names() == [] and not [p for p in (tmp_path / "ix").iterdir() if TMP_PREFIX in p.name]
    monkeypatch.undo()
    store.create("docs", IDENT).close()
    if step == "rename":
        monkeypatch.setattr(os, "rename", enospc)
        with pytest.raises(StorageFullError, match="no version of 'docs' was added"):
            store.add_version("docs", IDENT)
        monkeypatch.undo()
        assert store.versions("docs") == ["v1"]
        assert not [p for p in (tmp_path / "ix" / "docs").iterdir() if TMP_PREFIX in p.name]
        assert store.add_version("docs", IDENT) == "v2"           # room again
    assert store.names() == ["docs"] and not volume_state(tmp_path).full
