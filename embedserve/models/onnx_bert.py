"""Read a dynamically quantized int8 ONNX BERT (onnxruntime's ``quantize_dynamic`` output) back
into float32 weights under Hugging Face's names (`embedserve.models.convert_onnx` writes them out).

What such a graph holds, and how each weight is found (`bert_weights_from_onnx`):

* LayerNorm weights and biases and every Linear bias stay float32 initializers under their
  Hugging Face names (``bert.encoder.layer.0.attention.self.query.bias``, ...); they are taken
  by name.
* Every Linear is ``DynamicQuantizeLinear(x) -> MatMulInteger(x_q, W_q, x_zp, W_zp) -> Cast ->
  Mul(scale) -> Add(bias)``. ``W_q`` is an int8 initializer in MatMul's (in, out) layout, often
  with an export-generated name (``onnx::MatMul_1662_quantized``), so its name comes from the
  graph: follow the MatMulInteger's output through Cast/Mul to the first Add whose other input
  is an initializer ``X.bias``; the weight is ``X.weight``. Its scale is the initializer that
  the Mul's scale input is built from; ``W = (W_q - W_zp) * scale``, per tensor or per output
  column, then transposed to torch's (out, in). A plain float MatMul with an initializer weight
  is placed by the same rule.
* The embeddings are uint8 tables read by ``Gather`` and dequantized after it
  (``Gather(W_q, ids) -> DequantizeLinear(., scale, zp)``), so they are named by their own
  initializer (``X.weight_quantized`` -> ``X.weight``).
* The head count is in no shape: it is read from the constant ``[..., heads, head_dim]`` tail of
  the Reshape that splits the query projection into heads, else taken from `default_heads` (the
  model card's value, 12 for both MiniLM-L12-H384 and bge-small).

Anything else is refused with ValueError: an initializer that is neither placed nor a small
integer shape constant, a placed name BERT does not have, a missing or mis-shaped weight, or a
quantized weight whose own name contradicts the bias it feeds.
"""

from __future__ import annotations

import logging
import re

import numpy as np

logger = logging.getLogger(__name__)

# The path from a MatMul(Integer) to its bias Add: at most Cast -> Mul (-> Mul) in front of it.
_PASS_THROUGH = {"Cast", "Mul"}
_MAX_HOPS = 4
# Integer initializers up to this many elements that feed no weight are graph constants (shapes,
# axes, indices) some exporters store as initializers instead of Constant nodes.
_MAX_SHAPE_CONSTANT = 16

_LAYER_PARTS = {  # HF submodule -> (out, in) of its weight, in terms of (H, FF)
    "attention.self.query": ("H", "H"),
    "attention.self.key": ("H", "H"),
    "attention.self.value": ("H", "H"),
    "attention.output.dense": ("H", "H"),
    "intermediate.dense": ("FF", "H"),
    "output.dense": ("H", "FF"),
}
_LAYER_NORMS = ("attention.output.LayerNorm", "output.LayerNorm")


# ------------------------------------------------------------------ reading the graph


class _Graph:
    """Initializers as numpy arrays, Constant node values, and who produces / consumes what."""

    def __init__(self, model) -> None:
        from onnx import numpy_helper

        g = model.graph
        self.init = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        self.const = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in g.node
                      if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
        self.nodes = list(g.node)
        self.producer = {out: n for n in self.nodes for out in n.output}
        self.consumers: dict[str, list] = {}
        for n in self.nodes:
            for x in n.input:
                self.consumers.setdefault(x, []).append(n)

    def value(self, name: str) -> np.ndarray | None:
        """The constant value of tensor `name` (an initializer or a Constant node), else None."""
        if name in self.init:
            return self.init[name]
        return self.const.get(name)

    def only_consumer(self, name: str):
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 else None


def _strip(name: str, suffix: str) -> str:
    return name[: -len(suffix)] if name.endswith(suffix) else name


