"""The compute lock releases a thread's OpenMP team when it hands the cores over, and an
engine's when it goes idle beside other engines (embedserve/engine/compute.py). Each test engine
names its OS thread; the OpenMP workers it starts inherit the name, so counting the process's
threads by name counts an engine and its team, whatever other threads the test process runs."""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from embedserve.engine.compute import ComputeLock, _find_omp_pause

pytestmark = pytest.mark.skipif(_find_omp_pause() is None, reason="torch without libgomp")


_NAMES = itertools.count()
_libc = ctypes.CDLL(None)


def _name_this_thread(name: str) -> None:
    _libc.prctl(15, name.encode()[:15], 0, 0, 0)           # PR_SET_NAME: inherited by threads it starts


def _threads(name: str) -> int:
    """OS threads of this process named `name` (an engine thread and its OpenMP workers)."""
    n = 0
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            n += comm.read_text().strip() == name
        except OSError:                                     # ended meanwhile
            pass
    return n


def _settle(name: str, expected: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while _threads(name) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _threads(name)


def _parallel_work():
    """One parallel region on 2 threads (a team: the calling thread + 1 worker)."""
    x = torch.ones(4_000_000)
    x.exp_()
    return float(x[0])


@pytest.fixture(autouse=True)
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class Engine:
    """A thread that computes under the lock when told, goes idle when told, and ends when told."""

    def __init__(self, lock: ComputeLock):
        self.lock, self.todo, self.done = lock, [], threading.Semaphore(0)
        self.name = f"ctest-{os.getpid() % 1000}-{next(_NAMES)}"
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        _name_this_thread(self.name)
        self.lock.enroll()
        while True:
            with self.cv:
                while not self.todo:
                    self.cv.wait()
                what = self.todo.pop(0)
            if what == "stop":
                self.lock.leave()
                self.done.release()
                return
            if what == "compute":
                with self.lock:
                    _parallel_work()
            elif what == "idle":
                self.lock.idle()
            self.done.release()

    def do(self, what: str, wait: bool = True):
        with self.cv:
            self.todo.append(what)
            self.cv.notify()
        if wait:
            assert self.done.acquire(timeout=30)


def _team(e: Engine, expected: int) -> bool:
    """Whether engine `e` settles at `expected` threads: 2 with its team (itself and one worker), 1
    without, 0 once ended."""
    return _settle(e.name, expected) == expected


def test_one_engine_keeps_its_team():
    lock = ComputeLock()
    a = Engine(lock)
    a.do("compute")
    assert _team(a, 2), "the engine thread and its OpenMP worker"
    a.do("idle")
    a.do("compute")
    assert lock.released == 0 and _threads(a.name) == 2       # alone, nothing is released
    a.do("stop")
    a.thread.join(5)
    assert _team(a, 0), "an ended thread's team goes with it"


def test_idle_engines_release_their_teams_beside_other_engines():
    lock = ComputeLock()
    a, b = Engine(lock), Engine(lock)
    a.do("compute")
    a.do("idle")                                              # b may compute next: a's team goes
    assert _team(a, 1) and lock.released == 1
    a.do("compute")
    b.do("compute")
    assert _team(a, 2) and _team(b, 2), "two engine threads, two OpenMP workers"
    a.do("idle")
    assert _team(a, 1) and _team(b, 2) and lock.released == 2
    a.do("idle")                                              # no team left: nothing to do
    assert lock.released == 2
    b.do("idle")
    assert _team(b, 1) and lock.released == 3
    for e in (a, b):
        e.do("stop")
        e.thread.join(5)
        assert _team(e, 0)


def test_a_thread_handing_the_cores_over_releases_its_team_first():
    lock = ComputeLock()
    a, b = Engine(lock), Engine(lock)
    a.do("compute")
    assert _team(a, 2), "nobody waited: a keeps its team"
    released = lock.released
    with lock:                                                # hold the cores; a and b queue
        a.do("compute", wait=False)
        b.do("compute", wait=False)
        deadline = time.monotonic() + 10
        while lock._waiting < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lock._waiting == 2
    assert a.done.acquire(timeout=30) and b.done.acquire(timeout=30)
    # this thread handed over (its pause a no-op: it ran nothing parallel), then whichever engine
    # ran first handed over to the other and released its team; the last one keeps its own
    assert lock.released == released + 2
    assert sorted(_settle(e.name, 99, timeout=0.5) for e in (a, b)) == [1, 2]
    for e in (a, b):                                          # both idle while both live
        e.do("idle")
    assert _team(a, 1) and _team(b, 1)
    for e in (a, b):
        e.do("stop")
        e.thread.join(5)
        assert _team(e, 0)
