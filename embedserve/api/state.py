"""What the routes read: configuration, metrics, the engines once loaded, readiness, indexes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from index.live import LiveIndexes
from index.manifest import ModelIdentity

from ..config import ServerConfig
from ..engine.embed_engine import EmbedEngine
from ..engine.generator import Generator
from ..errors import NotFoundError, UnavailableError
from ..metrics import Metrics
from ..paths import index_root


@dataclass
class AppState:
    """Filled in by the wiring (`embedserve.serve`) as engines come up; read by the routes."""

    config: ServerConfig
    metrics: Metrics = field(default_factory=Metrics)
    embedder: EmbedEngine | None = None
    generator: Generator | None = None
    ready: bool = False
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    indexes: LiveIndexes = field(init=False)

    def __post_init__(self):
        self.indexes = LiveIndexes(index_root(self.config.index_dir))

    @property
    def served_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self.embedder.spec.name if self.embedder is not None else self.config.model

    def require_embedder(self) -> EmbedEngine:
        """The embedding engine, or 503 while it is loading."""
        if not self.ready or self.embedder is None:
            raise UnavailableError("model is loading; retry shortly", retry_after=5)
        return self.embedder

    def identity(self) -> ModelIdentity:
        """The served embedding model's identity (what index manifests are checked against)."""
        return ModelIdentity.from_spec(self.require_embedder().spec)

    def check_model(self, requested: str | None, what: str = "") -> None:
        """404 unless `requested` (a request's `model`) names the served embedding model."""
        engine = self.require_embedder()
        if requested is not None and requested not in (self.served_name, engine.spec.name):
            raise NotFoundError(f"model {requested!r} is not served here; this server serves "
                                f"{self.served_name!r}{what} (GET /v1/models)", param="model")
