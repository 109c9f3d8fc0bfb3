"""Operational routes: /health (alive), /ready (models loaded and warm, index volume not full),
/metrics, /v1/models."""

from __future__ import annotations

import logging
import time
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from index.durable import volume_state

from ..errors import UnavailableError
from .errors import error_response
from .openapi import ErrorEnvelope, route_doc
from .state import AppState, rerank_methods

logger = logging.getLogger(__name__)


class Health(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    status: Literal["ready"]
    model: str = Field(description="the first served embedding model")


class ModelObject(BaseModel):
    """A served model: an embedding model (`task: "embed"`, dimensions, limits, ...), a reranker
    (`task: "rerank"`: a cross-encoder scoring query-document pairs) or the generation model
    (`task: "generate"`, `max_model_len`)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    dimensions: int | None = None
    max_input_length: int | None = None
    pooling: str | None = None
    embedding_types: list[Literal["dense", "sparse", "colbert"]] | None = None
    prompts: dict[str, str] | None = Field(default=None, description="an embedder's named prompts (name -> the text "
                                           "put before the input): `prompt_name` / `input_type` choose one")
    dtype: str | None = None
    fingerprint: str | None = None
    limits: dict[str, int] | None = Field(default=None, description="what one request must stay under")
    max_model_len: int | None = None
    task: Literal["embed", "rerank", "generate"]
    rerank: list[str] | None = Field(default=None, description="how this model reranks (POST /v1/rerank): "
                                     "`cross-encoder`, or an embedder's `scoring` methods")


class ModelList(BaseModel):
    """200 of GET /v1/models (OpenAI's shape, with embedserve's fields per model)."""

    object: Literal["list"]
    data: list[ModelObject]


def build_router(state: AppState) -> APIRouter:
    """The operational routes, bound to the app's state."""
    router = APIRouter()
    root = state.indexes.root                   # None: the indexes are in a database, not on this disk

    def storage() -> tuple[int, bool]:
        if root is None:
            return 0, False
        st = volume_state(root)
        return st.refused, st.full
    state.metrics.watch_storage(storage)

    @router.get("/health", responses={200: {"model": Health, "description": "Every engine alive"},
                                      503: {"model": ErrorEnvelope, "description": "An engine died or stalled"}})
    async def health():
        """Liveness: every engine thread alive and not stuck on one model call."""
        engines = [(n, e) for n, e in state.embedders.items()]
        if state.generator is not None:
            engines.append((state.generator.name, state.generator))
        problems = [f"{name}: {p}" for name, e in engines if (p := e.health_problem())]
        if problems:
            message = "; ".join(problems)
            if message != state.health_logged:          # log each new cause once, not per probe
                logger.error("unhealthy: %s", message)
                state.health_logged = message
            return error_response(UnavailableError(message))
        state.health_logged = None
        return {"status": "ok"}

    @router.get("/ready", responses={
        200: {"model": Ready, "description": "Loaded, warm, not draining, the index volume not full"},
        503: {"model": ErrorEnvelope, "description": "Loading, draining, failed, or the index volume full"}})
    async def ready():
        if state.draining:
            return error_response(UnavailableError("the server is shutting down (draining)", retry_after=5))
        if state.ready:
            st = volume_state(root) if root is not None else None
            if st is not None and st.full:
                # Writes would get 507 here; searches and embeddings still answer.
                since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.full_since))
                return error_response(UnavailableError(
                    f"index writes are refused (507): the volume mounted at {st.volume} is full ({st.reason}; "
                    f"since {since}, {st.refused} refused in all); free space there or grow it, and writes "
                    "succeed again without a restart; searches still answer", retry_after=30, code="storage_full"))
            return {"status": "ready", "model": state.served_name}
        if state.load_error:
            return error_response(UnavailableError(f"model failed to load: {state.load_error}"))
        return error_response(UnavailableError("model is loading", retry_after=5))

    @router.get("/metrics", **route_doc(text=True))
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models", **route_doc(ok=ModelList))
    async def models():
        data = []
        for name, eng in (state.embedders.items() if state.ready else ()):
            spec = eng.spec
            row = {"id": name, "object": "model", "created": state.created, "owned_by": "embedserve",
                   "task": eng.task, "max_input_length": eng.max_input_length, "dtype": spec.dtype,
                   "fingerprint": spec.fingerprint, "limits": _limits(state, eng)}
            if eng.task == "embed":
                row.update(dimensions=spec.dim, pooling=spec.pooling,
                           embedding_types=sorted(eng.embedding_types, key=lambda t: (t != "dense", t)),
                           prompts=dict(eng.prompts))
            methods = rerank_methods(eng)
            if methods:
                row["rerank"] = methods
            data.append(row)
        if state.generator is not None:
            g = state.generator
            model = g.engine.model
            row = {"id": g.name, "object": "model", "created": state.created, "owned_by": "embedserve",
                   "max_model_len": g.max_model_len, "task": "generate",
                   "dtype": str(model.dtype).removeprefix("torch."),
                   "decode_weights": getattr(model, "linear_weights", "native")}
            if g.gate is not None:
                row["int8_gate"] = {k: g.gate[k] for k in ("passed", "reason", "ppl_ratio", "equal", "ties", "prompts")}
            data.append(row)
        return {"object": "list", "data": data}

    return router


def _limits(state: AppState, engine) -> dict:
    """What a client must stay under (embedserve.client splits its requests by these)."""
    cfg = state.config
    return {"max_client_batch_size": cfg.http.max_client_batch_size, "max_batch_tokens": cfg.embed.max_batch_tokens,
            "max_queued_tokens": cfg.embed.max_queued_tokens, "max_body_bytes": cfg.http.max_body_bytes,
            "max_input_length": engine.max_input_length}
