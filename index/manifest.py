"""The manifest: which model made an index's vectors, and how. It is the contract that makes
mixed vectors impossible: every open, write and search compares it field by field with the
model at hand and refuses any difference (ConflictError, HTTP 409).

FAISS has no cosine metric, so vectors are L2-normalized by the model and searched by inner
product: the manifest records `metric: "ip"` beside `normalize`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from .durable import atomic_write
from .errors import ConflictError, IndexCorruptError, ValidationError


logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
METRIC = "ip"
DENSE_KINDS = ("flat", "hnsw")


@dataclass(slots=True, frozen=True)
class ModelIdentity:
    """What decides whether two vectors are comparable; built from a model's `ModelSpec`."""

    model: str
    fingerprint: str
    dimension: int
    normalize: bool
    pooling: str
    query_prefix: str
    passage_prefix: str
    has_sparse: bool
    has_colbert: bool = False
    metric: str = METRIC
    # a pair: the sparse side comes from a second model (SPLADE), named here
    sparse_model: str | None = None
    sparse_fingerprint: str | None = None
    # every named prompt applied (name, text), sorted; query / passage are also the prefixes above
    prompts: tuple = ()

    @classmethod
    def from_spec(cls, spec) -> "ModelIdentity":
        """From a model's spec: anything with `name`, `fingerprint`, `dim`, `normalize`, `pooling`, the prefixes and `has_sparse` / `has_colbert`."""
        return cls(model=spec.name, fingerprint=spec.fingerprint, dimension=int(spec.dim),
                   normalize=bool(spec.normalize), pooling=spec.pooling, query_prefix=spec.query_prefix,
                   passage_prefix=spec.passage_prefix, has_sparse=bool(spec.has_sparse),
                   has_colbert=bool(spec.has_colbert),
                   prompts=_prompt_items({**(getattr(spec, "prompts", None) or {}), "query": spec.query_prefix,
                                          "passage": spec.passage_prefix}))

    @property
    def lexical(self) -> str:
        """The lexical side: the model's own sparse head (or the paired SPLADE model's weights),
        else BM25 over the doc text."""
        return "lexical_weights" if self.has_sparse else "bm25"

    @property
    def paired(self) -> bool:
        """Dense from this model, sparse from another (`sparse_model`)."""
        return self.sparse_model is not None

    def prompt_texts(self) -> dict[str, str]:
        return {**dict(self.prompts), "query": self.query_prefix, "passage": self.passage_prefix}

    def with_prompts(self, prompts: dict[str, str]) -> "ModelIdentity":
        """The same model with `prompts` (name -> text) applied instead of its own."""
        merged = {**self.prompt_texts(), **prompts}
        return replace(self, query_prefix=merged["query"], passage_prefix=merged["passage"],
                       prompts=_prompt_items(merged))

    def with_sparse_model(self, spec) -> "ModelIdentity":
        """This model's dense side paired with the sparse vectors of `spec`'s model (SPLADE)."""
        return replace(self, has_sparse=True, sparse_model=spec.name, sparse_fingerprint=spec.fingerprint)


@dataclass(slots=True)
class DenseConfig:
    """Exact (`flat`: IndexFlatIP in an id map) or approximate (`hnsw`) dense search."""

    kind: str = "flat"
    hnsw_m: int = 32
    ef_construction: int = 200
    ef_search: int = 128

    def __post_init__(self):
        if self.kind not in DENSE_KINDS:
            raise ValidationError(f"dense index kind {self.kind!r}: choose flat (exact) or hnsw (approximate)",
                                  param="dense")
        for name in ("hnsw_m", "ef_construction", "ef_search"):
            v = getattr(self, name)
            if not isinstance(v, int) or not 2 <= v <= 4096:
                raise ValidationError(f"{name} must be an integer in [2, 4096], not {v!r}", param=name)


def _prompt_items(prompts: dict) -> tuple:
    return tuple(sorted((str(k), str(v)) for k, v in prompts.items()))


