"""Draining for a graceful stop: requests in flight are counted; once the server is draining
(SIGTERM), new requests get 503 with `Retry-After` while the ones in flight finish."""

from __future__ import annotations

from ..errors import UnavailableError
from .errors import error_response
from .state import AppState

_ALWAYS_ANSWERED = ("/health", "/ready", "/metrics")


class DrainMiddleware:
    """Pure ASGI, outermost: counts requests in flight, refuses new ones while draining."""

    def __init__(self, app, state: AppState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.state.draining and scope["path"] not in _ALWAYS_ANSWERED:
            return await error_response(UnavailableError(
                "the server is shutting down; retry (another replica, or this one after its restart)",
                retry_after=5))(scope, receive, send)
        self.state.inflight += 1          # one event loop: no lock needed
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.inflight -= 1
