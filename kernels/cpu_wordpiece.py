"""BERT WordPiece tokenization in C (`cpu_wordpiece.c`), the same ids as Hugging Face `tokenizers`
for the tokenizers it takes: 32 English texts in 0.13 ms against 1.81 ms (and ~3.4 ms of CPU on
`tokenizers`' two threads).

Why: at 32 texts per request, `tokenizers` spent ~3 ms of CPU per request of all-MiniLM-L6-v2 on
make bench's corpus while the encoder used the rest of the 2 cores, and each slice of it preempted
one of the model's two threads, the other waiting for it at the next barrier. Served, text reached
0.940-0.960 of the same texts sent as token ids without this path and 0.963-0.974 with it
(`python -m embedserve.studies.tokenize_bench`, BENCHMARKS.md). A one-text request is tokenized on
the event loop, where `tokenizers` took ~100 µs for one short Chinese text and this path ~5.

What it takes: a tokenizer.json of BertNormalizer (clean_text on; lowercase or not) +
BertPreTokenizer + WordPiece, specials from TemplateProcessing or BertProcessing (BERT, MiniLM,
BGE's English models). Per text, it takes ASCII text, and text whose other characters are all
`EXTRA_CHARS`: CJK ideographs, punctuation that neither lowercasing nor NFD changes, and two
spaces. For each of those the normalizer and the pre-tokenizer do one simple thing: the character
is a word alone, or a space. A text holding an added token's content (`[MASK]`, ...), or any other
character (accents, emoji, fullwidth letters), goes to `tokenizers` as before. So the fast path
needs no Unicode tables beyond that list. A tokenizer it does not take, a failed build, or
EMBEDSERVE_FAST_TOKENIZER=0: everything goes to `tokenizers`. `FastWordPiece.build` also checks its
ids against `tokenizers` on probe texts before use.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import re
import unicodedata
from pathlib import Path

import numpy as np

from . import cbuild

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_wordpiece.c")
MAX_CHARS = 1023                 # the C side's scratch word; a longer max_input_chars_per_word is refused
KEEP_GIL_BYTES = 4096            # a call on at most this much text keeps the GIL (see `_library`)



def _extra_chars() -> str:
    """The characters past ASCII the C path takes, each a word alone or a space there as in
    `tokenizers`: the CJK ideographs of U+3400-4DBF and U+4E00-9FFF (BertNormalizer puts spaces
    around them; the compatibility ideographs, which NFD changes, are not among them), the
    punctuation (P*) of the Latin-1, general-punctuation, CJK, vertical, small and fullwidth forms
    blocks that lowercasing and NFD leave as they are (BertPreTokenizer splits it off), and U+00A0
    and U+3000 (whitespace to clean_text). tests/test_cpu_wordpiece.py checks every one of them
    against `tokenizers` for each bundled WordPiece model."""
    punct = "".join(c for lo, hi in ((0xA1, 0xBF), (0x2010, 0x205E), (0x3001, 0x303F), (0xFE10, 0xFE6B),
                                     (0xFF01, 0xFF65))
                    for c in map(chr, range(lo, hi + 1))
                    if unicodedata.category(c).startswith("P") and unicodedata.normalize("NFD", c) == c
                    and c.lower() == c)
    return CJK + re.escape(punct) + "\u00a0\u3000"


CJK = "\u3400-\u4dbf\u4e00-\u9fff"
EXTRA_CHARS = _extra_chars()
# texts taken whole: with the CJK ideographs, or without them (a normalizer that does not put spaces
# around them: `handle_chinese_chars` off)
_TAKEN = {True: re.compile(f"[\\x00-\\x7f{EXTRA_CHARS}]*").fullmatch,
          False: re.compile(f"[\\x00-\\x7f{EXTRA_CHARS.replace(CJK, '')}]*").fullmatch}

# texts whose ids must equal `tokenizers`' before the fast path is used (edges of each rule)
PROBES = ("", "Hello, World!", "don't stop-believing... (2024) #1 [test] {x} ~y~ `z` |a| \\b/ ^c^ _d_",
          "UPPER lower MiXeD 12345 3.14159 e-mail@example.com https://example.org/a?b=c&d=e",
          "tab\there\nnewline\r\ncarriage  double  space ", "ctrl\x01char\x7fdel\x0bvt\x0cff\x1fus",
          "antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
          "x" * 150 + " tail", "qzxqzxqzx zzzzzzzzzzzz", "a" * 99 + " " + "b" * 100 + " " + "c" * 101,
          "The quick brown fox jumps over the lazy dog. " * 3,
          "北京是中国的首都。我用Python写代码，速度很快！",
          "“引号”（括号）《书名》【注】、顿号…省略号——破折号",
          "全角\u3000空格\u00a0不换行 ¿¡·§ 〜！＂＃％＆＇（）＊，－．／：；？＠［＼］＿｛｝｟｠｡｢｣､･")

_lib: tuple[ctypes.CDLL | None, str | None] | None = None


def _library() -> tuple[ctypes.CDLL | None, str | None]:
    global _lib
    if _lib is None:
        path, why = cbuild.built(SOURCE)
        lib = None
        if path is not None:
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as exc:
                why = f"loading {path.name} failed: {exc}"
        if lib is not None:
            lib.wp_vocab_new.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_char_p, ctypes.c_int32]
            lib.wp_vocab_new.restype = ctypes.c_void_p
            lib.wp_vocab_free.argtypes, lib.wp_vocab_free.restype = [ctypes.c_void_p], None
            # the same function twice: through the CDLL it drops the GIL for the call, through a
            # PyDLL of the same library it keeps it. A call that drops it must win it back after:
            # beside a thread running Python (the engine's, between torch ops) a one-text call took
            # ~220 µs for ~40 µs of work, on the event loop, which tokenizes small requests. Small
            # batches keep the GIL; large ones (in the thread pool, ~0.1 ms and more) let the
            # engine's thread run beside them.
            lib.encode_keeping_gil = ctypes.PyDLL(str(path)).wp_encode_batch
            for fn in (lib.wp_encode_batch, lib.encode_keeping_gil):
                fn.argtypes = ([ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64]
                               + [ctypes.c_int32] * 3 + [ctypes.c_void_p, ctypes.c_int32] * 2
                               + [ctypes.c_void_p, ctypes.c_void_p])
                fn.restype = ctypes.c_int64
        _lib = (lib, why)
    return _lib


def read_spec(tokenizer_json: Path | dict) -> dict | str:
    """A tokenizer.json's content (given as is where it already is), or why it cannot be read."""
    if isinstance(tokenizer_json, dict):
        return tokenizer_json
    try:
        return json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"cannot read {tokenizer_json}: {exc}"


