"""Cross-encoders on our encoder: fp32 scores equal transformers' `*ForSequenceClassification`
(BERT with token types, XLM-R without) within 1e-5, alone and inside a batch; the pair layout
and truncation equal the transformers tokenizer's `truncation="only_second"`; only the document
is ever cut; several labels need a named relevant label; BGE-M3 scores equal FlagEmbedding's
`compute_score` on the tiny fixture; pairs through the engine keep their token types and an
abandoned request's pairs never reach the model."""

import json
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from helpers import BERT_RERANKER_DIR, BERT_3LABEL_DIR, BGE_M3_DIR, XLMR_RERANKER_DIR

from embedserve.config import EmbedConfig
from embedserve.engine.batch_queue import EmbedRequest
from embedserve.engine.embed_engine import EmbedEngine
from embedserve.models.cross_encoder import CrossEncoderModel, QueryTooLong, DocumentTooLong, load_model
from embedserve.models.embedding_model import EmbeddingModel
from embedserve.models.scoring import M3_METHODS, m3_score

QUERY = "what is the capital of France"
DOCS = ["Paris is the capital and largest city of France.",
        "北京是中华人民共和国的首都。",
        "The quick brown fox jumps over the lazy dog. " * 3,
        "La tour Eiffel est à Paris.",
        "x"]


