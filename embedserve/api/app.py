"""The FastAPI application: routers, middleware and error handlers over an `AppState`.

The HTTP layer converts schemas and errors and nothing else: engines are built and attached
to the state by the wiring (`embedserve.serve`); model work happens on the engine threads, and
the event loop only validates, tokenizes (in the thread pool: fast tokenizers release the
GIL), waits and serializes.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from .. import __version__
from index.errors import DescribedError

from ..errors import MethodNotAllowedError, NotFoundError, ValidationError
from . import embeddings, generation, indexes, openapi, rerank, system, tokenize
from .errors import error_response, status_for, validation_error
from .direct import DirectRoutes
from .drain import DrainMiddleware
from .middleware import GuardMiddleware
from .state import AppState

logger = logging.getLogger(__name__)


def create_app(state: AppState, start: Callable[[AppState], None] | None = None) -> FastAPI:
    """The app over `state`. `start(state)` runs when the server starts (it attaches engines,
    now or from a loader thread); attached engines are stopped when it shuts down."""

    @asynccontextmanager
    async def lifespan(app):
        if start is not None:
            start(state)
        yield
        for engine in state.embedders.values():
            engine.stop()
        if state.generator is not None:
            state.generator.stop()
        state.indexes.close_all()           # a last snapshot: the next start has nothing to replay

    app = FastAPI(title="embedserve", version=__version__, lifespan=lifespan)
    app.state.embedserve = state
    app.add_middleware(DirectRoutes, handle_error=lambda request, exc: _handle_error(state, request, exc))
    app.add_middleware(GuardMiddleware, state=state)
    if state.config.http.origins:        # outside the key check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=state.config.http.origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"])
    app.add_middleware(DrainMiddleware, state=state)       # added last: outermost
    _add_error_handlers(app, state)
    for module in (system, embeddings, rerank, tokenize, generation, indexes):
        app.include_router(module.build_router(state))
    _describe_bodies(app)
    return app


def _describe_bodies(app: FastAPI) -> None:
    """/openapi.json with the request bodies the routes read themselves (api.openapi)."""
    build = app.openapi

    def document() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi.complete(build())
        return app.openapi_schema
    app.openapi = document


async def _handle_error(state: AppState, request: Request, exc: Exception):
    """The response to an endpoint's exception (a described error, a schema violation, or a crash:
    500, logged with its traceback): what the app's exception handlers give and what the direct
    routes (api.direct) give."""
    if isinstance(exc, RequestValidationError):
        exc = validation_error(exc)
    elif not isinstance(exc, DescribedError):
        logger.exception("unhandled error on %s", _route(request), exc_info=exc)
    elif status_for(exc)[0] >= 500 and not getattr(exc, "logged", False):   # logged: once where it arose
        logger.error("%s on %s: %s", type(exc).__name__, _route(request), exc)
    state.metrics.errors.labels(type=status_for(exc)[1]).inc()
    return error_response(exc)


def _add_error_handlers(app: FastAPI, state: AppState) -> None:
    """Every error leaves in OpenAI's envelope with the status `api.errors` gives its kind."""

    async def handle(request: Request, exc: Exception):
        return await _handle_error(state, request, exc)

    app.add_exception_handler(DescribedError, handle)
    app.add_exception_handler(RequestValidationError, handle)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error_response(NotFoundError(f"no route {request.method} {request.url.path}; see /docs for "
                                                "the API", code="route_not_found"))
        if exc.status_code == 405:
            return error_response(MethodNotAllowedError(f"{request.method} is not allowed on {request.url.path}"))
        return error_response(ValidationError(str(exc.detail)))

    app.add_exception_handler(Exception, handle)


def _route(request: Request) -> str:
    """The route's template (`/v1/indexes/{name}`) for logs: a path can carry names a user chose,
    and no request text is logged by default."""
    route = request.scope.get("route")
    return f"{request.method} {getattr(route, 'path', 'unmatched route')}"
