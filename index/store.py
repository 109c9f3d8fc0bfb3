"""The index root: named indexes, their versions, and the `CURRENT` pointer.

    <root>/<name>/CURRENT        the live version's name ("v1"); replaced only by an atomic rename
    <root>/<name>/v1/            manifest.json, docs.sqlite, dense-<seq>.faiss, sparse-<seq>.npz
    <root>/<name>/v2/            e.g. a reindex with another model, built beside the live one

Indexes and versions appear whole: each is built under a temp name and renamed into place.
Names match `^[A-Za-z0-9_.-]{1,64}$` and may not start with '.' (which also rules out '.'
and '..'); no path, however spelled or linked, may leave the root.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path

from .errors import ConflictError, NotFoundError, ValidationError

from .core import Index
from .docstore import DB_NAME, DocStore, read_counts
from .durable import TMP_PREFIX, atomic_write, clean_temp, fsync_dir, refused_when_full, temp_path
from .manifest import MANIFEST, DenseConfig, Manifest, ModelIdentity

logger = logging.getLogger(__name__)

NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$"     # 1-64 of these, not starting with '.'
NAME_RE = re.compile(NAME_PATTERN)
VERSION_RE = re.compile(r"^v[0-9]{1,9}$")
CURRENT = "CURRENT"
STALE_TEMP_S = 600.0


def check_name(name) -> str:
    """Return `name` if it is a valid index name, else a ValidationError (HTTP 400)."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValidationError(f"index name {name!r} is not allowed: use 1-64 letters, digits, '_', '.' or '-', "
                              "not starting with '.' (a name, not a path)", param="name", code="invalid_index_name")
    return name


def check_version(version) -> str:
    if not isinstance(version, str) or not VERSION_RE.fullmatch(version):
        raise ValidationError(f"index version {version!r} is not allowed: versions are named v1, v2, ...",
                              param="version", code="invalid_index_version")
    return version


