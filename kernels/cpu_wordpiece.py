"""BERT WordPiece tokenization of ASCII texts in C (`cpu_wordpiece.c`), the same ids as Hugging Face
`tokenizers` for the tokenizers it takes: 32 English texts in 0.13 ms against 1.81 ms (and ~3.4 ms
of CPU on `tokenizers`' two threads).

Why: at 32 texts per request, `tokenizers` spent ~3 ms of CPU per request of all-MiniLM-L6-v2 on
make bench's corpus while the encoder used the rest of the 2 cores, and each slice of it preempted
one of the model's two threads, the other waiting for it at the next barrier. Served, text reached
0.940-0.960 of the same texts sent as token ids without this path and 0.963-0.974 with it
(`python -m embedserve.studies.tokenize_bench`, BENCHMARKS.md).

What it takes: a tokenizer.json of BertNormalizer (clean_text on; lowercase or not) +
BertPreTokenizer + WordPiece, specials from TemplateProcessing or BertProcessing (BERT, MiniLM,
BGE's English models). Per text, only pure ASCII text without an added token's content
(`[MASK]`, ...) comes here; anything else (Chinese, accents, emoji) goes to `tokenizers` as
before, so the fast path never has to know Unicode's tables. A tokenizer it does not take, a
failed build, or EMBEDSERVE_FAST_TOKENIZER=0: everything goes to `tokenizers`.
`FastWordPiece.build` also checks its ids against `tokenizers` on probe texts before use.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
from pathlib import Path

import numpy as np

from . import cbuild

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_wordpiece.c")
MAX_CHARS = 1023                 # the C side's scratch word; a longer max_input_chars_per_word is refused

# texts whose ids must equal `tokenizers`' before the fast path is used (edges of each rule)
PROBES = ("", "Hello, World!", "don't stop-believing... (2024) #1 [test] {x} ~y~ `z` |a| \\b/ ^c^ _d_",
          "UPPER lower MiXeD 12345 3.14159 e-mail@example.com https://example.org/a?b=c&d=e",
          "tab\there\nnewline\r\ncarriage  double  space ", "ctrl\x01char\x7fdel\x0bvt\x0cff\x1fus",
          "antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
          "x" * 150 + " tail", "qzxqzxqzx zzzzzzzzzzzz", "a" * 99 + " " + "b" * 100 + " " + "c" * 101,
          "The quick brown fox jumps over the lazy dog. " * 3)

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
            lib.wp_encode_batch.argtypes = ([ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64]
                                            + [ctypes.c_int32] * 3 + [ctypes.c_void_p, ctypes.c_int32] * 2
                                            + [ctypes.c_void_p, ctypes.c_void_p])
            lib.wp_encode_batch.restype = ctypes.c_int64
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
    that `tokenizers` must take (non-ASCII, or holding an added token)."""

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
        self._before, self._after = (np.asarray(ids, dtype=np.int32) for ids in specials)

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
        """Whether `text` is one this tokenizer encodes exactly (ASCII, no added token in it)."""
        if not text.isascii():
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
        raw = [texts[i].encode("ascii") for i in mine]
        offsets = np.fromiter(itertools.accumulate(map(len, raw), initial=0), dtype=np.int64, count=len(raw) + 1)
        before, after = (self._before, self._after) if specials else (self._before[:0], self._after[:0])
        cap = int(offsets[-1]) + len(raw) * (len(before) + len(after))
        ids = np.empty(max(cap, 1), dtype=np.int32)
        where = np.empty(len(raw) + 1, dtype=np.int64)
        n = self._lib.wp_encode_batch(self._handle, b"".join(raw), offsets.ctypes.data, len(raw),
                                      int(self.lowercase), self.max_chars, self.unk,
                                      before.ctypes.data, len(before), after.ctypes.data, len(after),
                                      ids.ctypes.data, where.ctypes.data)
        flat, bounds = ids[:n].tolist(), where.tolist()
        for k, i in enumerate(mine):
            out[i] = flat[bounds[k]:bounds[k + 1]]
        return out