def _bias_after(g: _Graph, out: str, where: str) -> str:
    """Follow `out` through Cast/Mul to the Add with an ``X.bias`` initializer; return that name."""
    for _ in range(_MAX_HOPS):
        node = g.only_consumer(out)
        if node is None:
            raise ValueError(f"{where}: its output {out!r} does not lead to a single bias Add")
        if node.op_type == "Add":
            biases = [x for x in node.input if x in g.init and x.endswith(".bias")]
            if len(biases) != 1:
                raise ValueError(f"{where}: the Add {node.name!r} after it has no `.bias` initializer")
            return biases[0]
        if node.op_type not in _PASS_THROUGH:
            raise ValueError(f"{where}: reached {node.op_type} {node.name!r} before any bias Add")
        out = node.output[0]
    raise ValueError(f"{where}: no bias Add within {_MAX_HOPS} nodes of its output")


def _weight_scale(g: _Graph, node, w_name: str) -> tuple[str, np.ndarray]:
    """The scale initializer of a MatMulInteger's weight: the output-scale Mul after its Cast
    multiplies by (activation scale x weight scale); the weight scale is the initializer there."""
    out = node.output[0]
    for _ in range(_MAX_HOPS):
        nxt = g.only_consumer(out)
        if nxt is None or nxt.op_type not in _PASS_THROUGH:
            break
        if nxt.op_type == "Mul":
            for x in nxt.input:
                if x == out:
                    continue
                if x in g.init:
                    return x, g.init[x]
                src = g.producer.get(x)
                if src is not None and src.op_type == "Mul":
                    found = [y for y in src.input if y in g.init]
                    if len(found) == 1:
                        return found[0], g.init[found[0]]
        out = nxt.output[0]
    # onnxruntime's quantizer names the scale after the weight; use it only if the trace failed
    name = _strip(w_name, "_quantized") + "_scale"
    if name in g.init:
        return name, g.init[name]
    raise ValueError(f"{node.name!r}: cannot find the scale of its weight {w_name!r}")


