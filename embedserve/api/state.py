"""What the routes read: configuration, metrics, the engines once loaded, readiness, indexes."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from index.errors import ConflictError
from index.live import LiveIndexes
from index.manifest import ModelIdentity

from ..config import ServerConfig
from ..engine.embed_engine import EmbedEngine
from ..engine.generator import Generator
from ..errors import NotFoundError, UnavailableError, UnsupportedError
from ..metrics import Metrics
from ..models.scoring import M3_METHODS
from ..paths import index_root
from .auth import KeyRing


def can_rerank(engine: EmbedEngine) -> bool:
    """A cross-encoder, or an embedder with a ColBERT head (BGE-M3's late interaction)."""
    return bool(rerank_methods(engine))


def rerank_methods(engine: EmbedEngine) -> list[str]:
    """How `engine` reranks: a cross-encoder, or BGE-M3's scores from the heads it has."""
    if engine.task == "rerank":
        return ["cross-encoder"]
    if "colbert" not in engine.embedding_types:
        return []
    heads = engine.embedding_types
    return [m for m in M3_METHODS if all(part in heads for part in m.split("+"))]


@dataclass
class AppState:
    """Filled in by the wiring (`embedserve.serve`) as engines come up; read by the routes."""

    config: ServerConfig
    metrics: Metrics = field(default_factory=Metrics)
    # served name -> engine of every encoder, embedders and rerankers (`engine.task`); the first
    # embedder is the default for embeddings, the first reranker for reranking
    embedders: dict[str, EmbedEngine] = field(default_factory=dict)
    generator: Generator | None = None
    ready: bool = False
    load_error: str | None = None
    draining: bool = False              # SIGTERM seen: /ready 503, new requests 503, in-flight ones finish
    inflight: int = 0                   # requests being answered (the middleware counts them)
    health_logged: str | None = None    # the last unhealthy cause logged
    loader: threading.Thread | None = None  # the thread loading the models at start-up, if any
    created: int = field(default_factory=lambda: int(time.time()))
    indexes: LiveIndexes = field(init=False)
    keys: KeyRing = field(init=False, repr=False)       # the accepted API keys (ConfigError at start)

    def __post_init__(self):
        self.keys = KeyRing(self.config)
        ic = self.config.index
        if ic.index_url:
            from index.backend import open_store
            self.indexes = LiveIndexes(store=open_store(ic.index_url, schema=ic.index_schema,
                                                        pool_size=ic.index_pool_size))
        else:
            self.indexes = LiveIndexes(index_root(ic.index_dir))

    @property
    def embedder(self) -> EmbedEngine | None:
        """The default embedding engine (the first embedding `--model`)."""
        return next(iter(self.engines("embed").values()), None)

    def engines(self, task: str) -> dict[str, EmbedEngine]:
        """The served encoders of `task` ("embed" | "rerank"), by name, in `--model` order."""
        return {n: e for n, e in self.embedders.items() if e.task == task}

    @property
    def served_name(self) -> str:
        return (next(iter(self.engines("embed")), None) or next(iter(self.embedders), None)
                or self.config.http.served_model_name or self.config.embed.models[0])

    def add_embedder(self, engine: EmbedEngine) -> str:
        """Serve `engine`'s model; the first one takes `--served-model-name`. Returns its name."""
        name = (self.config.http.served_model_name if not self.embedders and self.config.http.served_model_name
                else engine.spec.name)
        self.embedders[name] = engine
        return name

    def name_of(self, engine: EmbedEngine) -> str:
        return next(n for n, e in self.embedders.items() if e is engine)

    def require_embedder(self, requested: str | None = None, what: str = "") -> EmbedEngine:
        """The engine of `requested` (a request's `model`; None: the default), 503 while loading,
        404 naming the served models if it is not one of them."""
        engine = self.find(requested, what)
        if engine is None or engine.task == "embed":
            if engine is None and self.embedder is None:
                raise UnsupportedError(f"this server serves no embedding model, only {self._served('rerank')}; "
                                       "start it with an embedding --model", param="model")
            return engine or self.embedder
        raise UnsupportedError(f"model {requested!r} is a reranker (it scores query-document pairs: POST "
                               f"/v1/rerank); embedding models served here: {self._served('embed') or 'none'}",
                               param="model")

    def require_reranker(self, requested: str | None = None) -> EmbedEngine:
        """The engine that reranks for `requested` (None: the first cross-encoder, else the first
        embedder with a ColBERT head): a cross-encoder, or a BGE-M3-style embedder; a 400 naming
        the models that can when `requested` cannot."""
        engine = self.find(requested)
        able = {n: e for n, e in self.embedders.items() if can_rerank(e)}
        if engine is None:
            engine = next(iter(self.engines("rerank").values()), None) or next(iter(able.values()), None)
            if engine is None:
                raise UnsupportedError("this server serves no model that reranks: start it with a cross-encoder "
                                       "(--model ms-marco-MiniLM-L-12-v2) or a BGE-M3 model", param="model")
        if not can_rerank(engine):
            names = ", ".join(repr(n) for n in able) or "none"
            raise UnsupportedError(f"model {requested!r} is an embedding model without a ColBERT head and cannot "
                                   f"rerank; models served here that can: {names}", param="model")
        return engine

    def find(self, requested: str | None, what: str = "", also: list[str] = ()) -> EmbedEngine | None:
        """The encoder serving `requested` (None: None), 503 while loading, 404 naming the served
        models (and `also`, names served otherwise: the decoder)."""
        if not self.ready or not self.embedders:
            raise UnavailableError("model is loading; retry shortly", retry_after=5)
        if requested is None:
            return None
        for name, engine in self.embedders.items():
            if requested in (name, engine.spec.name):
                return engine
        served = ", ".join(repr(n) for n in [*self.embedders, *also])
        raise NotFoundError(f"model {requested!r} is not served here; this server serves {served}{what} "
                            "(GET /v1/models)", param="model")

    def _served(self, task: str) -> str:
        return ", ".join(repr(n) for n in self.engines(task))

    def identity(self, engine: EmbedEngine | None = None) -> ModelIdentity:
        """An engine's model identity (default engine): what index manifests are checked against."""
        return ModelIdentity.from_spec((engine or self.require_embedder()).spec)

    def engine_for_index(self, manifest) -> EmbedEngine:
        """The served engine whose model built this index version (its dense side)."""
        return self.engines_for_index(manifest)[0]

    def engines_for_index(self, manifest) -> tuple[EmbedEngine, EmbedEngine | None]:
        """(the engine of the model that built this index version, the engine of its paired
        sparse model or None); if none matches, the manifest's own 409 against the default model
        (never embed a query with one model to search another's)."""
        self.require_embedder()
        sparse = None
        if manifest.sparse_model is not None:
            sparse = next((e for e in self.engines("embed").values() if e.spec.name == manifest.sparse_model), None)
            if sparse is None:
                raise ConflictError(f"index {manifest.index!r} pairs its dense vectors with the sparse model "
                                    f"{manifest.sparse_model!r}, which this server does not serve; start it with "
                                    f"--model {manifest.sparse_model} as well", param="sparse_model",
                                    code="manifest_mismatch")
        for engine in self.engines("embed").values():
            if not engine.spec.has_dense:
                continue
            try:
                manifest.check(self.index_identity(engine, sparse, manifest), "serve")
                return engine, sparse
            except ConflictError:
                continue
        manifest.check(self.index_identity(self.embedder, sparse, manifest), "serve")   # the default's 409, by field
        return self.embedder, sparse

    def index_identity(self, engine: EmbedEngine, sparse: EmbedEngine | None = None, manifest=None) -> ModelIdentity:
        """What an index of `engine`'s dense vectors (paired with `sparse`'s) is checked against:
        with `manifest`, the prompts that version records (an index applies its own prompts, so a
        prompt migration's version is served by the same model)."""
        ident = self.identity(engine)
        if sparse is not None:
            ident = ident.with_sparse_model(sparse.spec)
        return ident.with_prompts(manifest.prompt_texts()) if manifest is not None else ident