def template_specials(post: dict | None) -> tuple[list[int], list[int]] | str:
    """([CLS]-like ids before a text, [SEP]-like ids after) of the post-processor, or why not taken."""
    if post is None:
        return [], []
    if post.get("type") == "BertProcessing":
        return [int(post["cls"][1])], [int(post["sep"][1])]
    if post.get("type") != "TemplateProcessing":
        return f"post-processor {post.get('type')!r}"
    before: list[int] = []
    after: list[int] = []
    seen = False
    for piece in post.get("single", []):
        if "Sequence" in piece:
            if seen or piece["Sequence"].get("id") != "A":
                return "a template with other than one sequence"
            seen = True
        elif "SpecialToken" in piece:
            ids = post.get("special_tokens", {}).get(piece["SpecialToken"]["id"], {}).get("ids")
            if not ids:
                return f"template token {piece['SpecialToken']['id']!r} without ids"
            (after if seen else before).extend(int(i) for i in ids)
        else:
            return "a template piece of another kind"
    return (before, after) if seen else "a template without the sequence"


class FastWordPiece:
    """The C tokenizer for one tokenizer.json; `encode` gives each text's ids, or None for a text
    that `tokenizers` must take (another character past ASCII, or an added token)."""

    def __init__(self, lib: ctypes.CDLL, spec: dict, vocab: dict[str, int], specials: tuple[list[int], list[int]]):
        """`specials`: the ids before and after a text (`template_specials`, which `build` checked)."""
        model = spec["model"]
        self._lib = lib
        self.lowercase = bool(spec["normalizer"].get("lowercase", True))
        self.max_chars = int(model.get("max_input_chars_per_word", 100))
        self.unk = vocab[model.get("unk_token", "[UNK]")]
        added = spec.get("added_tokens") or []
        self.added = tuple({a["content"].lower() for a in added if a.get("content")})
        self.added_normalized = any(a.get("normalized") for a in added)
        keys = [k.encode("utf-8") for k in vocab]
        offsets = np.fromiter(itertools.accumulate(map(len, keys), initial=0), dtype=np.int64, count=len(keys) + 1)
        ids = np.fromiter(vocab.values(), dtype=np.int32, count=len(vocab))
        prefix = model.get("continuing_subword_prefix", "##").encode("utf-8")
        self._handle = lib.wp_vocab_new(b"".join(keys), offsets.ctypes.data, ids.ctypes.data, len(keys),
                                        prefix, len(prefix))
        if not self._handle:
            raise MemoryError("the WordPiece vocabulary table could not be allocated")
        self._before, self._after = ((ctypes.c_int32 * len(ids))(*ids) for ids in specials)
        self._none = (ctypes.c_int32 * 0)()
        # CJK ideographs are words alone only where the normalizer puts spaces around them
        self._taken = _TAKEN[bool(spec["normalizer"].get("handle_chinese_chars", True))]

    def __del__(self):
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.wp_vocab_free(handle)

    @classmethod
    def build(cls, tokenizer_json: Path | dict, reference=None) -> tuple["FastWordPiece | None", str | None]:
        """(the fast tokenizer, None) or (None, why not) for a tokenizer.json (its path, or its
        content). `reference`: the `tokenizers.Tokenizer` it must agree with on `PROBES` (specials
        added, no truncation or padding)."""
        spec = read_spec(tokenizer_json)
        if isinstance(spec, str):
            return None, spec
        norm, pre, model = spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}, spec.get("model") or {}
        if norm.get("type") != "BertNormalizer" or not norm.get("clean_text", True):
            return None, f"normalizer {norm.get('type')!r} (BertNormalizer with clean_text is what it takes)"
        if pre.get("type") != "BertPreTokenizer":
            return None, f"pre-tokenizer {pre.get('type')!r} (BertPreTokenizer is what it takes)"
        if model.get("type") != "WordPiece":
            return None, f"model {model.get('type')!r} (WordPiece is what it takes)"
        vocab = model.get("vocab") or {}
        if model.get("unk_token", "[UNK]") not in vocab:
            return None, "the unknown token is not in the vocabulary"
        if not 0 < int(model.get("max_input_chars_per_word", 100)) <= MAX_CHARS:
            return None, f"max_input_chars_per_word past {MAX_CHARS}"
        if len(model.get("continuing_subword_prefix", "##").encode("utf-8")) > 15:
            return None, "a continuation prefix past 15 bytes"
        specials = template_specials(spec.get("post_processor"))
        if isinstance(specials, str):
            return None, specials
        lib, why = _library()
        if lib is None:
            return None, why
        fast = cls(lib, spec, vocab, specials)
        if reference is not None:
            want = [e.ids for e in reference.encode_batch(list(PROBES), add_special_tokens=True)]
            got = fast.encode(list(PROBES))
            bad = next((p for p, w, g in zip(PROBES, want, got) if g is not None and g != w), None)
            if bad is not None:
                return None, f"its ids differ from tokenizers' on the probe text {bad[:40]!r}"
        return fast, None

    def takes(self, text: str) -> bool:
        """Whether `text` is one this tokenizer encodes exactly (ASCII and `EXTRA_CHARS`, no added
        token in it)."""
        if not text.isascii() and not self._taken(text):
            return False
        if self.added:
            low = text.lower()
            if any(a in low for a in self.added):
                return False
            if self.added_normalized and any(c < " " and c not in "\t\n\r" or c == "\x7f" for c in text):
                return False                     # removed controls could join an added token's pieces
        return True

    def encode(self, texts: list[str], specials: bool = True) -> list[list[int] | None]:
        """Each text's ids (with the specials around them, or without: `add_special_tokens`), or
        None for one it does not take."""
        mine = [i for i, t in enumerate(texts) if self.takes(t)]
        out: list[list[int] | None] = [None] * len(texts)
        if not mine:
            return out
        # ctypes arrays, not numpy: for the one-text requests tokenized on the event loop, numpy's
        # array set-up and its `.ctypes` views had cost ~30 µs a call, several times the C work
        raw = [texts[i].encode("utf-8") for i in mine]
        n = len(raw)
        offsets = (ctypes.c_int64 * (n + 1))(0, *itertools.accumulate(map(len, raw)))
        before, after = (self._before, self._after) if specials else (self._none, self._none)
        ids = (ctypes.c_int32 * max(offsets[n] + n * (len(before) + len(after)), 1))()
        where = (ctypes.c_int64 * (n + 1))()
        fn = self._lib.encode_keeping_gil if offsets[n] <= KEEP_GIL_BYTES else self._lib.wp_encode_batch
        fn(self._handle, b"".join(raw), offsets, n, int(self.lowercase), self.max_chars, self.unk, before,
           len(before), after, len(after), ids, where)
        for k, i in enumerate(mine):
            out[i] = ids[where[k]:where[k + 1]]
        return out
