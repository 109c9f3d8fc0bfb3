"""Pure ASGI middleware: bearer-token auth, a per-caller rate limit (429), a hard body-size cap
(413), per-route metrics."""

from __future__ import annotations

import time

from ..errors import AuthenticationError, EmbedServeError, PayloadTooLargeError, RateLimitedError
from .errors import error_response, status_for
from .ratelimit import RateLimiter
from .state import AppState

# Never asked for a key nor rate limited (probes). Everything else is, /docs, /redoc and
# /openapi.json included: the API's shape is not shown to callers without a key.
_OPEN_PATHS = ("/health", "/ready")


class GuardMiddleware:
    """Pure ASGI: bearer-token auth, a per-caller rate limit (429), a hard body-size cap (413),
    per-route metrics."""

    def __init__(self, app, state: AppState):
        self.app = app
        self.state = state
        cfg = state.config.http
        self.limiter = RateLimiter(cfg.rate_limit, cfg.rate_burst) if cfg.rate_limit else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state, path = self.state, scope["path"]
        t0 = time.perf_counter()
        status_box = {"status": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status_box["status"] = message["status"]
            await send(message)

        async def reply(exc: EmbedServeError):
            state.metrics.errors.labels(type=status_for(exc)[1]).inc()
            await error_response(exc)(scope, receive, send_wrapper)

        try:
            if path not in _OPEN_PATHS:
                caller = (scope.get("client") or ("unknown",))[0]
                if state.keys.enabled:
                    auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                    caller = state.keys.match(auth[7:].strip() if auth[:7].lower() == "bearer " else "")
                    if caller is None:
                        return await reply(AuthenticationError(
                            "missing or wrong API key; send `Authorization: Bearer <key>`"))
                if self.limiter is not None and (wait := self.limiter.check(caller)):
                    who = "API key" if state.keys.enabled else "client address"
                    return await reply(RateLimitedError(
                        f"this {who} sent more than --rate-limit {state.config.http.rate_limit:g} requests per "
                        f"second (burst {state.config.http.rate_burst}); retry in {wait} s", retry_after=wait))
            limit = state.config.http.max_body_bytes
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                return await reply(PayloadTooLargeError(
                    f"request body is {int(length)} bytes; the limit (--max-body-bytes) is {limit}"))
            if scope["method"] in ("POST", "PUT", "PATCH"):
                # Read the body here, capped, so an unannounced (chunked) large body is refused too.
                chunks, size = [], 0
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    body = msg.get("body", b"")
                    size += len(body)
                    if size > limit:
                        return await reply(PayloadTooLargeError(
                            f"request body exceeds the limit (--max-body-bytes) of {limit} bytes"))
                    chunks.append(body)
                    if not msg.get("more_body"):
                        break
                replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

                async def replay_receive():
                    return replay.pop() if replay else await receive()

                return await self.app(scope, replay_receive, send_wrapper)
            return await self.app(scope, receive, send_wrapper)
        finally:
            route = route_template(scope)
            state.metrics.requests.labels(route=route, status=str(status_box["status"])).inc()
            state.metrics.latency.labels(route=route).observe(time.perf_counter() - t0)


UNMATCHED = "unmatched"


def route_template(scope) -> str:
    """The matched route's template (`/v1/indexes/{name}`), else `unmatched`: a metric label never
    holds a string a caller chose (index names, document ids, made-up paths), so the number of
    series is bounded by the routes. A request refused before routing (401, 413, 429) is matched
    here by path against the app's routes."""
    route = scope.get("route")
    if route is not None and getattr(route, "path", None):
        return route.path
    app = scope.get("app")
    if app is None:
        return UNMATCHED
    table = getattr(app.state, "route_templates", None)
    if table is None:                       # built once: the routes are fixed when the app starts
        table = app.state.route_templates = [(r.path_regex, r.path) for r in leaf_routes(app.router.routes)]
    path = scope["path"]
    return next((template for regex, template in table if regex.match(path)), UNMATCHED)


def leaf_routes(routes):
    """The routes that match paths, through included routers of any nesting."""
    for r in routes:
        inner = getattr(r, "routes", None) or getattr(getattr(r, "original_router", None), "routes", None)
        if inner:
            yield from leaf_routes(inner)
        elif getattr(r, "path_regex", None) is not None and getattr(r, "path", None):
            yield r
