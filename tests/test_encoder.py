"""Our encoder equals Hugging Face transformers' own model on the two real bundled models,
embeds an input the same alone and inside a mixed-length batch (precisions: test_precision.py)."""

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from embedserve.models import embedding_model as em
from embedserve.models.encoder import AttentionPlan

from helpers import TEXTS_EN_ZH_FR


def _hf_embed(path, texts, pooling):
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    b = tok(texts, padding=True, truncation=True, max_length=512, return_tensors="pt")
    with torch.no_grad():
        h = model(**b).last_hidden_state
    if pooling == "cls":
        pooled = h[:, 0]
    else:
        m = b["attention_mask"][..., None].float()
        pooled = (h * m).sum(1) / m.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy(), b["input_ids"], b["attention_mask"]


@pytest.mark.model
@pytest.mark.parametrize("which", ["e5", "minilm"])
def test_equal_to_transformers(which, request):
    model = request.getfixturevalue(f"{which}_model")
    texts = [model.prefixes["passage"] + t for t in TEXTS_EN_ZH_FR]
    ref, hf_ids, mask = _hf_embed(model.path, texts, model.pooling)
    ours_ids = model.tokenize(texts)
    for i, ids in enumerate(ours_ids):
        assert ids == hf_ids[i][mask[i].bool()].tolist(), f"token ids differ for text {i}"
    outs, _ = model.embed(ours_ids, {"dense"})
    cos = np.array([float(o.dense @ r) for o, r in zip(outs, ref)])
    assert cos.min() >= 0.99999, cos


@pytest.mark.model
@pytest.mark.parametrize("which", ["e5", "minilm"])
def test_same_embedding_alone_and_in_mixed_batch(which, request):
    model = request.getfixturevalue(f"{which}_model")
    ids = model.tokenize(TEXTS_EN_ZH_FR)
    batch, computed = model.embed(ids, {"dense"})
    assert computed >= sum(map(len, ids))
    for i, x in enumerate(ids):
        alone, _ = model.embed([x], {"dense"})
        assert float(alone[0].dense @ batch[i].dense) >= 0.9999
        # and in a different batch order / company
        other, _ = model.embed([ids[-1], x, ids[0]], {"dense"})
        assert float(other[1].dense @ batch[i].dense) >= 0.9999


def test_attention_plan_groups_cover_every_token_once():
    lengths = sorted([1, 5, 7, 7, 8, 30, 31, 64, 250, 251], reverse=True)
    plan = AttentionPlan.build(lengths)
    covered = 0
    for start, end, n, L, dest, mask in plan.groups:
        assert start == covered
        covered = end
        assert n * L >= end - start
        if dest is not None:
            assert len(dest) == end - start and len(set(dest.tolist())) == end - start
    assert covered == sum(lengths)
    assert plan.computed_tokens <= 1.125 * sum(lengths) + max(lengths)


def test_truncate_keeps_closing_special(minilm_model):
    ids = minilm_model.tokenize(["word " * 700])[0]
    cut = minilm_model.truncate(ids, 512)
    assert len(cut) == 512 and cut[-1] == ids[-1] and cut[0] == ids[0]


def test_weights_never_loaded_with_pickle(tmp_path, minilm_dir):
    """A directory with only pickled weights is refused, not unpickled."""
    import shutil
    d = tmp_path / "m"
    d.mkdir()
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(minilm_dir / f, d / f)
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        em.EmbeddingModel(d, dtype="float32")


@pytest.mark.model
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_tokens_only_equal_the_full_forwards_first_rows(minilm_dir, dtype):
    """`first_only` (a cross-encoder's head, CLS pooling) runs the last layer for each sequence's
    first token alone: the same rows as the full forward, with lengths that make padded
    attention groups and a sequence of one token."""
    from embedserve.models.encoder import Encoder
    enc = Encoder.from_dir(minilm_dir, dtype)
    lengths = [200, 131, 130, 64, 9, 8, 8, 2, 1]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    plan = AttentionPlan.build(lengths)
    assert any(dest is not None for *_, dest, _m in plan.groups)        # some group is padded
    full = enc(ids, pos, plan)[plan.cu_seqlens[:-1].long()].float()
    first = enc(ids, pos, plan, first_only=True).float()
    assert first.shape == (len(lengths), enc.cfg.hidden_size)
    tol = 1e-5 if dtype == torch.float32 else 0.05 * float(full.abs().max())
    assert float((first - full).abs().max()) <= tol


def test_bucket_rows_rounds_up_by_at_most_a_sixteenth_and_repeats():
    from embedserve.models.encoder import bucket_rows
    for T in range(1, 9000):
        b = bucket_rows(T)
        assert T <= b <= max(T + 7, T * 17 / 16), T
        assert bucket_rows(b) == b, T                          # a bucket is its own bucket
    assert len({bucket_rows(T) for T in range(2048, 4097)}) == 17   # 16 per doubling (and 4096)
    assert bucket_rows(3500) == 3584 and bucket_rows(20) == 24


@pytest.mark.model
@pytest.mark.parametrize("cpu_attention", ["auto", "sdpa"])
def test_bucketed_rows_give_the_exact_rows_outputs(minilm_dir, cpu_attention):
    """The padding rows a batch gets to reach its bucket (token 0, position 0, a sequence of their
    own in attention) change none of the real rows, on the C kernel's and SDPA's paths, with
    token types and with first_only; the result has exactly the real rows."""
    from embedserve.models.encoder import Encoder, bucket_rows
    from kernels import compute
    with compute.override(cpu_attention=cpu_attention):
        enc = Encoder.from_dir(minilm_dir, torch.float32)
        lengths = [200, 131, 130, 64, 9, 8, 2, 1]
        T = sum(lengths)
        assert bucket_rows(T) > T                                       # this batch is padded
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(1000, 20000, (T,), generator=g)
        pos = torch.cat([torch.arange(n) for n in lengths])
        types = (pos >= 3).long()
        plan = AttentionPlan.build(lengths)
        outs = {}
        for on in (True, False):
            with compute.override(bucket_rows=on):
                outs[on] = (enc(ids, pos, plan, types), enc(ids, pos, plan, types, first_only=True))
        assert plan.computed_tokens >= T
        for got, want in zip(outs[True], outs[False]):
            assert got.shape == want.shape and torch.isfinite(got).all()
            assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
        assert outs[True][0].shape == (T, enc.cfg.hidden_size)
