"""`make bench`'s encoder comparison (embedserve.studies.compare.encoder_peers): the ONNX graph the
bench exports, run by ONNX Runtime on padded batches, computes what our encoder computes; and its
section's table and `--only encoder` merge, on a small result of known numbers."""

from __future__ import annotations

import json

import numpy as np
import torch

from embedserve.studies import compare
from embedserve.studies.compare import encoder_peers, encoder_worker
from helpers import BGE_M3_DIR

TEXTS = ["a short one", "retrieval finds the closest passages about rivers and cities " * 6,
         "检索系统把文档切成段落", "the trains run late in spring", "x"]


def test_the_exported_graph_equals_our_encoder_on_padded_batches(tmp_path):
    """The tiny XLM-R fixture, fp32: ONNX Runtime on the exported graph, one padded batch of texts
    of 3..~80 tokens, against our packed encoder row by row and against our pooled vectors. 1e-4:
    both are fp32 through the same weights; they differ only in summation order (~1e-6 here)."""
    from embedserve.models.embedding_model import EmbeddingModel
    from embedserve.models.encoder import AttentionPlan
    model = EmbeddingModel(BGE_M3_DIR, name="tiny-bge-m3", dtype="float32")
    ids = sorted((model.truncate(x) for x in model.tokenize(TEXTS)), key=len, reverse=True)
    lengths = [len(x) for x in ids]
    assert lengths[0] > 4 * lengths[-1]                   # padding in the batch is the point
    onnx = tmp_path / "tiny.onnx"
    names = encoder_peers.export_onnx(BGE_M3_DIR, onnx)
    input_ids, mask = encoder_peers.pad_batch(ids, model.cfg.pad_token_id)
    run, session_names, _, _ = encoder_worker.onnxruntime_runner(str(onnx), threads=2)
    assert session_names == names
    (feed,) = encoder_worker.feeds([{"input_ids": input_ids, "attention_mask": mask}], session_names)
    theirs = run(feed)                                                    # (B, S, H)
    assert theirs.shape == (*input_ids.shape, model.cfg.hidden_size)

    with torch.inference_mode():
        packed = torch.tensor([t for x in ids for t in x])
        pos = torch.cat([torch.arange(L) for L in lengths])
        ours_h = model.encoder(packed, pos, AttentionPlan.build(lengths), None).float().numpy()   # (T, H)
    theirs_h = np.concatenate([theirs[k, :L] for k, L in enumerate(lengths)])
    np.testing.assert_allclose(theirs_h, ours_h, atol=1e-4, rtol=0)

    dense = np.stack([o.dense for o in model.embed(ids, {"dense"})[0]])
    np.testing.assert_allclose(encoder_peers.pooled(model, theirs, lengths), dense, atol=1e-4, rtol=0)
    assert encoder_peers.agreement(dense, encoder_peers.pooled(model, theirs, lengths))["min_cosine"] > 0.9999


def _side(tps: float, version: str | None = None) -> dict:
    return {"tokens_per_s": tps, "seconds": [1.0], **({"version": version} if version else {})}


def _section(openvino_missing: bool = False) -> dict:
    models = {}
    for model in compare.EMBED_MODELS:
        fp32 = {"ours": _side(9000.0), "precision": {"ours": "float32"}}
        if openvino_missing:
            fp32["openvino"] = fp32["onnxruntime"] = {"not_run": "not installed (x missing)"}
        else:
            fp32.update(openvino=_side(6000.0, "2026.4.1-22982-e213a147257-releases/2026/4"),
                        onnxruntime=_side(4500.0, "1.32.0"),
                        agreement={"openvino": {"max_abs_diff": 1e-7, "min_cosine": 1.0},
                                   "onnxruntime": {"max_abs_diff": 2e-7, "min_cosine": 0.9999999}})
        models[model] = {"workload": {"texts": 512, "tokens": 36000, "padded_tokens": 41000, "batches": 9},
                         "float32": fp32,
                         "bfloat16": {"ours": _side(20000.0), "openvino": _side(16000.0, "2026.4.1-22982")}}
    return {"threads": 2, "budget": 4096, "opset": 17, "models": models,
            "run": {"command": "python -m embedserve.studies.compare --only encoder", "date": "2026-12-02", "runs": 3,
                    "machine": {"cpu": "Test CPU", "cores": 2}, "cpu_flags": ["avx2"], "minutes": 12.0}}


def test_the_table_gives_each_side_and_the_ratios():
    md = "\n".join(compare.encoder_markdown(_section()))
    assert "| embedserve | OpenVINO 2026.4.1 | ONNX Runtime 1.32.0 |" in md
    assert "| all-MiniLM-L6-v2 | float32 | 36,000 (41,000) | 9000 | 6000 | 4500 | 1.50× | 2.00× |" in md
    # bf16: ours and OpenVINO; ONNX Runtime runs fp32 only, said so
    assert "| multilingual-e5-small | bfloat16 | 36,000 (41,000) | 20000 | 16000 | not run (fp32 only) | 1.25× | — |" in md
    assert "5 rounds alternating the sides" in md and "Test CPU, 2 cores, CPU flags avx2" in md
    assert "lowest cosine 0.9999999" in md


def test_a_missing_peer_is_said_not_estimated():
    md = "\n".join(compare.encoder_markdown(_section(openvino_missing=True)))
    assert "| all-MiniLM-L6-v2 | float32 | 36,000 (41,000) | 9000 | not installed (x missing) | " \
           "not installed (x missing) | — | — |" in md
    assert "Agreement" not in md


def test_only_encoder_replaces_its_section_and_keeps_the_rest(tmp_path, monkeypatch):
    """`--only encoder` on a result without a full run: the section is written, the others kept,
    the markdown is the section's alone and BENCHMARKS.md is left as it was."""
    (tmp_path / "BENCHMARKS.md").write_text("<!-- make-bench:begin -->\nold\n<!-- make-bench:end -->\n")
    monkeypatch.setattr(compare, "ROOT", tmp_path)
    out = tmp_path / "compare.json"
    out.write_text(json.dumps({"rerank": {"kept": True}, "encoder": {"old": True}}))
    assert compare.merge_section(out, "encoder", _section()) == 0
    res = json.loads(out.read_text())
    assert res["rerank"] == {"kept": True} and res["encoder"]["models"]["all-MiniLM-L6-v2"]["float32"]["ours"]
    assert out.with_suffix(".md").read_text().startswith("### Encoder in process")
    assert "old" in (tmp_path / "BENCHMARKS.md").read_text()
