"""Operational routes: /health (alive), /ready (models loaded and warm), /metrics, /v1/models."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..errors import UnavailableError
from .errors import error_response
from .state import AppState


def build_router(state: AppState) -> APIRouter:
    """The operational routes, bound to the app's state."""
    router = APIRouter()

    @router.get("/health")
    async def health():
        if any(not e.health() for e in state.embedders.values()):
            return error_response(UnavailableError("an embedding engine thread has stopped"))
        if state.generator is not None and not state.generator.health():
            return error_response(UnavailableError("the generation engine thread has stopped"))
        return {"status": "ok"}

    @router.get("/ready")
    async def ready():
        if state.ready:
            return {"status": "ready", "model": state.served_name}
        if state.load_error:
            return error_response(UnavailableError(f"model failed to load: {state.load_error}"))
        return error_response(UnavailableError("model is loading", retry_after=5))

    @router.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def models():
        data = []
        for name, eng in (state.embedders.items() if state.ready else ()):
            spec = eng.spec
            data.append({"id": name, "object": "model", "created": state.created,
                         "owned_by": "embedserve", "dimensions": spec.dim,
                         "max_input_length": eng.max_input_length, "pooling": spec.pooling,
                         "embedding_types": ["dense"] + sorted(eng.embedding_types - {"dense"}),
                         "dtype": spec.dtype, "fingerprint": spec.fingerprint, "limits": _limits(state, eng)})
        if state.generator is not None:
            g = state.generator
            data.append({"id": g.name, "object": "model", "created": state.created, "owned_by": "embedserve",
                         "max_model_len": g.max_model_len, "task": "generate"})
        return {"object": "list", "data": data}

    return router


def _limits(state: AppState, engine) -> dict:
    """What a client must stay under (embedserve.client splits its requests by these)."""
    cfg = state.config
    return {"max_client_batch_size": cfg.max_client_batch_size, "max_batch_tokens": cfg.max_batch_tokens,
            "max_queued_tokens": cfg.max_queued_tokens, "max_body_bytes": cfg.max_body_bytes,
            "max_input_length": engine.max_input_length}
