"""The thread an engine runs its model loop on (model work never runs on the event loop), and
its liveness: a thread that died (with the cause) or has been busy on one batch or step past
`stall_after` seconds is unhealthy, which `/health` reports as 503."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

from .compute import COMPUTE_LOCK

logger = logging.getLogger(__name__)


class EngineThread:
    """A daemon thread running `self._loop`; `self._cv` guards the engine's queues and wakes
    the loop, `self._stop` ends it. The loop wraps each model call in `self.busy()`."""

    thread_name = "engine"
    stall_after = 60.0

    def __init__(self):
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._busy_since: float | None = None
        self.death: str | None = None

    def start(self) -> None:
        self._stop, self.death = False, None    # a stopped engine may be started again
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        COMPUTE_LOCK.enroll()
        try:
            self._loop()
        except BaseException as exc:            # the loop never returns by error on purpose
            self.death = f"{type(exc).__name__}: {exc}"
            logger.critical("the %s thread died: %s", self.thread_name, self.death, exc_info=True)
            self._on_death(exc)
        finally:
            COMPUTE_LOCK.leave()

    def _on_death(self, exc: BaseException) -> None:
        """Fail whatever was waiting for the loop (nothing may wait forever on a dead thread)."""

    @contextmanager
    def busy(self):
        """Marks one model call: a call that outlasts `stall_after` makes the engine unhealthy."""
        self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health_problem(self) -> str | None:
        """Why this engine is not healthy, or None."""
        if self._thread is None:
            return f"the {self.thread_name} thread was never started"
        if self.death is not None or not self._thread.is_alive():
            # `death` is set before the dying loop fails its requests: they see the cause, not a
            # thread that is still (just) alive
            return f"the {self.thread_name} thread has stopped" + (f" ({self.death})" if self.death else "")
        since = self._busy_since
        if since is not None and time.monotonic() - since > self.stall_after:
            return (f"the {self.thread_name} thread has been busy on one model call for "
                    f"{time.monotonic() - since:.0f} s (--stall-timeout {self.stall_after:g})")
        return None

    def health(self) -> bool:
        return self.health_problem() is None

    def _loop(self) -> None:
        raise NotImplementedError