class IndexStore:
    """All indexes under one root directory (the `local` backend; `index.pg.PgStore` is the other)."""

    backend = "local"

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self._real_root = self.root.resolve()
        # Only old leftovers: another process may be creating or deleting an index right now.
        clean_temp(self.root, min_age_s=STALE_TEMP_S)

    def describe(self) -> str:
        return f"local ({self.root})"

    # ------------------------------------------------------------------ paths
    def _inside(self, path: Path, what: str) -> Path:
        real = path.resolve()
        if real != self._real_root and self._real_root not in real.parents:
            raise ValidationError(f"{what} resolves to {real}, outside the index root {self._real_root}; "
                                  "remove the link", param="name", code="path_outside_root")
        return path

    def index_dir(self, name: str) -> Path:
        return self._inside(self.root / check_name(name), f"index {name!r}")

    def version_dir(self, name: str, version: str) -> Path:
        return self._inside(self.index_dir(name) / check_version(version), f"index {name!r} version {version!r}")

    # ------------------------------------------------------------------ reads
    def exists(self, name: str) -> bool:
        return (self.index_dir(name) / CURRENT).is_file()

    def names(self) -> list[str]:
        """Every index under the root (temp and hidden entries are not indexes)."""
        out = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith(".") or not NAME_RE.fullmatch(entry.name):
                continue
            try:
                if self.exists(entry.name):
                    out.append(entry.name)
            except ValidationError:
                logger.warning("skipping %s: it links outside the index root", entry)
        return out

    def current(self, name: str) -> str:
        """The live version of `name`; NotFoundError if there is no such index."""
        path = self.index_dir(name) / CURRENT
        try:
            raw = path.read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            raise NotFoundError(f"index {name!r} does not exist; create it first, or list the indexes "
                                "there are", param="name", code="index_not_found") from None
        return check_version(raw)

    def live(self, name: str) -> tuple[str, str]:
        """(live version, the key an open version of it has: `Index.key`)."""
        version = self.current(name)
        return version, version

    def counts(self, name: str, version: str) -> dict[str, int]:
        """A version's live counts from its doc store (whether or not it is open here)."""
        return read_counts(self.version_dir(name, version) / DB_NAME)

    def versions(self, name: str) -> list[str]:
        d = self.index_dir(name)
        if not d.is_dir():
            raise NotFoundError(f"index {name!r} does not exist", param="name", code="index_not_found")
        vs = [p.name for p in d.iterdir() if VERSION_RE.fullmatch(p.name) and (p / MANIFEST).is_file()]
        return sorted(vs, key=lambda v: int(v[1:]))

    def manifest(self, name: str, version: str | None = None) -> Manifest:
        return Manifest.load(self.version_dir(name, version or self.current(name)))

    def open(self, name: str, identity: ModelIdentity | None = None, version: str | None = None, **kw) -> Index:
        """Open a version (default: the live one). With `identity`, refuse a manifest mismatch (409)."""
        version = version or self.current(name)
        path = self.version_dir(name, version)
        if not (path / MANIFEST).is_file():
            raise NotFoundError(f"index {name!r} has no version {version!r}", param="version",
                                code="index_not_found")
        return Index(path, identity, **kw)

    # ----------------------------------------------------------------- writes
    def create(self, name: str, identity: ModelIdentity, dense: DenseConfig | None = None, **kw) -> Index:
        """Create index `name` with an empty v1 bound to `identity`'s model, and open it."""
        final = self.index_dir(name)
        if final.exists() or final.is_symlink():
            raise ConflictError(f"index {name!r} already exists; pick another name or delete it first",
                                param="name", code="index_exists")
        tmp = temp_path(final)
        # mkdir or rename with no room: the typed 507, nothing created
        try:
            with refused_when_full(final, f"index {name!r} was not created"):
                tmp.mkdir()
                self._init_version(tmp / "v1", name, "v1", identity, dense or DenseConfig())
                atomic_write(tmp / CURRENT, b"v1\n")
                fsync_dir(tmp)
                try:
                    os.rename(tmp, final)      # fails if `final` appeared meanwhile: no silent merge
                except OSError as exc:
                    if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                        raise ConflictError(f"index {name!r} already exists", param="name",
                                            code="index_exists") from None
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        fsync_dir(self.root)
        logger.info("created index %s (model %s, %s)", name, identity.model, (dense or DenseConfig()).kind)
        return self.open(name, identity, **kw)

    def add_version(self, name: str, identity: ModelIdentity, dense: DenseConfig | None = None) -> str:
        """A new, empty version beside the others (not live until `set_current`)."""
        existing = self.versions(name)
        version = f"v{max((int(v[1:]) for v in existing), default=0) + 1}"
        final = self.version_dir(name, version)
        tmp = temp_path(final)
        try:
            with refused_when_full(final, f"no version of {name!r} was added"):
                self._init_version(tmp, name, version, identity,
                                   dense or DenseConfig(**self.manifest(name).dense_index))
                os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        fsync_dir(final.parent)
        return version

    def set_current(self, name: str, version: str) -> None:
        """Make `version` live: one atomic rename of the pointer file."""
        if not (self.version_dir(name, version) / MANIFEST).is_file():
            raise NotFoundError(f"index {name!r} has no version {version!r}", param="version", code="index_not_found")
        atomic_write(self.index_dir(name) / CURRENT, f"{version}\n".encode())
        logger.info("index %s: current -> %s", name, version)

    def delete(self, name: str) -> None:
        """Remove an index: renamed away atomically first, so no reader sees half of it."""
        final = self.index_dir(name)
        if not final.exists():
            raise NotFoundError(f"index {name!r} does not exist", param="name", code="index_not_found")
        if final.is_symlink():
            final.unlink()
        else:
            trash = final.with_name(f"{TMP_PREFIX}deleted-{name}-{os.getpid()}")
            os.rename(final, trash)
            fsync_dir(self.root)
            shutil.rmtree(trash, ignore_errors=True)
        logger.info("deleted index %s", name)

    @staticmethod
    def _init_version(path: Path, name: str, version: str, identity: ModelIdentity, dense: DenseConfig) -> None:
        path.mkdir()
        Manifest.new(name, version, identity, dense).save(path)
        DocStore(path / DB_NAME).close()
        fsync_dir(path)
