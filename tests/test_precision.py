"""One precision resolver (`embedserve.precision`) for plan, serve and the loaded model, on
every kind of machine: `EMBEDSERVE_FAST_BF16=0|1` makes `auto` take either branch here.

* bf16 and int8 each pass their accuracy gate on both real models (min cosine to fp32 on
  English / Chinese / French texts), and keep retrieval on a real set: bf16's top-10 equals
  fp32's, int8's recall@10 stays within 0.01 of fp32's.
* `auto` picks among the passing precisions the one measured fastest (a less accurate one only
  when 10% faster), runs its probe once per model and machine, and `plan` says what it will be.
* `--dtype int8` on a model whose int8 embeddings drift is refused with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import compute
from embedserve import precision
from embedserve.config import ServerConfig
from embedserve.errors import ConfigError
from embedserve.memory_plan import embed_memory_plan
from embedserve.models import embedding_model as em
from embedserve.models.encoder import load_encoder
from embedserve.models.int8 import Int8Linear
from embedserve.precision import ProbeResult

from helpers import TEXTS_EN_ZH_FR
from helpers import wiki_corpus


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBEDSERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.model
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("which", ["e5", "minilm"])
def test_precision_passes_its_gate(which, dtype, request):
    model = request.getfixturevalue(f"{which}_model")
    assert model.agreement(dtype, TEXTS_EN_ZH_FR) >= precision.GATES[dtype]


def _dense(model, encoder, texts, input_type):
    ids = [model.truncate(x) for x in model.tokenize(texts, input_type)]
    out = []
    for s in range(0, len(ids), 64):
        out += [o.dense for o in model.embed_with(encoder, ids[s:s + 64], {"dense"})[0]]
    return np.stack(out)


def _top10(model, encoder, docs):
    d = _dense(model, encoder, [text for _, text, _ in docs], "passage")
    q = _dense(model, encoder, [query for _, _, query in docs], "query")
    return d, np.argsort(-(q @ d.T), axis=1)[:, :10]


def test_bf16_keeps_fp32s_top10_on_a_real_set(minilm_model):
    """Small on purpose: where bf16 is emulated it is ~4x slower than fp32."""
    docs = wiki_corpus()[:80]
    ref_d, ref_top = _top10(minilm_model, minilm_model.encoder, docs)
    d, top = _top10(minilm_model, load_encoder(minilm_model.path, "bfloat16"), docs)
    cos = (ref_d * d).sum(1) / (np.linalg.norm(ref_d, axis=1) * np.linalg.norm(d, axis=1))
    assert cos.min() >= 0.999
    overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(top, ref_top)])
    assert overlap >= 0.99, overlap


@pytest.mark.model
@pytest.mark.parametrize("which", ["e5", "minilm"])
def test_int8_recall_within_001_of_fp32(which, request):
    model = request.getfixturevalue(f"{which}_model")
    docs = wiki_corpus()                           # the index retrieval test's 250 documents
    n = np.arange(len(docs))[:, None]
    recall = {}
    for dtype, enc in (("float32", model.encoder), ("int8", load_encoder(model.path, "int8"))):
        _, top = _top10(model, enc, docs)
        recall[dtype] = float(np.mean((top == n).any(1)))
    assert abs(recall["int8"] - recall["float32"]) <= 0.01, recall


@pytest.mark.parametrize("kernel", ["int_mm", "fbgemm"])
def test_int8_linear_matches_its_dequantized_weights(kernel):
    """Per-token activation scales: each row is exact up to its own int8 rounding, outliers
    included, on both int8 matmuls (VNNI's _int_mm and AVX2's fbgemm)."""
    torch.manual_seed(0)
    w, b = torch.randn(48, 64) * 0.05, torch.randn(48)
    x = torch.randn(7, 64)
    x[:, 3] *= 40                                    # an outlier channel, as FFN-down inputs have
    lin = Int8Linear(w, b, torch.float32, kernel=kernel)
    ref = x @ lin.dequantized().T + b
    # error <= 0.5 LSB of x's per-token scale times sum |w| per output (a loose bound)
    bound = (x.abs().amax(1, keepdim=True) / 127 / 2) @ lin.dequantized().abs().sum(1, keepdim=True).T
    assert ((lin(x) - ref).abs() <= bound + 1e-4).all()


def test_fbgemm_int8_equals_the_integer_math_where_int16_would_saturate():
    """The worst case for fbgemm's AVX2 step (two u8 x s8 products summed in a saturating
    int16): every activation at ±127 and every weight at the 7-bit limit, paired by sign. The
    result must equal the exact integer product, scaled: no saturation anywhere."""
    from embedserve.models.int8 import FBGEMM_W_LEVELS
    K, N = 64, 16
    g = torch.Generator().manual_seed(0)
    signs = lambda *shape: torch.randint(0, 2, shape, generator=g).float() * 2 - 1  # noqa: E731
    w = 0.5 * signs(N, K)                             # every weight at its row's max: ±63 after quantizing
    w[0], w[1] = 0.5, -0.5                            # rows of one sign: every pair of products adds up
    x = signs(6, K) * torch.tensor([[1.], [3.], [0.5], [-7.], [2.], [1.]])
    x[0], x[1] = 1.0, 3.0                             # all at +127, the largest u8 (255)
    lin = Int8Linear(w, torch.zeros(N), torch.float32, kernel="fbgemm")
    assert int(lin.wT.abs().max()) == FBGEMM_W_LEVELS
    xs = x.abs().amax(1, keepdim=True) / 127
    exact = ((x / xs).round().double() @ lin.wT.double()) * lin.ws.double() * xs.double()
    torch.testing.assert_close(lin(x).double(), exact, rtol=1e-6, atol=1e-6)   # fp32 rounding only
    torch.testing.assert_close(lin(x), x @ w.T, rtol=1e-5, atol=1e-5)          # here the grid is exact


def test_int8_kernel_follows_the_cpu(monkeypatch):
    from embedserve.models import int8
    detect = int8._detected_int8_kernel.__wrapped__        # the detection itself, past its per-process cache
    monkeypatch.setattr(int8, "_detected_int8_kernel", lambda: detect())
    for flags, want in (({"avx2", "avx512_vnni"}, "int_mm"), ({"avx2", "avx_vnni"}, "int_mm"), ({"avx2"}, "fbgemm")):
        monkeypatch.setattr(int8, "cpu_flags", lambda flags=flags: frozenset(flags))
        with compute.override(int8_kernel="auto"):
            assert int8.int8_kernel() == want, flags
    for forced in ("int_mm", "fbgemm"):
        with compute.override(int8_kernel=forced):
            assert int8.int8_kernel() == forced
    with pytest.raises(ValueError, match="--int8-kernel 'mkl': choose auto | int_mm | fbgemm"):
        compute.ComputePaths(int8_kernel="mkl")
    monkeypatch.setenv("EMBEDSERVE_INT8_KERNEL", "mkl")
    with pytest.raises(ValueError, match="from the environment"):
        compute.ComputePaths.from_env()


def _probe(bf16=0.9999, int8=0.996, speeds=None):
    speeds = speeds or {"float32": 1000.0, "bfloat16": 3000.0, "int8": 3100.0}
    return ProbeResult(min_cosine={"bfloat16": bf16, "int8": int8}, tokens_per_s=speeds)


def test_fastest_passing_prefers_accuracy_unless_clearly_faster():
    assert _probe().fastest_passing() == "bfloat16"               # int8 only 3% faster
    assert _probe(speeds={"float32": 1000, "bfloat16": 3000, "int8": 3400}).fastest_passing() == "int8"
    assert _probe(bf16=0.99).fastest_passing() == "int8"          # bf16 fails its gate
    assert _probe(bf16=0.99, int8=0.9).fastest_passing() == "float32"
    assert _probe(speeds={"float32": 1000, "bfloat16": 250, "int8": 1050}).fastest_passing() == "float32"


def test_a_precision_slower_on_small_batches_is_not_picked():
    """The AVX2 e5 case: int8 a little faster than fp32 on the large batch, slower on 8 texts
    (where 1 text/request x 8 clients serves): fp32 stays; where the small batch agrees, int8."""
    probe = _probe(bf16=0.9, speeds={"float32": 1000, "bfloat16": 300, "int8": 1150})
    probe.small_tokens_per_s = {"float32": 500, "int8": 450}
    assert probe.fastest_passing() == "float32"
    probe.small_tokens_per_s["int8"] = 520
    assert probe.fastest_passing() == "int8"
    probe.small_tokens_per_s = {"float32": 500}                   # not measured there (an older probe)
    assert probe.fastest_passing() == "int8"


@pytest.mark.parametrize("fast", ["0", "1"])
def test_auto_probes_once_and_plan_names_what_serve_loads(fast, home, minilm_dir, monkeypatch):
    monkeypatch.setattr(compute, "_current", compute.ComputePaths(fast_bf16=fast))
    calls = []

    def probe(self, candidates, texts=None, keep=None):
        calls.append(tuple(candidates))
        return _probe(bf16=0.9999 if fast == "1" else 0.0, int8=0.99 if fast == "1" else 0.995,
                      speeds={"float32": 1000, "bfloat16": 3000 if fast == "1" else 250, "int8": 2800})

    monkeypatch.setattr(em.EmbeddingModel, "probe_precisions", probe)
    cfg = ServerConfig.of(model=str(minilm_dir), dtype="auto", generate_model="none")
    before = embed_memory_plan(minilm_dir, cfg)
    assert "accuracy probe" in before.dtype                        # not measured on this machine yet
    model = em.EmbeddingModel(minilm_dir, dtype="auto")
    want = "bfloat16" if fast == "1" else "int8"
    assert calls == [("bfloat16", "int8") if fast == "1" else ("int8",)]
    assert model.spec.dtype == want
    assert embed_memory_plan(minilm_dir, cfg).dtype == want        # plan now says what serve loads
    again = em.EmbeddingModel(minilm_dir, dtype="auto")            # the cached outcome: no probe
    assert again.spec.dtype == want and len(calls) == 1


def test_the_probe_is_cached_in_the_cache_dir_when_one_is_set(home, minilm_dir, monkeypatch, tmp_path):
    """A read-only home (the image) with EMBEDSERVE_CACHE_DIR on a volume: the probe's outcome
    is kept there, and the next start on this machine does not probe again."""
    monkeypatch.setattr(compute, "_current", compute.ComputePaths(fast_bf16="0"))
    monkeypatch.setenv("EMBEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def probe(self, candidates, texts=None, keep=None):
        calls.append(tuple(candidates))
        return _probe(bf16=0.0, int8=0.995, speeds={"float32": 1000, "bfloat16": 250, "int8": 2800})

    monkeypatch.setattr(em.EmbeddingModel, "probe_precisions", probe)
    assert em.EmbeddingModel(minilm_dir, dtype="auto").spec.dtype == "int8"
    assert len(list((tmp_path / "cache" / "precision").glob("*.json"))) == 1
    assert not (home / "precision").exists()
    assert em.EmbeddingModel(minilm_dir, dtype="auto").spec.dtype == "int8" and len(calls) == 1


def test_auto_keeps_fp32_when_nothing_passes(home, minilm_dir, monkeypatch):
    monkeypatch.setattr(compute, "_current", compute.ComputePaths(fast_bf16="1"))
    monkeypatch.setattr(em.EmbeddingModel, "probe_precisions", lambda self, c, texts=None, keep=None: _probe(bf16=0.99, int8=0.9))
    model = em.EmbeddingModel(minilm_dir, dtype="auto")
    assert model.spec.dtype == "float32"
    out, _ = model.embed(model.tokenize(["hello"]), {"dense"})
    assert out[0].dense.dtype == np.float32 and abs(np.linalg.norm(out[0].dense) - 1) < 1e-5


def test_int8_is_refused_where_it_drifts(home, minilm_dir, monkeypatch):
    monkeypatch.setattr(em.EmbeddingModel, "_agreement", lambda self, dtype, ids: (0.91, None))
    with pytest.raises(ConfigError, match=r"--dtype int8 is not accurate enough.*0\.91"):
        em.EmbeddingModel(minilm_dir, dtype="int8")


def test_the_real_probe_measures_every_candidate(home, minilm_model):
    result = minilm_model.probe_precisions(("bfloat16", "int8"), TEXTS_EN_ZH_FR[:4])
    assert set(result.tokens_per_s) == {"float32", "bfloat16", "int8"} and min(result.tokens_per_s.values()) > 0
    assert set(result.small_tokens_per_s) == {"float32", "bfloat16", "int8"}
    assert min(result.small_tokens_per_s.values()) > 0
    assert result.min_cosine["bfloat16"] >= 0.999 and result.min_cosine["int8"] >= 0.99
    assert result.fastest_passing() in result.passing()


def test_fast_bf16_switch_and_decoder_policy(monkeypatch):
    monkeypatch.setattr(compute, "_current", compute.ComputePaths(fast_bf16="0"))
    assert not precision.fast_bf16_available("cpu")
    assert precision.decoder_precision("auto", "cpu") == "float32"
    assert precision.encoder_precision("auto", "cpu", None).candidates == ("int8",)
    monkeypatch.setattr(compute, "_current", compute.ComputePaths(fast_bf16="1"))
    assert precision.fast_bf16_available("cpu")
    assert precision.decoder_precision("auto", "cpu") == ("bfloat16" if precision.DECODER_BF16_FASTER_ON_CPU
                                                          else "float32")
    assert precision.decoder_precision("int8", "cpu") == "float32"
    assert precision.encoder_precision("bf16", "cpu", None).dtype == "bfloat16"
    with pytest.raises(ConfigError, match="choose auto, float32, bfloat16, int8"):
        precision.normalize_dtype("fp8")