def _dequantize(q: np.ndarray, zero_point: np.ndarray, scale: np.ndarray, axis: int, what: str) -> np.ndarray:
    """(q - zero_point) * scale in float32; per tensor (scalars) or per slice along `axis`."""
    scale = np.asarray(scale, np.float32)
    zp = np.asarray(zero_point).astype(np.float32)
    if scale.size != 1 or zp.size != 1:
        n = q.shape[axis]
        if scale.size not in (1, n) or zp.size not in (1, n):
            raise ValueError(f"{what}: scale {scale.shape} / zero point {zp.shape} fit neither per "
                             f"tensor nor per channel of shape {q.shape}")
        shape = [1] * q.ndim
        shape[axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    return ((q.astype(np.float32) - zp) * scale).astype(np.float32)


def _place(placed: dict, used: set, name: str, array: np.ndarray, sources: list[str]) -> None:
    if name in placed:
        raise ValueError(f"{name}: two graph weights map to it ({sorted(sources)})")
    placed[name] = array
    used.update(sources)


def _linear_weights(g: _Graph, placed: dict, used: set) -> None:
    """Every MatMulInteger, and every MatMul with an initializer weight, named by its bias."""
    for node in g.nodes:
        if node.op_type == "MatMulInteger":
            w_name = node.input[1]
            if w_name not in g.init:
                continue  # an activation x activation product (none in BERT, refused later if any)
            if len(node.input) < 4 or node.input[3] not in g.init:
                raise ValueError(f"{node.name!r}: weight {w_name!r} has no zero-point initializer")
            zp_name = node.input[3]
            s_name, scale = _weight_scale(g, node, w_name)
            w = _dequantize(g.init[w_name], g.init[zp_name], scale, 1, w_name)
            sources = [w_name, zp_name, s_name]
        elif node.op_type == "MatMul" and node.input[1] in g.init:
            w_name = node.input[1]
            w, sources = g.init[w_name].astype(np.float32), [w_name]
        else:
            continue
        bias = _bias_after(g, node.output[0], f"{node.op_type} {node.name!r}")
        name = _strip(bias, ".bias") + ".weight"
        own = _strip(w_name, "_quantized")
        if not own.startswith("onnx::") and own != name:
            raise ValueError(f"{w_name!r} feeds the bias {bias!r}: its name and its place disagree")
        if w.ndim != 2:
            raise ValueError(f"{w_name!r}: a {w.ndim}-d MatMul weight, expected (in, out)")
        _place(placed, used, name, np.ascontiguousarray(w.T), sources)  # (in, out) -> (out, in)


def _embedding_weights(g: _Graph, placed: dict, used: set) -> None:
    """Quantized tables: Gather(W_q) -> DequantizeLinear, or DequantizeLinear(W_q) -> Gather."""
    for node in g.nodes:
        if node.op_type != "DequantizeLinear":
            continue
        src = node.input[0]
        if src not in g.init:
            gather = g.producer.get(src)
            if gather is None or gather.op_type != "Gather" or gather.input[0] not in g.init:
                raise ValueError(f"DequantizeLinear {node.name!r} reads neither a weight nor a Gather of one")
            src = gather.input[0]
        if len(node.input) < 3 or node.input[1] not in g.init or node.input[2] not in g.init:
            raise ValueError(f"DequantizeLinear {node.name!r}: scale and zero point must be initializers")
        table = g.init[src]
        # a per-channel scale of a table can only run along its rows' hidden axis, the last one
        w = _dequantize(table, g.init[node.input[2]], g.init[node.input[1]], table.ndim - 1, src)
        _place(placed, used, _strip(src, "_quantized"), w, [src, node.input[1], node.input[2]])
    for node in g.nodes:  # float tables read directly
        if node.op_type == "Gather" and node.input[0] in g.init and node.input[0] not in used:
            table = g.init[node.input[0]]
            if table.dtype == np.float32:
                _place(placed, used, node.input[0], table, [node.input[0]])


def _heads(g: _Graph, query_bias: str, hidden: int) -> int | None:
    """Heads from the Reshape that splits the query projection: its shape ends [heads, head_dim]."""
    add = next((n for n in g.consumers.get(query_bias, []) if n.op_type == "Add"), None)
    if add is None:
        return None
    for node in g.consumers.get(add.output[0], []):
        if node.op_type != "Reshape":
            continue
        shape = g.value(node.input[1])
        if shape is None:  # built at run time: Concat(batch, seq, [heads], [head_dim])
            concat = g.producer.get(node.input[1])
            if concat is None or concat.op_type != "Concat" or len(concat.input) < 2:
                continue
            tail = [g.value(x) for x in concat.input[-2:]]
            if any(t is None or t.size != 1 for t in tail):
                continue
            shape = np.array([int(t.reshape(-1)[0]) for t in tail])
        heads, head_dim = (int(v) for v in np.asarray(shape).reshape(-1)[-2:])
        if heads > 0 and head_dim > 0 and heads * head_dim == hidden:
            return heads
    return None


def _expected_shapes(prefix: str, cfg: dict, pooler: bool, classifier: bool) -> dict[str, tuple]:
    H, FF = cfg["hidden_size"], cfg["intermediate_size"]
    dims = {"H": H, "FF": FF}
    e = prefix + "embeddings."
    out = {
        e + "word_embeddings.weight": (cfg["vocab_size"], H),
        e + "position_embeddings.weight": (cfg["max_position_embeddings"], H),
        e + "token_type_embeddings.weight": (cfg["type_vocab_size"], H),
        e + "LayerNorm.weight": (H,),
        e + "LayerNorm.bias": (H,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}encoder.layer.{i}."
        for part, (o, n) in _LAYER_PARTS.items():
            out[p + part + ".weight"] = (dims[o], dims[n])
            out[p + part + ".bias"] = (dims[o],)
        for ln in _LAYER_NORMS:
            out[p + ln + ".weight"] = (H,)
            out[p + ln + ".bias"] = (H,)
    if pooler:
        out[prefix + "pooler.dense.weight"] = (H, H)
        out[prefix + "pooler.dense.bias"] = (H,)
    if classifier:
        out["classifier.weight"] = (cfg["num_labels"], H)
        out["classifier.bias"] = (cfg["num_labels"],)
    return out


def bert_weights_from_onnx(model, default_heads: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """(float32 tensors under HF BERT names, hyperparameters) of a quantized ONNX BERT
    `model` (an onnx.ModelProto); ValueError for anything that does not fit BERT exactly."""
    g = _Graph(model)
    placed: dict[str, np.ndarray] = {}
    used: set[str] = set()
    _linear_weights(g, placed, used)
    _embedding_weights(g, placed, used)
    for name, arr in g.init.items():  # LayerNorms and biases keep their own names
        if name not in used and arr.dtype == np.float32 and name.endswith((".weight", ".bias")):
            _place(placed, used, name, arr.astype(np.float32), [name])

    unplaced = [n for n, a in g.init.items() if n not in used
                and not (a.dtype.kind in "iu" and a.size <= _MAX_SHAPE_CONSTANT
                         and a.dtype not in (np.int8, np.uint8))]
    if unplaced:
        raise ValueError(f"initializers that are no BERT weight this converter can place: {sorted(unplaced)}")

    # BertForSequenceClassification nests the encoder under `bert.`; a bare BertModel does not.
    word = [n for n in placed if n.endswith("embeddings.word_embeddings.weight")]
    if len(word) != 1:
        raise ValueError(f"expected one word-embedding table, found {word}")
    prefix = _strip(word[0], "embeddings.word_embeddings.weight")
    if prefix not in ("", "bert."):
        raise ValueError(f"unknown name prefix {prefix!r} (expected 'bert.' or none)")
    layers = {int(m.group(1)) for n in placed if (m := re.match(re.escape(prefix) + r"encoder\.layer\.(\d+)\.", n))}
    classifier = "classifier.weight" in placed
    pooler = prefix + "pooler.dense.weight" in placed
    if classifier and not pooler:
        raise ValueError("a classifier without a pooler: not a BertForSequenceClassification graph")

    def shape(name: str) -> tuple:
        if name not in placed:
            raise ValueError(f"missing weight {name}")
        return placed[name].shape

    e = prefix + "embeddings."
    vocab, hidden = shape(e + "word_embeddings.weight")
    cfg = {
        "hidden_size": int(hidden),
        "num_hidden_layers": max(layers) + 1 if layers else 0,
        "intermediate_size": int(shape(f"{prefix}encoder.layer.0.intermediate.dense.weight")[0]),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(shape(e + "position_embeddings.weight")[0]),
        "type_vocab_size": int(shape(e + "token_type_embeddings.weight")[0]),
        "num_labels": int(shape("classifier.weight")[0]) if classifier else 0,
        "architecture": "BertForSequenceClassification" if classifier else "BertModel",
    }
    heads = _heads(g, f"{prefix}encoder.layer.0.attention.self.query.bias", cfg["hidden_size"])
    if heads is None:
        if default_heads is None:
            raise ValueError("the head count is in no Reshape of the graph; pass default_heads")
        logger.info("head count not found in the graph; using the model's known %d", default_heads)
        heads = default_heads
    if cfg["hidden_size"] % heads:
        raise ValueError(f"hidden size {cfg['hidden_size']} is not a multiple of {heads} heads")
    cfg["num_attention_heads"] = heads

    want = _expected_shapes(prefix, cfg, pooler, classifier)
    missing = sorted(want.keys() - placed.keys())
    extra = sorted(placed.keys() - want.keys())
    if missing or extra:
        raise ValueError(f"not the weights of a {cfg['architecture']}: missing={missing} unexpected={extra}")
    for name, s in want.items():
        if placed[name].shape != s:
            raise ValueError(f"{name}: shape {placed[name].shape}, expected {s}")
    return placed, cfg
