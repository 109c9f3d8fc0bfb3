"""What the routes read: configuration, metrics, the engines once loaded, readiness, indexes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from index.errors import ConflictError
from index.live import LiveIndexes
from index.manifest import ModelIdentity

from ..config import ServerConfig
from ..engine.embed_engine import EmbedEngine
from ..engine.generator import Generator
from ..errors import NotFoundError, UnavailableError
from ..metrics import Metrics
from ..paths import index_root
from .auth import KeyRing


@dataclass
class AppState:
    """Filled in by the wiring (`embedserve.serve`) as engines come up; read by the routes."""

    config: ServerConfig
    metrics: Metrics = field(default_factory=Metrics)
    embedders: dict[str, EmbedEngine] = field(default_factory=dict)    # served name -> engine; first = default
    generator: Generator | None = None
    ready: bool = False
    load_error: str | None = None
    draining: bool = False              # SIGTERM seen: /ready 503, new requests 503, in-flight ones finish
    inflight: int = 0                   # requests being answered (the middleware counts them)
    health_logged: str | None = None    # the last unhealthy cause logged
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
        """The default embedding engine (the first `--model`)."""
        return next(iter(self.embedders.values()), None)

    @property
    def served_name(self) -> str:
        return next(iter(self.embedders), None) or self.config.http.served_model_name or self.config.embed.models[0]

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
        if not self.ready or not self.embedders:
            raise UnavailableError("model is loading; retry shortly", retry_after=5)
        if requested is None:
            return self.embedder
        for name, engine in self.embedders.items():
            if requested in (name, engine.spec.name):
                return engine
        served = ", ".join(repr(n) for n in self.embedders)
        raise NotFoundError(f"model {requested!r} is not served here; this server serves {served}{what} "
                            "(GET /v1/models)", param="model")

    def identity(self, engine: EmbedEngine | None = None) -> ModelIdentity:
        """An engine's model identity (default engine): what index manifests are checked against."""
        return ModelIdentity.from_spec((engine or self.require_embedder()).spec)

    def engine_for_index(self, manifest) -> EmbedEngine:
        """The served engine whose model built this index version; if none, the manifest's own
        409 against the default model (never embed a query with one model to search another's)."""
        self.require_embedder()
        for engine in self.embedders.values():
            try:
                manifest.check(self.identity(engine), "serve")
                return engine
            except ConflictError:
                continue
        manifest.check(self.identity(), "serve")       # raises the default model's 409, field by field
        return self.embedder
