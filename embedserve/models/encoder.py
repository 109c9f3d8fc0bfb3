"""Our own BERT / XLM-RoBERTa encoder on packed (unpadded) token batches.

Every linear layer runs on the packed `(T, H)` matrix of real tokens only, so mixed lengths
cost no padding in the matmuls that dominate the FLOPs. Attention is the only place that
needs per-sequence structure. On a CPU it runs in a C kernel straight on the packed rows, each
sequence with its own tokens, no padding (`kernels.cpu_attention.varlen_attention`, head_dim a
multiple of 16 up to 64); elsewhere (or without a compiler) sequences are packed in length
order and cut into groups of near-equal length (`AttentionPlan`), each run as one padded
`scaled_dot_product_attention`.

    packed tokens (length-sorted):  [ s0 s0 s0 | s1 s1 s1 | s2 s2 | s3 ]
    attention groups:               [ g0: 2 seqs × 3      | g1: 2 seqs × 2, one pad ]

BERT and XLM-R share the math; they differ only in where position ids start
(XLM-R: `padding_idx + 1`) and in checkpoint key prefixes.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from kernels import compute, cpu_attention

from .linear import Linear

logger = logging.getLogger(__name__)

_KEY_PREFIXES = ("bert.", "roberta.", "model.", "encoder_model.")


@dataclass(slots=True)
class EncoderConfig:
    """The subset of a HF `config.json` our encoder needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0

    def __post_init__(self):
        if self.model_type not in ("bert", "xlm-roberta", "roberta"):
            raise ValueError(f"unsupported encoder model_type {self.model_type!r}; "
                             "embedserve encodes with BERT, RoBERTa and XLM-RoBERTa checkpoints")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"):
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}")

    @property
    def position_offset(self) -> int:
        """First position id: RoBERTa-family models count from `padding_idx + 1`."""
        return self.pad_token_id + 1 if self.model_type in ("xlm-roberta", "roberta") else 0

    @property
    def max_input_length(self) -> int:
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_dir(cls, path: Path) -> "EncoderConfig":
        raw = json.loads((Path(path) / "config.json").read_text())
        names = [f for f in cls.__dataclass_fields__]  # type: ignore[attr-defined]
        return cls(**{k: raw[k] for k in names if k in raw})


@dataclass(slots=True)
class AttentionPlan:
    """How the packed, length-sorted batch is cut into padded attention groups."""

    lengths: list[int]
    # (token_start, token_end, n_seqs, max_len, dest index into the padded (n*L) layout or None)
    groups: list[tuple[int, int, int, int, torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=list)
    computed_tokens: int = 0
    cu_seqlens: torch.Tensor | None = None       # int32 (B + 1,) sequence starts, for the C kernel

    @classmethod
    def build(cls, lengths: list[int], max_waste: float = 0.125) -> "AttentionPlan":
        """`lengths` must be sorted descending; a group grows while its padding stays under
        `max_waste` of its real tokens, so attention pads little and launches few kernels."""
        plan = cls(lengths=list(lengths),
                   cu_seqlens=torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32))
        tok = 0
        i = 0
        while i < len(lengths):
            j, real = i + 1, lengths[i]
            max_len = lengths[i]
            while j < len(lengths) and max_len * (j + 1 - i) <= (1 + max_waste) * (real + lengths[j]):
                real += lengths[j]
                j += 1
            n = j - i
            dest = mask = None
            if max_len * n != real:
                dest = torch.cat([torch.arange(L) + k * max_len for k, L in enumerate(lengths[i:j])])
                mask = torch.zeros(n, 1, 1, max_len, dtype=torch.bool)
                for k, L in enumerate(lengths[i:j]):
                    mask[k, 0, 0, :L] = True
            plan.groups.append((tok, tok + real, n, max_len, dest, mask))
            plan.computed_tokens += n * max_len
            tok += real
            i = j
        return plan


