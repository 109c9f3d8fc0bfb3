"""BGE-M3 from one forward pass equals FlagEmbedding's BGEM3FlagModel on the same files.

The reference outputs were produced by FlagEmbedding 1.4.2 itself (in its own environment,
see fixtures/make_bgem3_fixture.py) on a small random XLM-R saved in BGE-M3's layout.
"""

import json

import numpy as np
import pytest

from embedserve.models.scoring import colbert_score, lexical_score

from helpers import BGE_M3_DIR

REF = json.loads((BGE_M3_DIR / "flagembedding_reference.json").read_text())
# fp32 on both sides, different kernels and summation orders: differences of ~1e-6 are
# expected; the bound is 1e-4.
ATOL = 1e-4


@pytest.fixture(scope="module")
def outputs(bgem3_model):
    ids = [bgem3_model.truncate(x, REF["max_length"]) for x in bgem3_model.tokenize(REF["texts"])]
    assert ids == REF["input_ids"], "tokenization differs from what FlagEmbedding fed its encoder"
    outs, _ = bgem3_model.embed(ids, {"dense", "sparse", "colbert"})
    return outs


def test_spec_reports_heads_and_cls_pooling(bgem3_model):
    spec = bgem3_model.spec
    assert spec.has_sparse and spec.has_colbert
    assert spec.pooling == "cls" and spec.normalize
    assert spec.model_type == "xlm-roberta"


def test_dense_matches_flagembedding(outputs):
    for out, ref in zip(outputs, REF["dense"]):
        np.testing.assert_allclose(out.dense, np.array(ref, np.float32), atol=ATOL, rtol=0)


def test_sparse_lexical_weights_match_flagembedding(outputs):
    removed = set(REF["sparse_removed_token_ids"])
    for i, (out, ref) in enumerate(zip(outputs, REF["lexical_weights"])):
        ids, w = out.sparse
        ours = dict(zip(ids.tolist(), w.tolist()))
        theirs = {int(k): v for k, v in ref.items()}
        assert set(ours) == set(theirs), f"text {i}: token id sets differ"
        assert not set(ours) & removed
        for k, v in theirs.items():
            assert abs(ours[k] - v) <= ATOL, (i, k, ours[k], v)


def test_colbert_vectors_match_flagembedding(outputs):
    for i, (out, ref) in enumerate(zip(outputs, REF["colbert_vecs"])):
        ref = np.array(ref, np.float32)
        assert out.colbert.shape == ref.shape, f"text {i}: {out.colbert.shape} vs {ref.shape}"
        np.testing.assert_allclose(out.colbert, ref, atol=ATOL, rtol=0)


def test_pair_scores_match_flagembedding(outputs):
    for s in REF["scores"]:
        q, p = outputs[s["query"]], outputs[s["passage"]]
        assert abs(lexical_score(q.sparse, p.sparse) - s["lexical_matching_score"]) <= ATOL
        assert abs(colbert_score(q.colbert, p.colbert) - s["colbert_score"]) <= ATOL
        assert abs(float(q.dense @ p.dense) - s["dense_score"]) <= ATOL


def test_same_outputs_alone_and_in_a_batch(bgem3_model):
    ids = [bgem3_model.truncate(x, REF["max_length"]) for x in bgem3_model.tokenize(REF["texts"])]
    batch, _ = bgem3_model.embed(ids, {"dense", "sparse", "colbert"})
    for i in (0, 3, 7):
        alone, _ = bgem3_model.embed([ids[i]], {"dense", "sparse", "colbert"})
        np.testing.assert_allclose(alone[0].dense, batch[i].dense, atol=1e-5)
        np.testing.assert_allclose(alone[0].colbert, batch[i].colbert, atol=1e-5)
        np.testing.assert_array_equal(alone[0].sparse[0], batch[i].sparse[0])
