"""The thread an engine runs its model loop on (model work never runs on the event loop)."""

from __future__ import annotations

import threading


class EngineThread:
    """A daemon thread running `self._loop`; `self._cv` guards the engine's queues and wakes
    the loop, `self._stop` ends it."""

    thread_name = "engine"

    def __init__(self):
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread:
            self._thread.join(timeout=30)

    def health(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        raise NotImplementedError
