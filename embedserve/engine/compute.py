"""Model compute, one engine at a time, without the engines' OpenMP teams throttling each other.

torch's OpenMP runtime (libgomp) keeps a team of worker threads for every thread that has run a
parallel region, and once the process's OpenMP-managed threads outnumber its cores it cuts the
spin-wait at the end of every parallel region from ~300,000 spins to 100: each of a forward's
hundreds of regions then pays a futex sleep and wake-up. One engine (its thread's team) fits the
cores; the default `serve` runs three (embedder, reranker, generator), each on its own thread,
and their idle teams would throttle whichever engine computes. So a thread that hands the cores
to another (one is waiting for this lock) releases its own team first, and so does an engine
that goes idle while other engines live (`omp_pause_resource_all`, from its own thread, outside
any parallel region); its next batch starts a new team (one thread start, tens of microseconds).
A lone engine never releases its team.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1      # omp_pause_resource_t: the host's thread pool goes either way


def _find_omp_pause():
    """torch's libgomp `omp_pause_resource_all`, or None (another OpenMP runtime: nothing to do)."""
    try:
        import torch
        libs = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
        for path in libs:
            lib = ctypes.CDLL(str(path))        # already loaded by torch: the same runtime
            fn = getattr(lib, "omp_pause_resource_all", None)
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
                return fn
    except OSError as exc:                      # pragma: no cover - a torch without its libgomp
        logger.debug("no OpenMP pause: %s", exc)
    return None


class ComputeLock:
    """`with COMPUTE_LOCK:` around a model call; engine threads `enroll()` when they start,
    `leave()` when they end, and call `idle()` before they wait for work."""

    def __init__(self):
        self._lock = threading.Lock()
        self._meta = threading.Lock()
        self._waiting = 0
        self._engines: set[int] = set()         # live engine threads
        self._teams: set[int] = set()           # threads that computed since they last released
        self._pause = None
        self._pause_found = False
        self.released = 0                       # teams released (for tests and debugging)

    def enroll(self) -> None:
        with self._meta:
            self._engines.add(threading.get_ident())

    def leave(self) -> None:
        """The calling engine thread ends (its team goes with it; its id may be reused)."""
        with self._meta:
            self._engines.discard(threading.get_ident())
            self._teams.discard(threading.get_ident())

    def __enter__(self):
        with self._meta:
            self._waiting += 1
        self._lock.acquire()
        with self._meta:
            self._waiting -= 1
            self._teams.add(threading.get_ident())
        return self

    def __exit__(self, *exc):
        try:
            with self._meta:
                handing_over = self._waiting > 0
            if handing_over:                    # another thread computes next: not beside our team
                self._release_team()
        finally:
            self._lock.release()

    def idle(self) -> None:
        """The calling engine has nothing to do: its team goes where other engines may compute."""
        with self._meta:
            others = len(self._engines) > 1
        if others:
            self._release_team()                # a no-op where this thread holds no team

    def _release_team(self) -> None:
        me = threading.get_ident()
        with self._meta:
            if me not in self._teams:
                return
            self._teams.discard(me)
            self.released += 1
        if not self._pause_found:
            self._pause, self._pause_found = _find_omp_pause(), True
        if self._pause is not None:
            self._pause(OMP_PAUSE_SOFT)


# One lock for model compute: where cores are few, engines take turns instead of fighting.
COMPUTE_LOCK = ComputeLock()