class Encoder(torch.nn.Module):
    """Post-LayerNorm transformer encoder (BERT / XLM-R) over packed tokens."""

    def __init__(self, cfg: EncoderConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu", pack: bool = True):
        """`pack`: linears packed for oneDNN where that runs (`models.linear`); False keeps the
        row-major weights (the int8 path quantizes from them)."""
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        H = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = H // cfg.num_attention_heads

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        self.word = w("embeddings.word_embeddings.weight")                   # (V, H)
        self.pos = w("embeddings.position_embeddings.weight")                # (P, H)
        tt = weights.get("embeddings.token_type_embeddings.weight")
        # the whole token-type table: a cross-encoder's second segment is type 1 (BERT); (types, H)
        self.types = (tt if tt is not None else torch.zeros(1, H)).to(device=device, dtype=dtype).contiguous()
        self.type0 = self.types[0]                                           # (H,)
        self.emb_ln = (w("embeddings.LayerNorm.weight"), w("embeddings.LayerNorm.bias"))
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"encoder.layer.{i}."
            a = p + "attention.self."
            self.layers.append({
                # q, k, v fused into one (3H, H) matmul
                "qkv": Linear(torch.cat([w(a + "query.weight"), w(a + "key.weight"), w(a + "value.weight")]),
                              torch.cat([w(a + "query.bias"), w(a + "key.bias"), w(a + "value.bias")]), pack),
                "attn_out": Linear(w(p + "attention.output.dense.weight"), w(p + "attention.output.dense.bias"), pack),
                "ln1": (w(p + "attention.output.LayerNorm.weight"), w(p + "attention.output.LayerNorm.bias")),
                "ffn_up": Linear(w(p + "intermediate.dense.weight"), w(p + "intermediate.dense.bias"), pack,
                                 act=self._fused_act()),
                "ffn_down": Linear(w(p + "output.dense.weight"), w(p + "output.dense.bias"), pack),
                "ln2": (w(p + "output.LayerNorm.weight"), w(p + "output.LayerNorm.bias")),
            })

    @classmethod
    def from_dir(cls, path: Path, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", pack: bool = True) -> "Encoder":
        """Load HF weights from safetensors only (never pickle)."""
        path = Path(path)
        return cls(EncoderConfig.from_dir(path), load_weights(path), dtype, device, pack)

    def num_parameters(self) -> int:
        n = self.word.numel() + self.pos.numel() + self.types.numel() + 2 * self.cfg.hidden_size
        for layer in self.layers:
            n += sum(t.numel() for v in layer.values() for t in (v if isinstance(v, tuple) else v.tensors()))
        return n

    def _fused_act(self) -> str:
        """The activation as `Linear` fuses it (the same choice as `_act`)."""
        act = self.cfg.hidden_act
        return act if act in ("gelu", "relu") else "gelu_tanh"

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        act = self.cfg.hidden_act
        if act == "gelu":
            return F.gelu(x)
        if act == "relu":
            return F.relu(x)
        return F.gelu(x, approximate="tanh")

    def _attention(self, qkv: torch.Tensor, plan: AttentionPlan, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """`cu_seqlens`: the plan's, or with the bucket's padding rows as one more sequence."""
        nh, hd = self.num_heads, self.head_dim
        H = nh * hd
        if _varlen_kernel_runs(qkv, nh):
            # the C kernel: each sequence on its own packed rows, no padding, no mask
            plan.computed_tokens = len(qkv)
            return cpu_attention.varlen_attention(qkv, cu_seqlens, nh, hd ** -0.5)
        pad = len(qkv) - int(plan.cu_seqlens[-1])
        if pad:                                                              # the bucket's rows: zeros
            return torch.cat([self._attention(qkv[:-pad], plan, plan.cu_seqlens), qkv.new_zeros(pad, H)])
        outs = []
        for start, end, n, L, dest, mask in plan.groups:
            g = qkv[start:end]                                               # (t, 3H)
            if dest is not None:
                padded = g.new_zeros(n * L, 3 * H)
                padded[dest.to(g.device)] = g
                g = padded
            q, k, v = g.view(n, L, 3, nh, hd).permute(2, 0, 3, 1, 4)         # each (n, nh, L, hd)
            if mask is not None:
                mask = mask.to(g.device)
            # bf16 in, fp32 attention: the CPU SDPA kernel is 1.1-2x faster in fp32 than in bf16
            # at these lengths (16-512), and the conversion costs less than the difference
            cpu_bf16 = g.dtype == torch.bfloat16 and g.device.type == "cpu"
            if cpu_bf16:
                q, k, v = q.float(), k.float(), v.float()
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)      # (n, nh, L, hd)
            o = o.transpose(1, 2).reshape(n * L, H)
            if cpu_bf16:
                o = o.to(torch.bfloat16)
            outs.append(o[dest.to(o.device)] if dest is not None else o)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _first_token_attention(self, qkv: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """Attention for each sequence's first token only, over all of its keys: (B, H) in plan
        order. One query row per sequence, so the padded groups' SDPA costs next to nothing."""
        nh, hd = self.num_heads, self.head_dim
        H = nh * hd
        outs = []
        for start, end, n, L, dest, mask in plan.groups:
            g = qkv[start:end]
            if dest is not None:
                padded = g.new_zeros(n * L, 3 * H)
                padded[dest.to(g.device)] = g
                g = padded
            g = g.view(n, L, 3, nh, hd)
            q = g[:, :1, 0].transpose(1, 2)                                  # (n, nh, 1, hd)
            k, v = g[:, :, 1].transpose(1, 2), g[:, :, 2].transpose(1, 2)    # (n, nh, L, hd)
            if g.dtype == torch.bfloat16 and g.device.type == "cpu":          # as in _attention
                q, k, v = q.float(), k.float(), v.float()
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.to(g.device))
            outs.append(o.reshape(n, H).to(qkv.dtype))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                plan: AttentionPlan, token_types: torch.Tensor | None = None,
                first_only: bool = False) -> torch.Tensor:
        """input_ids, position_ids: (T,) packed in `plan` order -> hidden states (T, H).
        `token_types` (T,): each token's segment (a cross-encoder's pairs); None: all type 0.
        `first_only`: only each sequence's first token's hidden state, (B, H) in plan order (what
        a cross-encoder's head and CLS pooling read): the last layer then computes its keys and
        values for every token but attention, the output projection and the FFN for the first
        tokens alone, ~3/4 of a layer's FLOPs saved (1/16 of a 12-layer model), the same math."""
        cfg = self.cfg
        H = cfg.hidden_size
        eps = cfg.layer_norm_eps
        T = len(input_ids)
        cu = plan.cu_seqlens
        pad = bucket_rows(T) - T if input_ids.device.type == "cpu" and compute.current().bucket_rows else 0
        if pad:       # rows of token 0 at position 0, their own sequence in attention, dropped at the end
            input_ids, position_ids = F.pad(input_ids, (0, pad)), F.pad(position_ids, (0, pad))
            token_types = None if token_types is None else F.pad(token_types, (0, pad))
            cu = torch.cat([cu, cu.new_tensor([T + pad])])
        types = self.type0 if token_types is None else self.types[token_types]
        x = self.word[input_ids] + self.pos[position_ids + cfg.position_offset] + types
        x = F.layer_norm(x, (H,), *self.emb_ln, eps)                          # (T, H)
        last = len(self.layers) - 1
        for i, p in enumerate(self.layers):
            qkv = p["qkv"](x)                                                # (T, 3H)
            if first_only and i == last:
                ctx = self._first_token_attention(qkv, plan)                 # (B, H)
                x = x[plan.cu_seqlens[:-1].to(device=x.device, dtype=torch.long)]
            else:
                ctx = self._attention(qkv, plan, cu)                         # (T, H)
            x = _add_layer_norm(x, p["attn_out"](ctx), p["ln1"], eps)
            up = p["ffn_up"]
            # Linear applies the activation itself (fused into the matmul); Int8Linear does not
            h = up(x) if getattr(up, "act", None) else self._act(up(x))      # (T, I)
            x = _add_layer_norm(x, p["ffn_down"](h), p["ln2"], eps)
        if first_only and not self.layers:
            x = x[plan.cu_seqlens[:-1].to(device=x.device, dtype=torch.long)]
        return x if first_only else x[:T]


def bucket_rows(T: int) -> int:
    """`T` rounded up to a bucket: 16 per doubling, 8-row steps below 256 (at most 1/16 more rows,
    ~3 % on average). oneDNN creates and JIT-compiles a matmul primitive for each row count it
    meets and caches it by shape; a bf16 linear on AMX took 13.5 ms for a new row count vs 2.5 ms
    for a cached one (3,500 x 384 -> 1,536), so a server whose every batch has a new token count
    paid that on each linear shape of every batch; bucketed, the shapes repeat."""
    step = max(8, (1 << (max(T, 1).bit_length() - 1)) >> 4)
    return -(-T // step) * step


def _add_layer_norm(x: torch.Tensor, y: torch.Tensor, ln: tuple[torch.Tensor, torch.Tensor],
                    eps: float) -> torch.Tensor:
    """LayerNorm(x + y): one pass in C on a CPU (torch's add and layer_norm are two passes over
    (T, H), 2x slower), else torch."""
    if cpu_attention.add_layer_norm_supports(x, y, *ln) and cpu_attention.available() is None:
        return cpu_attention.add_layer_norm(x, y, *ln, eps)
    return F.layer_norm(x + y, (x.shape[-1],), *ln, eps)


def _varlen_kernel_runs(qkv: torch.Tensor, num_heads: int) -> bool:
    return (cpu_attention.varlen_supports(qkv, num_heads) and cpu_attention.varlen_preferred()
            and cpu_attention.available() is None)


def activation_bytes(cfg: EncoderConfig, max_batch_tokens: int, max_len: int, bytes_per_el: int) -> int:
    """Peak activation memory for one batch: a few (T, H) and one (T, I) live at once, plus
    the attention scores of the largest group (SDPA's math path materializes them)."""
    T, H, I = max_batch_tokens, cfg.hidden_size, cfg.intermediate_size
    hidden = T * (6 * H + I) * bytes_per_el
    groups = max(1, max_batch_tokens // max(max_len, 1))
    scores = groups * cfg.num_attention_heads * max_len * max_len * 4
    return int(hidden + scores + T * 64)


def model_weight_bytes(path: Path, bytes_per_el: int) -> int:
    """Weight bytes after load, read from safetensors headers without loading tensors."""
    total = 0
    for f in Path(path).glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for k, meta in header.items():
            if k != "__metadata__":
                total += math.prod(meta["shape"]) * bytes_per_el
    return total


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_weights(path: Path, keys=None) -> dict[str, torch.Tensor]:
    """The safetensors weights of `path` (never pickle) under encoder names (the `bert.` /
    `roberta.` ... prefixes cut); with `keys`, only the tensors whose cut name `keys` accepts."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights; embedserve loads "
                                "safetensors only (convert pickled .bin weights first)")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                name = _cut_prefix(k)
                if keys is None or keys(name):
                    weights[name] = fh.get_tensor(k)
    return weights


def _cut_prefix(k: str) -> str:
    """The encoder's name of checkpoint key `k`: the model prefix cut, TF-era LayerNorm names
    (`gamma` / `beta`, as transformers renames them on load) made `weight` / `bias`."""
    for pre in _KEY_PREFIXES:
        if k.startswith(pre):
            k = k[len(pre):]
            break
    if k.endswith(".gamma"):
        return k[:-6] + ".weight"
    if k.endswith(".beta"):
        return k[:-5] + ".bias"
    return k


def load_encoder(path: Path, precision: str, device: torch.device | str = "cpu") -> Encoder:
    """The encoder of `path` in `precision` (`embedserve.precision` names it): float32, bfloat16,
    or int8 (int8 linear layers, the rest in bf16 where it is fast, else float32)."""
    if precision == "int8":
        from ..precision import fast_bf16_available
        from .int8 import quantize_encoder
        act = torch.bfloat16 if fast_bf16_available(device) else torch.float32
        return quantize_encoder(Encoder.from_dir(path, torch.float32, device, pack=False), act)
    return Encoder.from_dir(path, TORCH_DTYPES[precision], device)
