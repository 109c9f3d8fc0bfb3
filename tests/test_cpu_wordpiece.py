"""The C WordPiece tokenizer (kernels/cpu_wordpiece.c) gives `tokenizers`' ids, token for token, for
every text it takes, and hands every other text back; the embedding model mixes the two in order."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer

from kernels import compute
from kernels.cpu_wordpiece import CJK, EXTRA_CHARS, PROBES, FastWordPiece, _library
from embedserve.models.registry import resolve_model

WHY = _library()[1]
needs_build = pytest.mark.skipif(WHY is not None, reason=f"the C tokenizer does not build here: {WHY}")

WORDPIECE_MODELS = ("all-MiniLM-L6-v2", "bge-small-en-v1.5", "ms-marco-MiniLM-L-12-v2", "splade-tiny")

ENGLISH = ("The Eiffel Tower, completed in 1889, is 330 metres (1,083 ft) tall.",
           "What's the capital of France? Paris -- obviously!",
           "Retrieval-augmented generation (RAG) grounds an LLM's answers in documents; see arXiv:2005.11401.",
           "e-mail: first.last+tag@example.co.uk, url: https://example.org/path?q=1&r=2#frag",
           "C++ and C# aren't Python_3.12; `x = y ** 2` ~ {a: [1, 2]} | <tag/> \\ ^ @ $ % *",
           "   leading and trailing whitespace\t\tand\r\nnewlines   ",
           "Antidisestablishmentarianism vs. floccinaucinihilipilification.")
CHINESE = ("北京是中国的首都。", "我用Python 3.12写代码，速度很快！“真的”（吗）？",
           "检索增强生成　RAG\u00a0——《论文》【2020】…")
OTHERS = ("Café au lait, naïve résumé", "emoji 🙂 here", "ｆｕｌｌｗｉｄｔｈ", "Straße", "北京 Zürich",
          "ＡＢＣ１２３中文")
# every character past ASCII the C path takes (the ranges of EXTRA_CHARS written out)
EXTRA = [chr(c) for c in range(0x3400, 0x4DC0)] + [chr(c) for c in range(0x4E00, 0xA000)] + \
    [c for c in EXTRA_CHARS.replace(CJK, "") if c != "\\"]


def _reference(path) -> Tokenizer:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def _minilm_normalizer(tmp_path, **normalizer) -> tuple[Tokenizer, FastWordPiece]:
    """MiniLM's tokenizer.json with its normalizer's fields changed, written under `tmp_path`:
    `tokenizers`' reference and the C tokenizer built from it, which must take it."""
    spec = json.loads((resolve_model("all-MiniLM-L6-v2")[1] / "tokenizer.json").read_text())
    spec["normalizer"].update(normalizer)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    ref = _reference(tmp_path)
    fast, why = FastWordPiece.build(tmp_path / "tokenizer.json", ref)
    assert why is None and fast is not None
    return ref, fast


def _fuzz(seed: int, n: int) -> list[str]:
    """ASCII texts: every code point 0-127 at random, word salads with punctuation and controls,
    the added tokens' contents in any case, words at the 100-character limit and past it; and
    texts that mix them with the characters past ASCII the C path takes."""
    rng = random.Random(seed)
    words = ("the of and a to in is was retrieval embedding vector index query passage token unbelievable "
             "tokenization supercalifragilistic xylophone zzzz qqq").split()
    out = []
    for k in range(n):
        kind = k % 4
        if kind == 3:
            out.append("".join(rng.choice(EXTRA) if rng.random() < 0.5 else chr(rng.randrange(128))
                               if rng.random() < 0.3 else rng.choice(words) for _ in range(rng.randint(0, 40))))
        elif kind == 0:
            out.append("".join(chr(rng.randrange(128)) for _ in range(rng.randint(0, 40))))
        elif kind == 1:
            out.append(" ".join(rng.choice(words).upper() if rng.random() < 0.1 else rng.choice(words)
                                + rng.choice(["", "", ",", ".", "ing", "'s", "-", "\t", "\x00", "\x1f", "\x7f"])
                                for _ in range(rng.randint(1, 30))))
        else:
            out.append("".join(rng.choice(["ab", "qz", "[MASK]", "[mask]", "[Unk]", "[CLS", "SEP]", "##", "#", "  ",
                                           "\r\n", "[", "]", "x" * rng.randint(95, 105)]) for _ in range(rng.randint(0, 12))))
    return out


