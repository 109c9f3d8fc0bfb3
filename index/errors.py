"""The index library's own errors. Each says what to change; `param` names the offending field
and `code` is a stable machine-readable reason. A service maps these kinds to its own statuses
(embedserve's HTTP layer: invalid 400, not found 404, conflict 409, corrupt 500, backend unavailable 503, storage full 507)."""

from __future__ import annotations

import errno
import os


class DescribedError(Exception):
    """An error a user can act on: `message` says what to change, `param` names the offending
    field, `code` is a stable machine-readable reason. (embedserve's own errors build on it.)"""

    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class IndexLibraryError(DescribedError):
    """Base class of every error the index library raises on purpose."""


class ValidationError(IndexLibraryError):
    """Bad input: a name, a document, a query or a setting that cannot be used as given."""


class NotFoundError(IndexLibraryError):
    """No such index or version."""

    code = "index_not_found"


class ConflictError(IndexLibraryError):
    """A write or search that would mix vectors of two models (manifest mismatch), or a name taken."""

    code = "manifest_mismatch"


class IndexCorruptError(IndexLibraryError):
    """An index's files are unreadable or inconsistent in a way replay cannot repair."""

    code = "index_corrupt"


class RetiredError(IndexLibraryError):
    """A write reached a version a migration has replaced; retrying reaches the live one."""

    code = "version_retired"
    retry_after = 1


class BackendUnavailableError(IndexLibraryError):
    """The index backend (a PostgreSQL database) cannot be reached now, or timed out: nothing of
    the request was applied, and the same request succeeds once it is back."""

    code = "index_backend_unavailable"

    def __init__(self, message: str, *, retry_after: int = 2, **kw):
        super().__init__(message, **kw)
        self.retry_after = max(1, int(retry_after))


class BackendBusyError(BackendUnavailableError):
    """Every connection to the index database is in use and none came free in time: the
    database is up but this process is over its share (HTTP 429, Retry-After)."""

    code = "index_backend_busy"


class StorageFullError(IndexLibraryError, OSError):
    """A write found no room on the volume holding the index (ENOSPC, EDQUOT, SQLite's "database
    or disk is full"): nothing of it was applied, and the same write succeeds once there is room.
    `volume` is the full volume's mount point, `path` the file or directory being written. An
    OSError too (errno ENOSPC), so code that copes with a failed write keeps coping."""

    code = "storage_full"
    logged = True           # where it arose, once per episode (index.durable.note_full): not per request

    def __init__(self, message: str, *, volume: str, path: str, **kw):
        super().__init__(message, **kw)
        self.errno, self.strerror, self.filename = errno.ENOSPC, os.strerror(errno.ENOSPC), path
        self.volume = volume
        self.path = path

    def __str__(self) -> str:
        return self.message
