"""FastAPI application: converts schemas and errors, and nothing else.

Model work happens on the engine thread; the event loop only validates, tokenizes (in the
thread pool: fast tokenizers release the GIL), waits, and serializes.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError as PydanticValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..config import ServerConfig
from ..engine.embed_engine import EmbedEngine, EmbedEngineConfig
from ..engine.queue import EmbedRequest
from ..errors import (AuthenticationError, EmbedServeError, NotFoundError, PayloadTooLargeError,
                      UnavailableError, UnsupportedError, ValidationError)
from ..metrics import Metrics
from ..models.embedding_model import EmbeddingModel
from .schemas import EmbeddingRequest, parse_inputs

logger = logging.getLogger(__name__)

_OPEN_PATHS = ("/health", "/ready")


@dataclass
class AppState:
    """What the routes read: config, the model once loaded, the engine, readiness."""

    config: ServerConfig
    metrics: Metrics = field(default_factory=Metrics)
    model: EmbeddingModel | None = None
    engine: EmbedEngine | None = None
    max_input_length: int = 0
    ready: bool = False
    load_error: str | None = None
    generator: object | None = None          # generate_routes.Generator once the decoder is up
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def served_name(self) -> str:
        return self.config.served_model_name or (self.model.spec.name if self.model else self.config.model)

    def install(self, model: EmbeddingModel) -> None:
        """Attach a loaded model: check limits, warm up, start the engine, become ready."""
        cfg = self.config
        self.max_input_length = cfg.check_model_limits(model.max_input_length)
        model.embed(model.tokenize(["warm-up", "预热 " * 64]), {"dense"} | _heads(model))
        engine = EmbedEngine(model, EmbedEngineConfig(
            max_batch_tokens=cfg.max_batch_tokens, max_batch_size=cfg.max_batch_size,
            max_queued_tokens=cfg.max_queued_tokens, max_concurrent_requests=cfg.max_concurrent_requests),
            self.metrics)
        engine.start()
        self.model, self.engine = model, engine
        self.ready = True
        logger.info("model %s ready (%s, dim %d, max input %d tokens)", self.served_name,
                    model.spec.dtype, model.spec.dim, self.max_input_length)


def _heads(model: EmbeddingModel) -> set[str]:
    return ({"sparse"} if model.spec.has_sparse else set()) | ({"colbert"} if model.spec.has_colbert else set())


def error_response(exc: EmbedServeError) -> JSONResponse:
    """The one place where error kinds become HTTP statuses."""
    headers = {}
    if hasattr(exc, "retry_after"):
        headers["Retry-After"] = str(exc.retry_after)
    return JSONResponse(exc.to_envelope(), status_code=exc.status_code, headers=headers)


class GuardMiddleware:
    """Pure ASGI: bearer-token auth, a hard body-size cap (413), per-route metrics."""

    def __init__(self, app, state: AppState):
        self.app = app
        self.state = state

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
            state.metrics.errors.labels(type=exc.error_type).inc()
            await error_response(exc)(scope, receive, send_wrapper)

        try:
            key = state.config.api_key
            if key and path not in _OPEN_PATHS:
                headers = dict(scope["headers"])
                auth = headers.get(b"authorization", b"").decode("latin-1")
                token = auth[7:] if auth[:7].lower() == "bearer " else ""
                if not hmac.compare_digest(token.encode(), key.encode()):
                    return await reply(AuthenticationError(
                        "missing or wrong API key; send `Authorization: Bearer <key>`"))
            limit = state.config.max_body_bytes
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
            route = path if path.startswith(("/v1/", "/health", "/ready", "/metrics")) else "other"
            state.metrics.requests.labels(route=route, status=str(status_box["status"])).inc()
            state.metrics.latency.labels(route=route).observe(time.perf_counter() - t0)


async def _parse_body(request: Request, schema):
    """JSON whatever the Content-Type says (curl's default is form-encoded), then the schema."""
    raw = await request.body()
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValidationError(f"request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(obj, dict):
        raise ValidationError(f"request body must be a JSON object, not {type(obj).__name__}")
    try:
        return schema.model_validate(obj)
    except PydanticValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    where = f"`{param}`: " if param else ""
    return f"{where}{e.get('msg', 'invalid value')}", param


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (uvicorn sends http.disconnect once the body is read)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def embed_via_engine(state: AppState, inputs: list[list[int]], want: set[str],
                           request: Request | None = None) -> EmbedRequest | None:
    """Submit token-id inputs to the engine and wait; None if the client went away first
    (its queued inputs are then dropped before the model runs them). Raises typed errors."""
    if not state.ready:
        raise UnavailableError("model is loading; retry shortly", retry_after=5)
    engine = state.engine
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def on_done(r):
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(r))

    req = EmbedRequest(inputs=inputs, want=frozenset(want), on_done=on_done)
    engine.submit(req)
    state.metrics.tokens.inc(req.num_tokens)
    waiters = {done}
    gone = asyncio.ensure_future(_wait_disconnect(request)) if request is not None else None
    if gone is not None:
        waiters.add(gone)
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        engine.abort(req)
        raise
    finally:
        if gone is not None:
            gone.cancel()
    if not done.done():
        engine.abort(req)
        logger.info("client went away; dropped a request of %d inputs", len(inputs))
        return None
    if req.error is not None:
        if isinstance(req.error, EmbedServeError):
            raise req.error
        raise UnavailableError("the model failed on this batch; retry", retry_after=1)
    return req


def create_app(config: ServerConfig, model: EmbeddingModel | None = None,
               loader: Callable[[], EmbeddingModel] | None = None,
               on_load_error: Callable[[BaseException], None] | None = None,
               generator=None, gen_loader: Callable[[], object] | None = None) -> FastAPI:
    """Build the app. Pass a loaded `model` (and `generator`), or loaders run on a thread at
    start-up (the server answers /health at once; /ready turns 200 once all models are warm)."""
    state = AppState(config=config)

    def start_generator(gen) -> None:
        gen.engine.metrics = state.metrics
        gen.engine.start()
        state.generator = gen

    def load():
        try:
            if gen_loader is not None:
                start_generator(gen_loader())
            state.install(loader())
        except BaseException as exc:  # reported through /ready and the callback
            logger.exception("model failed to load")
            state.load_error = f"{type(exc).__name__}: {exc}"
            if on_load_error:
                on_load_error(exc)

    @asynccontextmanager
    async def lifespan(app):
        if generator is not None:
            start_generator(generator)
        if model is not None:
            state.install(model)
        elif loader is not None:
            threading.Thread(target=load, name="model-loader", daemon=True).start()
        yield
        if state.engine:
            state.engine.stop()
        if state.generator is not None:
            state.generator.engine.stop()

    app = FastAPI(title="embedserve", version=__version__, lifespan=lifespan)
    app.state.embedserve = state
    app.add_middleware(GuardMiddleware, state=state)

    @app.exception_handler(EmbedServeError)
    async def _typed(request: Request, exc: EmbedServeError):
        state.metrics.errors.labels(type=exc.error_type).inc()
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        state.metrics.errors.labels(type="invalid_request_error").inc()
        return error_response(ValidationError(msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        err = EmbedServeError(str(exc.detail))
        err.status_code = exc.status_code
        err.error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        if exc.status_code == 404:
            err.message = f"no route {request.method} {request.url.path}; see /docs for the API"
        return error_response(err)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        state.metrics.errors.labels(type="server_error").inc()
        return error_response(EmbedServeError("internal error; see the server log"))

    @app.get("/health")
    async def health():
        if state.engine is not None and not state.engine.health():
            return error_response(UnavailableError("the embedding engine thread has stopped"))
        if state.generator is not None and not state.generator.engine.health():
            return error_response(UnavailableError("the generation engine thread has stopped"))
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if state.ready:
            return {"status": "ready", "model": state.served_name}
        if state.load_error:
            return error_response(UnavailableError(f"model failed to load: {state.load_error}"))
        return error_response(UnavailableError("model is loading", retry_after=5))

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        data = []
        if state.model is not None:
            spec = state.model.spec
            data.append({"id": state.served_name, "object": "model", "created": state.created,
                         "owned_by": "embedserve", "dimensions": spec.dim,
                         "max_input_length": state.max_input_length, "pooling": spec.pooling,
                         "embedding_types": ["dense"] + sorted(_heads(state.model)), "dtype": spec.dtype})
        if state.generator is not None:
            g = state.generator
            data.append({"id": g.name, "object": "model", "created": state.created, "owned_by": "embedserve",
                         "max_model_len": g.engine.config.max_model_len, "task": "generate"})
        return {"object": "list", "data": data}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await _parse_body(request, EmbeddingRequest)
        if not state.ready:
            raise UnavailableError("model is loading; retry shortly", retry_after=5)
        model_ = state.model
        spec = model_.spec
        if body.model is not None and body.model not in (state.served_name, spec.name):
            raise NotFoundError(f"model {body.model!r} is not served here; this server serves "
                                f"{state.served_name!r} (GET /v1/models)", param="model")
        if body.dimensions is not None and body.dimensions != spec.dim:
            raise UnsupportedError(f"model {state.served_name!r} has {spec.dim} dimensions and was not "
                                   "trained to be shortened (Matryoshka); omit `dimensions`",
                                   param="dimensions")
        want = set(body.embedding_types or ["dense"])
        missing = sorted(want - {"dense"} - _heads(model_))
        if missing:
            raise UnsupportedError(f"model {state.served_name!r} has no {' or '.join(missing)} head "
                                   "(a BGE-M3 directory with sparse_linear.pt / colbert_linear.pt has); "
                                   "request embedding_types=['dense']", param="embedding_types")
        texts, id_lists = parse_inputs(body.input, state.config.max_client_batch_size)
        if texts is not None:
            inputs = await run_in_threadpool(model_.tokenize, texts, body.input_type)
        else:
            if body.input_type and model_.prefixes.get(body.input_type):
                raise ValidationError("`input_type` adds a text prefix and cannot apply to token-id input; "
                                      "send text, or include the prefix tokens yourself", param="input_type")
            vocab = spec.vocab_size
            for i, ids in enumerate(id_lists):
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise ValidationError(f"input {i} has token id {bad}, outside this model's vocabulary "
                                          f"[0, {vocab})", param="input")
            inputs = [model_.wrap_token_ids(ids) for ids in id_lists]
        limit = state.max_input_length
        truncated = []
        for i, ids in enumerate(inputs):
            if len(ids) > limit:
                if not body.truncate:
                    raise ValidationError(f"input {i} has {len(ids):,} tokens; the limit is {limit:,}; send "
                                          "shorter input or set truncate=true", param="input",
                                          code="context_length_exceeded")
                inputs[i] = model_.truncate(ids, limit)
                truncated.append(i)

        req = await embed_via_engine(state, inputs, want, request)
        if req is None:
            return Response(status_code=499)
        payload = await run_in_threadpool(_render, req, body, state.served_name, truncated)
        return Response(payload, media_type="application/json")

    from .generate_routes import build_router as build_generate_router
    app.include_router(build_generate_router(state))
    from .index_routes import build_router as build_index_router
    app.include_router(build_index_router(state))
    return app


def _render(req: EmbedRequest, body: EmbeddingRequest, name: str, truncated: list[int]) -> bytes:
    data = []
    b64 = body.encoding_format == "base64"
    for i, out in enumerate(req.outputs):
        item: dict = {"object": "embedding", "index": i}
        if out.dense is not None:
            v = out.dense.astype("<f4", copy=False)
            item["embedding"] = base64.b64encode(v.tobytes()).decode("ascii") if b64 else v.tolist()
        if out.sparse is not None:
            ids, w = out.sparse
            item["sparse_embedding"] = {"indices": ids.tolist(), "values": w.tolist()}
        if out.colbert is not None:
            item["colbert_embedding"] = out.colbert.astype(np.float32, copy=False).tolist()
        data.append(item)
    usage = {"prompt_tokens": req.num_tokens, "total_tokens": req.num_tokens}
    if truncated:
        usage["truncated_inputs"] = truncated
    return json.dumps({"object": "list", "data": data, "model": name, "usage": usage},
                      separators=(",", ":")).encode()