def _transformers(path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    return AutoModelForSequenceClassification.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _reference(path, query, docs, max_length):
    hf, tok = _transformers(path)
    enc = tok([query] * len(docs), docs, padding=True, truncation="only_second", max_length=max_length,
              return_tensors="pt")
    with torch.no_grad():
        logits = hf(**enc).logits.numpy()
    ids = [enc["input_ids"][i][: int(enc["attention_mask"][i].sum())].tolist() for i in range(len(docs))]
    return logits, ids


@pytest.mark.parametrize("path", [BERT_RERANKER_DIR, XLMR_RERANKER_DIR], ids=["bert", "xlm-roberta"])
def test_scores_equal_transformers_alone_and_in_a_batch(path):
    ours = CrossEncoderModel(path, dtype="float32")
    assert ours.spec.task == "rerank" and ours.spec.embedding_types == {"score"}
    docs = DOCS + ["long " * 200]                   # cut to the model's limit, the query kept whole
    ref, ref_ids = _reference(path, QUERY, docs, ours.max_input_length)
    pairs = ours.pairs(QUERY, docs)
    assert pairs.inputs == ref_ids                   # the tokenizer's own pair layout and cut
    assert len(docs) - 1 in pairs.truncated
    assert all(len(pairs.inputs[i]) == ours.max_input_length for i in pairs.truncated)
    batch = ours.score_pairs(QUERY, docs)
    np.testing.assert_allclose(batch, ref[:, 0], atol=1e-5)
    for i, d in enumerate(docs):
        np.testing.assert_allclose(ours.score_pairs(QUERY, [d])[0], batch[i], atol=1e-5)
    # inside a batch of other queries' pairs, in another order
    other = ours.pairs("Beijing", DOCS)
    outs, _ = ours.embed(other.inputs + pairs.inputs[::-1], {"score"}, other.segments + pairs.segments[::-1])
    np.testing.assert_allclose([o.score[0] for o in outs[len(DOCS):]], batch[::-1], atol=1e-5)
    assert np.ptp(batch) > 1e-3                      # the fixture's scores differ between pairs


def test_bert_token_types_change_the_score():
    """The document segment is type 1 on BERT: scoring it as type 0 gives another number."""
    ours = CrossEncoderModel(BERT_RERANKER_DIR, dtype="float32")
    assert ours.second_type == 1 and ours.cfg.type_vocab_size == 2
    p = ours.pairs(QUERY, DOCS[:1])
    typed = ours.embed(p.inputs, {"score"}, p.segments)[0][0].score
    untyped = ours.embed(p.inputs, {"score"})[0][0].score
    assert abs(float(typed[0] - untyped[0])) > 1e-4
    xlmr = CrossEncoderModel(XLMR_RERANKER_DIR, dtype="float32")
    assert xlmr.second_type == 0 and xlmr.pairs(QUERY, DOCS[:1]).segments == [None]


def test_only_the_document_is_cut_and_a_long_query_is_refused():
    ours = CrossEncoderModel(BERT_RERANKER_DIR, dtype="float32")
    limit = ours.max_input_length
    q = ours.query_ids(QUERY)
    p = ours.pairs(QUERY, ["word " * 500], max_doc_tokens=None)
    assert p.inputs[0][1:1 + len(q)] == q and len(p.inputs[0]) == limit
    assert p.cut_tokens == len(ours.query_ids("word " * 500)) - (limit - len(q) - ours.pair_specials)
    short = ours.pairs(QUERY, ["word " * 500], max_doc_tokens=4)
    assert len(short.inputs[0]) == len(q) + ours.pair_specials + 4
    with pytest.raises(DocumentTooLong, match="document 0 makes a pair of"):
        ours.pairs(QUERY, ["word " * 500], truncate=False)
    with pytest.raises(QueryTooLong, match="shorten the query"):
        ours.pairs("query " * limit, ["doc"])


def test_several_labels_need_the_relevant_one_named(tmp_path):
    model = CrossEncoderModel(BERT_3LABEL_DIR, dtype="float32")
    assert model.num_labels == 3 and model.relevant_label is None
    assert "relevant_label" in model.label_problem()
    with pytest.raises(ValueError, match="relevant_label"):
        model.score_pairs(QUERY, DOCS[:1])
    named = tmp_path / "nli"
    shutil.copytree(BERT_3LABEL_DIR, named)
    (named / "embedserve_model.json").write_text(json.dumps({"relevant_label": "entailment"}))
    model = CrossEncoderModel(named, dtype="float32")
    ref, _ = _reference(named, QUERY, DOCS, model.max_input_length)
    label = [k for k, v in model.labels.items() if v == "entailment"][0]
    np.testing.assert_allclose(model.score_pairs(QUERY, DOCS, raw=True), ref[:, label], atol=1e-5)
    soft = np.exp(ref) / np.exp(ref).sum(1, keepdims=True)
    np.testing.assert_allclose(model.score_pairs(QUERY, DOCS, raw=False), soft[:, label], atol=1e-6)
    (named / "embedserve_model.json").write_text(json.dumps({"relevant_label": "relevant"}))
    with pytest.raises(ValueError, match="none of the model's labels"):
        CrossEncoderModel(named, dtype="float32")


def test_single_label_relevance_is_the_sigmoid():
    model = CrossEncoderModel(BERT_RERANKER_DIR, dtype="float32")
    raw = model.score_pairs(QUERY, DOCS, raw=True)
    np.testing.assert_allclose(model.score_pairs(QUERY, DOCS, raw=False), 1 / (1 + np.exp(-raw)), atol=1e-9)


def test_architecture_decides_embedder_or_reranker():
    assert isinstance(load_model(BERT_RERANKER_DIR, dtype="float32"), CrossEncoderModel)
    assert type(load_model(BGE_M3_DIR, dtype="float32")) is EmbeddingModel
    with pytest.raises(ValueError, match="is a reranker"):
        EmbeddingModel(BERT_RERANKER_DIR, dtype="float32")


@pytest.mark.parametrize("run", range(4))
def test_bgem3_scores_equal_flagembedding_compute_score(bgem3_model, run):
    """FlagEmbedding 1.4.2's BGEM3FlagModel.compute_score on the same token ids (its own cuts,
    recorded in the reference), every method and both weightings."""
    ref = json.loads((BGE_M3_DIR / "flagembedding_compute_score.json").read_text())
    r = ref["runs"][run]
    weights = r["weights_effective"]
    qids, pids = r["query_input_ids"], r["passage_input_ids"]
    outs = {}
    for side, ids in (("q", qids), ("p", pids)):
        keys = sorted(ids)
        got, _ = bgem3_model.embed([ids[k] for k in keys], {"dense", "sparse", "colbert"})
        outs.update({(side, k): o for k, o in zip(keys, got)})
    for method in M3_METHODS:
        ours = [m3_score(outs["q", str(q)], outs["p", str(p)], method, weights) for q, p in ref["pair_indices"]]
        np.testing.assert_allclose(ours, r["scores"][method], atol=1e-5, err_msg=method)


class _Recording:
    """A model that records each batch's inputs and segments (then scores them for real)."""

    def __init__(self, model):
        self.model, self.batches, self.spec = model, [], model.spec
        self.max_input_length, self.special_ids = model.max_input_length, model.special_ids
        self.gate = threading.Event()

    def embed(self, batch, want, segments=None):
        self.gate.wait(5)
        self.batches.append((batch, segments))
        return self.model.embed(batch, want, segments)


def test_pairs_through_the_engine_keep_types_order_and_drop_the_abandoned():
    model = CrossEncoderModel(BERT_RERANKER_DIR, dtype="float32")
    rec = _Recording(model)
    eng = EmbedEngine(rec, EmbedConfig(model="x", max_batch_tokens=64, max_batch_size=2, max_queued_tokens=10_000))
    eng.start()
    done = []
    first = model.pairs(QUERY, DOCS)
    doomed = model.pairs("doomed query", ["never scored"])
    a = EmbedRequest(inputs=first.inputs, want=frozenset({"score"}), on_done=done.append, segments=first.segments)
    b = EmbedRequest(inputs=doomed.inputs, want=frozenset({"score"}), on_done=done.append, segments=doomed.segments)
    eng.submit(a)
    eng.submit(b)
    eng.abort(b)
    rec.gate.set()
    deadline = time.time() + 10
    while not done and time.time() < deadline:
        time.sleep(0.01)
    eng.stop()
    assert done == [a] and a.error is None
    assert len(rec.batches) > 1                       # one request's pairs spread over batches
    assert all(doomed.inputs[0] not in batch for batch, _ in rec.batches)
    assert all(segs is not None for _, segs in rec.batches)
    np.testing.assert_allclose([o.score[0] for o in a.outputs], model.score_pairs(QUERY, DOCS), atol=1e-5)