# (field name shown to users, manifest attribute, identity attribute)
CHECKED_FIELDS = (
    ("model", "model", "model"),
    ("fingerprint", "fingerprint", "fingerprint"),
    ("dimension", "dimension", "dimension"),
    ("normalization", "normalize", "normalize"),
    ("metric", "metric", "metric"),
    ("pooling", "pooling", "pooling"),
    ("query_prefix", "query_prefix", "query_prefix"),
    ("passage_prefix", "passage_prefix", "passage_prefix"),
    ("sparse", "sparse", "lexical"),
    ("sparse_model", "sparse_model", "sparse_model"),
    ("sparse_fingerprint", "sparse_fingerprint", "sparse_fingerprint"),
)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(slots=True)
class Manifest:
    """`manifest.json` of one index version."""

    index: str
    version: str
    model: str
    fingerprint: str
    dimension: int
    normalize: bool
    metric: str
    pooling: str
    query_prefix: str
    passage_prefix: str
    dense: bool = True
    sparse: str = "bm25"            # "lexical_weights" (the model's sparse head) | "bm25"
    colbert: bool = False           # ColBERT vectors are not stored (yet)
    sparse_model: str | None = None         # a pair: the model of the sparse side (SPLADE) and its fingerprint
    sparse_fingerprint: str | None = None
    prompts: dict = field(default_factory=dict)     # name -> text of every prompt applied (query/passage too)
    dense_index: dict = field(default_factory=lambda: asdict(DenseConfig()))
    applied_seq: int = 0            # the snapshot files below hold every write up to this sequence number
    files: dict = field(default_factory=dict)       # part -> {"file", "sha256", "bytes"}
    counts: dict = field(default_factory=lambda: {"documents": 0, "dense": 0, "sparse": 0})
    created_at: str = field(default_factory=_now)
    updated_at: str = field(default_factory=_now)
    format_version: int = FORMAT_VERSION

    @classmethod
    def new(cls, index: str, version: str, identity: ModelIdentity, dense: DenseConfig) -> "Manifest":
        return cls(index=index, version=version, model=identity.model, fingerprint=identity.fingerprint,
                   dimension=identity.dimension, normalize=identity.normalize, metric=identity.metric,
                   pooling=identity.pooling, query_prefix=identity.query_prefix,
                   passage_prefix=identity.passage_prefix, sparse=identity.lexical,
                   sparse_model=identity.sparse_model, sparse_fingerprint=identity.sparse_fingerprint,
                   prompts=identity.prompt_texts(), dense_index=asdict(dense))

    @property
    def identity(self) -> ModelIdentity:
        """The identity of the model that built this version (what a write must carry)."""
        return ModelIdentity(model=self.model, fingerprint=self.fingerprint, dimension=self.dimension,
                             normalize=self.normalize, pooling=self.pooling, query_prefix=self.query_prefix,
                             passage_prefix=self.passage_prefix, has_sparse=self.sparse == "lexical_weights",
                             has_colbert=self.colbert, metric=self.metric, sparse_model=self.sparse_model,
                             sparse_fingerprint=self.sparse_fingerprint, prompts=_prompt_items(self.prompt_texts()))

    def prompt_texts(self) -> dict[str, str]:
        """The prompts this version applies (name -> text): the ones recorded, query and passage
        from the prefixes (versions made before named prompts record only those)."""
        return {**self.prompts, "query": self.query_prefix, "passage": self.passage_prefix}

    @property
    def dense_config(self) -> DenseConfig:
        return DenseConfig(**self.dense_index)

    def check(self, identity: ModelIdentity, action: str) -> None:
        """Refuse `action` (open / write / search) unless every field matches the model's."""
        for label, mine, theirs in CHECKED_FIELDS:
            have, want = getattr(self, mine), getattr(identity, theirs)
            if have != want:
                raise ConflictError(
                    f"cannot {action} index {self.index!r} (version {self.version}) with model "
                    f"{identity.model!r}: {label} mismatch: the index has {have!r}, the model has {want!r}; "
                    "use the model the index was built with, or re-embed its documents into a new "
                    "version with this model (a reindex migration)", param=label, code="manifest_mismatch")

    # ------------------------------------------------------------------ files
    def to_json(self) -> bytes:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, indent=2,
                          sort_keys=True).encode() + b"\n"

    def save(self, directory: Path) -> None:
        """Atomically replace `manifest.json` (the commit point of a snapshot)."""
        self.updated_at = _now()
        atomic_write(directory / MANIFEST, self.to_json())

    @classmethod
    def load(cls, directory: Path) -> "Manifest":
        path = directory / MANIFEST
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise IndexCorruptError(f"{path} is missing: {directory} is not an index version") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise IndexCorruptError(f"{path} is unreadable ({exc})") from None
        fmt = raw.get("format_version")
        if fmt != FORMAT_VERSION:
            raise ConflictError(f"{path}: format_version mismatch: the index has {fmt!r}, this library "
                                f"reads {FORMAT_VERSION}; use a matching release",
                                param="format_version", code="manifest_mismatch")
        known = {f.name for f in fields(cls)}
        missing = sorted(known - set(raw) - {"files", "counts", "dense_index", "applied_seq",
                                             "created_at", "updated_at", "dense", "colbert",
                                             "sparse_model", "sparse_fingerprint", "prompts"})
        if missing:
            raise IndexCorruptError(f"{path} lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in raw.items() if k in known})
