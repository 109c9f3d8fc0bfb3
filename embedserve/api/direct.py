"""Direct dispatch of the hottest routes: a pure ASGI layer, inside the guard (auth, rate limit,
body cap, metrics) and the drain, that calls the endpoint of `POST /v1/embeddings` itself.

FastAPI's own path to an endpoint (its exception and exit-stack middleware, the router's match
over every route, the request-response wrapper and the dependency solver) cost about a third of
the event loop's CPU per one-text request (py-spy, 1 text/request x 8 clients). The routes stay
registered with FastAPI for /openapi.json and /docs; their endpoints take the `Request` alone and
return a `Response`, so the same function answers either way, and errors leave through the
handler the app's exception handlers use (`app._handle_error`)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from .middleware import leaf_routes

DIRECT = (("POST", "/v1/embeddings"),)


class DirectRoutes:
    """Pure ASGI: `DIRECT`'s (method, path) straight to their endpoints; anything else on to the app."""

    def __init__(self, app, handle_error):
        self.app = app
        self.handle_error = handle_error       # (request, exc) -> Response, the app's error handlers
        self.table: dict | None = None

    def _resolve(self, app) -> dict:
        table = {}
        for route in leaf_routes(app.router.routes):
            for method, path in DIRECT:
                if getattr(route, "path", None) == path and method in (getattr(route, "methods", None) or ()):
                    table[(method, path)] = route
        return table

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            if self.table is None:
                self.table = self._resolve(scope["app"])
            route = self.table.get((scope["method"], scope["path"]))
            if route is not None:
                scope["route"] = route
                request = Request(scope, receive)
                try:
                    response = await route.endpoint(request)
                    if not isinstance(response, Response):
                        raise TypeError(f"{route.path}'s endpoint returned {type(response).__name__}, not a Response")
                except Exception as exc:
                    response = await self.handle_error(request, exc)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
