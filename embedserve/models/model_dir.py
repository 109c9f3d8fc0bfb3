"""What a model directory says about itself, read without loading weights: its conventions
(pooling, normalization, prompts), its kind (embedder, cross-encoder, SPLADE) by architecture,
and its fingerprint."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def read_conventions(path: Path) -> dict:
    """Pooling, normalization and prompts from `embedserve_model.json`, else from a
    sentence-transformers layout, else BGE-M3's (CLS) when its heads are present. Named prompts:
    `prompts` (and `default_prompt_name`) of embedserve_model.json, else of sentence-transformers'
    `config_sentence_transformers.json`."""
    own = path / "embedserve_model.json"
    st = path / "config_sentence_transformers.json"
    st_conf = json.loads(st.read_text()) if st.exists() else {}
    if own.exists():
        conv = json.loads(own.read_text())
        conv.setdefault("prompts", st_conf.get("prompts") or {})
        conv.setdefault("default_prompt_name", st_conf.get("default_prompt_name"))
        return conv
    prompts = {str(k): str(v) for k, v in (st_conf.get("prompts") or {}).items()}
    conv = {"pooling": "mean", "normalize": True, "prompts": prompts,
            "query_prefix": prompts.get("query", ""), "passage_prefix": prompts.get("passage", prompts.get("document", "")),
            "default_prompt_name": st_conf.get("default_prompt_name")}
    pooling_cfg = path / "1_Pooling" / "config.json"
    if (path / "sparse_linear.pt").exists() or (path / "colbert_linear.pt").exists():
        conv["pooling"] = "cls"
    elif pooling_cfg.exists():
        p = json.loads(pooling_cfg.read_text())
        conv["pooling"] = "cls" if p.get("pooling_mode_cls_token") else "mean"
    else:
        logger.warning("%s states no pooling; using mean pooling with L2 normalization "
                       "(write embedserve_model.json to say otherwise)", path)
    modules = path / "modules.json"
    if modules.exists():
        types = [m.get("type", "") for m in json.loads(modules.read_text())]
        conv["normalize"] = any(t.endswith("Normalize") for t in types) or conv["pooling"] == "cls"
    return conv


def _architectures(path: Path) -> list[str]:
    try:
        return [str(a) for a in json.loads((Path(path) / "config.json").read_text()).get("architectures") or []]
    except (OSError, ValueError, AttributeError):
        return []


def is_cross_encoder(path: Path) -> bool:
    """A `*ForSequenceClassification` checkpoint (config.json's `architectures`): a reranker."""
    return any(a.endswith("ForSequenceClassification") for a in _architectures(path))


def is_splade(path: Path) -> bool:
    """A `*ForMaskedLM` checkpoint: served as a SPLADE sparse encoder (`models.splade`)."""
    return any(a.endswith("ForMaskedLM") for a in _architectures(path))


def fingerprint_dir(path: Path) -> str:
    """sha256 over the weights, heads and tokenizer: two models share it only if identical.
    Hashed once per process while the files are unchanged (the memory plan and the loaded
    model both need it; a model's weights are hundreds of MB)."""
    path = Path(path).resolve()
    names = sorted(p.name for p in path.iterdir()
                   if p.suffix in (".safetensors", ".pt") or p.name in ("tokenizer.json", "config.json"))
    stats = tuple((n, st.st_size, st.st_mtime_ns) for n in names for st in [(path / n).stat()])
    return _fingerprint(path, stats)


@functools.lru_cache(maxsize=32)
def _fingerprint(path: Path, stats: tuple) -> str:
    h = hashlib.sha256()
    for name, _size, _mtime in stats:
        h.update(name.encode())
        with open(path / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()