@needs_build
@pytest.mark.parametrize("model", WORDPIECE_MODELS)
def test_ids_equal_tokenizers_on_every_text_it_takes(model):
    path = resolve_model(model)[1]
    ref = _reference(path)
    fast, why = FastWordPiece.build(path / "tokenizer.json", ref)
    assert why is None and fast is not None
    texts = list(ENGLISH) + list(CHINESE) + list(PROBES) + _fuzz(WORDPIECE_MODELS.index(model), 4000)
    want = [e.ids for e in ref.encode_batch(texts, add_special_tokens=True)]
    got = fast.encode(texts)
    taken = [i for i, g in enumerate(got) if g is not None]
    assert len(taken) > 0.6 * len(texts)          # most texts: those without an added token
    for i in taken:
        assert got[i] == want[i], (model, texts[i])
    # without the specials (a cross-encoder's query and documents): `add_special_tokens=False`
    bare = [e.ids for e in ref.encode_batch(texts, add_special_tokens=False)]
    got = fast.encode(texts, specials=False)
    assert [i for i, g in enumerate(got) if g is not None] == taken
    for i in taken:
        assert got[i] == bare[i], (model, texts[i])
    # what it leaves to `tokenizers`: exactly the texts with an added token's content in them
    for i, g in enumerate(got):
        if g is None:
            low = texts[i].lower()
            assert any(a in low for a in ("[mask]", "[unk]", "[cls]", "[sep]", "[pad]")), texts[i]


@needs_build
@pytest.mark.parametrize("model", WORDPIECE_MODELS)
def test_every_character_past_ascii_it_takes_is_tokenized_as_tokenizers_does(model):
    """Each of the ~28,000 characters: alone, between letters, doubled inside a word, beside
    ASCII punctuation, and all of them in long texts; the same ids as `tokenizers`, which makes
    each a word alone (a CJK ideograph, punctuation) or a space (U+00A0, U+3000)."""
    path = resolve_model(model)[1]
    ref = _reference(path)
    fast, why = FastWordPiece.build(path / "tokenizer.json", ref)
    assert why is None
    assert len(EXTRA) > 27_000 and {"\u3000", "\u00a0", "，", "。", "“", "《", "…", "·"} <= set(EXTRA)
    texts = [t for c in EXTRA for t in (c, f"a{c}b", f"ab{c}{c}cd", f"({c}!")]
    texts += ["".join(EXTRA[i:i + 500]) for i in range(0, len(EXTRA), 500)]
    want = [e.ids for e in ref.encode_batch(texts, add_special_tokens=True)]
    got = fast.encode(texts)
    assert all(g is not None for g in got)
    bad = [t for t, g, w in zip(texts, got, want) if g != w]
    assert not bad, (model, bad[:5])


@needs_build
def test_other_non_ascii_texts_go_back_to_tokenizers_in_place():
    fast, why = FastWordPiece.build(resolve_model("all-MiniLM-L6-v2")[1] / "tokenizer.json")
    assert why is None
    texts = [ENGLISH[0], OTHERS[0], CHINESE[1], OTHERS[1], OTHERS[2], CHINESE[0]]
    got = fast.encode(texts)
    assert [g is None for g in got] == [False, True, False, True, True, False]
    assert fast.encode([]) == [] and fast.encode(list(OTHERS)) == [None] * len(OTHERS)


@needs_build
def test_without_spaces_around_cjk_in_the_normalizer_chinese_goes_to_tokenizers(tmp_path):
    """handle_chinese_chars off: an ideograph is no longer a word alone, so Chinese text is left
    to `tokenizers`; ASCII text, and ASCII with punctuation past it, still come here."""
    ref, fast = _minilm_normalizer(tmp_path, handle_chinese_chars=False)
    texts = [ENGLISH[1], CHINESE[0], "“quoted” — text…"]
    got = fast.encode(texts)
    assert got[1] is None and None not in (got[0], got[2])
    want = [e.ids for e in ref.encode_batch(texts, add_special_tokens=True)]
    assert got[0] == want[0] and got[2] == want[2]


@needs_build
def test_the_model_tokenizes_mixed_batches_as_tokenizers_does(minilm_model):
    """English and Chinese through C, accented text, emoji and added tokens through `tokenizers`,
    in the callers' order, with a query prefix too; the same ids as `tokenizers` alone."""
    assert minilm_model.fast_tokenizer is not None
    texts = [ENGLISH[0], OTHERS[0], ENGLISH[2], CHINESE[1], OTHERS[4], ENGLISH[5], "hello [MASK] world", OTHERS[1]]
    ref = _reference(minilm_model.path)
    for prefix in ("", "query: "):
        want = [e.ids for e in ref.encode_batch([prefix + t for t in texts], add_special_tokens=True)]
        minilm_model.prefixes["_probe"] = prefix
        try:
            assert minilm_model.tokenize(texts, "_probe") == want
        finally:
            del minilm_model.prefixes["_probe"]


