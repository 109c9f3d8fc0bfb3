"""The GPU study's model pack (embedserve/studies/gpu.py): the bundled models travel to a lent GPU
machine without their weights, and come back loadable with random weights of the same shapes."""

from __future__ import annotations

import json

import numpy as np
from safetensors import safe_open

from embedserve.models.embedding_model import EmbeddingModel
from embedserve.studies import gpu


def _tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def test_a_packed_model_has_no_weights_and_comes_back_with_the_same_shapes(tmp_path, minilm_dir):
    gpu.pack(tmp_path / "pack", ["all-MiniLM-L6-v2"])
    packed = tmp_path / "pack" / "all-MiniLM-L6-v2"
    assert not list(packed.rglob("*.safetensors"))
    assert sum(f.stat().st_size for f in packed.rglob("*")) < 5e6           # travels in a 64 MiB call
    assert json.loads((packed / "shapes.json").read_text())["kind"] == "encoder"
    made = gpu.materialize(packed, tmp_path / "made")
    real, fake = _tensors(minilm_dir), _tensors(made)
    assert sorted(real) == sorted(fake)
    for k, t in real.items():
        assert fake[k].shape == t.shape and fake[k].dtype == t.dtype, k
    norm = next(k for k in fake if "LayerNorm.weight" in k)
    bias = next(k for k in fake if k.endswith("dense.bias"))
    dense = next(k for k in fake if k.endswith("query.weight"))
    assert (fake[norm] == 1).all() and (fake[bias] == 0).all()
    assert 0.015 < float(fake[dense].float().std()) < 0.025 and not np.allclose(fake[dense], real[dense])
    # the same seed makes the same weights: the GPU side and a CPU side compare like for like
    again = _tensors(gpu.materialize(packed, tmp_path / "again"))
    assert all((again[k] == fake[k]).all() for k in fake)
    model = EmbeddingModel(made, name="random-minilm", dtype="float32")
    vec = model.embed(model.tokenize(["hello world", "你好"]), {"dense"})[0][0].dense
    assert vec.shape == (384,) and abs(float(np.linalg.norm(vec)) - 1) < 1e-5
