"""`python -m embedserve.studies.http_path`: the cut model it serves as a stand-in for a faster
CPU, a revision git does not know refused with its reason, the table rendered."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from embedserve.studies import http_path


def test_the_cut_model_keeps_its_first_layers(minilm_dir, tmp_path):
    from embedserve.models.embedding_model import EmbeddingModel
    cut = http_path.cut_model(minilm_dir, 1, tmp_path / "one-layer")
    assert (cut / "model.safetensors").is_symlink() and not (cut / "config.json").is_symlink()
    full, one = (EmbeddingModel(d, dtype="float32") for d in (minilm_dir, cut))
    assert len(one.encoder.layers) == 1 and len(full.encoder.layers) == 6
    ids = full.tokenize(["the service embeds queries", "检索系统"])
    (a, _), (b, _) = full.embed(ids, {"dense"}), one.embed(ids, {"dense"})
    assert [x.dense.shape for x in a] == [x.dense.shape for x in b] == [(384,), (384,)]
    assert not np.allclose(a[0].dense, b[0].dense, atol=1e-3)


def test_a_revision_git_does_not_know_is_refused(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
    with pytest.raises(SystemExit, match="--against no-such-rev: git worktree add failed"):
        http_path.add_worktree(tmp_path / "repo", "no-such-rev", tmp_path / "tree")


def test_the_table_gives_each_side_and_the_ratio_of_the_rounds():
    row = {"workload": "1 text/request, 8 clients", "texts_per_s": {"this tree": 300.0, "abc123": 250.0},
           "loop_ms_per_request": {"this tree": 0.5, "abc123": 0.8}, "ratio": 1.2, "ratios": [1.1, 1.2, 1.3],
           "failed": 0}
    res = {"against": "abc123", "model": "all-MiniLM-L6-v2", "layers": 1, "dtype": "float32", "rounds": 3,
           "date": "2026-12-07", "flags": ["avx2"], "rows": [row]}
    md = http_path.markdown(res)
    assert "cut to 1 layer(s)" in md
    assert "| 1 text/request, 8 clients | 300 | 250 | 1.20× | 1.10, 1.20, 1.30 | 0.50 | 0.80 |" in md
    assert "failed" not in md
    row["failed"] = 3
    assert "**3 requests failed.**" in http_path.markdown(res)