@needs_build
def test_cased_wordpiece_keeps_case(tmp_path):
    """A tokenizer.json whose normalizer does not lowercase: pieces keep their case, as in
    `tokenizers` (the uncased vocabulary turns capitalised words into [UNK] or smaller pieces)."""
    ref, fast = _minilm_normalizer(tmp_path, lowercase=False)
    texts = list(ENGLISH) + _fuzz(7, 600)
    want = [e.ids for e in ref.encode_batch(texts, add_special_tokens=True)]
    got = fast.encode(texts)
    assert got[0] != fast_lower(texts[0])             # case matters here
    assert all(g == w for g, w in zip(got, want) if g is not None)


def fast_lower(text):
    fast, _ = FastWordPiece.build(resolve_model("all-MiniLM-L6-v2")[1] / "tokenizer.json")
    return fast.encode([text])[0]


@needs_build
def test_tokenizers_it_does_not_take_are_refused_with_the_reason(tmp_path):
    e5 = resolve_model("multilingual-e5-small")[1]
    fast, why = FastWordPiece.build(e5 / "tokenizer.json")
    assert fast is None and "normalizer" in why
    spec = json.loads((resolve_model("all-MiniLM-L6-v2")[1] / "tokenizer.json").read_text())
    for change, words in ((("normalizer", "clean_text", False), "normalizer"),
                          (("pre_tokenizer", "type", "Whitespace"), "pre-tokenizer"),
                          (("model", "max_input_chars_per_word", 5000), "max_input_chars_per_word")):
        bad = json.loads(json.dumps(spec))
        bad[change[0]][change[1]] = change[2]
        (tmp_path / "tokenizer.json").write_text(json.dumps(bad))
        fast, why = FastWordPiece.build(tmp_path / "tokenizer.json")
        assert fast is None and words in why


@needs_build
def test_a_tokenizer_that_disagrees_on_the_probes_is_not_used():
    path = resolve_model("all-MiniLM-L6-v2")[1]

    class Off:                          # `tokenizers` answering one id more for each probe
        def encode_batch(self, texts, add_special_tokens=True):
            return [type("E", (), {"ids": e.ids + [0]})() for e in _reference(path).encode_batch(texts)]

    fast, why = FastWordPiece.build(path / "tokenizer.json", Off())
    assert fast is None and "differ" in why


def test_the_switch_turns_it_off(minilm_dir, monkeypatch):
    from embedserve.models.embedding_model import EmbeddingModel
    monkeypatch.setenv("EMBEDSERVE_FAST_TOKENIZER", "0")
    assert compute.ComputePaths.from_env().fast_tokenizer is False
    with compute.override(fast_tokenizer=False):
        model = EmbeddingModel(minilm_dir, dtype="float32")
        assert model.fast_tokenizer is None
        want = [e.ids for e in _reference(minilm_dir).encode_batch(list(ENGLISH), add_special_tokens=True)]
        assert model.tokenize(list(ENGLISH)) == want


def test_without_a_c_tokenizer_every_text_goes_through_tokenizers(e5_model, monkeypatch):
    """A model no C tokenizer takes: every text through `tokenizers` (encode_batch_fast, no
    offsets), the same ids as its encode_batch, with and without specials."""
    monkeypatch.setattr(e5_model, "fast_tokenizer", None)
    texts = list(ENGLISH) + list(CHINESE) + list(OTHERS) + _fuzz(3, 300)
    ref = _reference(e5_model.path)
    assert e5_model.tokenize(texts) == [e.ids for e in ref.encode_batch(texts, add_special_tokens=True)]
    assert e5_model.content_ids(texts) == [e.ids for e in ref.encode_batch(texts, add_special_tokens=False)]


@needs_build
def test_small_calls_keep_the_gil_and_large_ones_let_it_go(monkeypatch):
    """A call on little text (a one-text request, tokenized on the event loop) goes through a PyDLL
    and keeps the GIL, so the loop never waits to win it back from the engine's thread; a large
    batch (tokenized in the thread pool) goes through the CDLL and lets the engine run beside it."""
    import ctypes
    from kernels.cpu_wordpiece import KEEP_GIL_BYTES
    lib = _library()[0]
    assert lib.encode_keeping_gil._flags_ & ctypes._FUNCFLAG_PYTHONAPI
    assert not lib.wp_encode_batch._flags_ & ctypes._FUNCFLAG_PYTHONAPI
    fast, why = FastWordPiece.build(resolve_model("all-MiniLM-L6-v2")[1] / "tokenizer.json")
    assert why is None
    used = []
    for attr in ("encode_keeping_gil", "wp_encode_batch"):
        real = getattr(lib, attr)
        monkeypatch.setattr(lib, attr, lambda *a, _real=real, _name=attr: (used.append(_name), _real(*a))[1])
    small = fast.encode([CHINESE[1]])
    many = [CHINESE[1]] * (KEEP_GIL_BYTES // len(CHINESE[1].encode()) + 1)
    big = fast.encode(many)
    assert used == ["encode_keeping_gil", "wp_encode_batch"]
    assert big == small * len(many)
