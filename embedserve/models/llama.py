"""Our Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged
KV cache. One forward takes the step's packed tokens of every scheduled sequence:

    input_ids, positions: (T,)   ->  hidden (T, H)  ->  logits of the rows that sample

Weights load from HF safetensors only; linears are packed for oneDNN where that runs
(`linear`), and steps of a few sequences read the row-major weights through `gemv` in fp32.
Attention goes through `attention_dispatch`: the Triton kernels on a GPU; on the CPU the C
kernels of `kernels/cpu_attention` (paged decode attention, and the glue around it: residual
add + RMSNorm, RoPE + K/V store, SiLU x up) where they are built, else the torch reference.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kernels import compute, cpu_attention, cpu_decode
from kernels.cpu_decode import DecodeLayers

from .attention_dispatch import AttentionMetadata, paged_attention, store_kv
from .decode_int8 import WeightInt8Linear, int8_available
from .linear import GEMV_BF16_MAX_ROWS, GEMV_MAX_ROWS, Linear, small_rows_kernel

logger = logging.getLogger(__name__)

# the most bytes of row-major decoder weights kept beside the packed ones for `gemv` (SmolLM2-135M
# in fp32 keeps 405 MiB); a larger decoder takes the packed matmul at every batch size
GEMV_COPY_LIMIT = 1 << 30


@dataclass(slots=True)
class LlamaConfig:
    """The fields of a HF Llama `config.json` the decoder needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_dir(cls, path: Path) -> "LlamaConfig":
        raw = json.loads((Path(path) / "config.json").read_text())
        if raw.get("model_type") not in ("llama", "mistral", "qwen2", None):
            raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not a Llama-family decoder")
        rope = raw.get("rope_parameters") or {}
        theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = raw.get("eos_token_id")
        gen = Path(path) / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        nh = raw["num_attention_heads"]
        return cls(vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                   intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
                   num_attention_heads=nh, num_key_value_heads=raw.get("num_key_value_heads", nh),
                   head_dim=raw.get("head_dim") or raw["hidden_size"] // nh,
                   rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
                   rope_scaling=scaling, max_position_embeddings=raw.get("max_position_embeddings", 2048),
                   tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                   eos_token_ids=eos_ids, bos_token_id=raw.get("bos_token_id"))

    def kv_bytes_per_token(self, bytes_per_el: int) -> int:
        """2 (K and V) × layers × kv_heads × head_dim × bytes per element."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_el


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies with the checkpoint's theta and scaling (linear or llama3)."""
    d = cfg.head_dim
    # float32 like HF's own computation, so greedy outputs match it bit for bit where they can
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind not in ("default", None):
        raise ValueError(f"rope scaling {kind!r} is not supported")
    return inv.float()


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's *.safetensors files (never a pickle)."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights (embedserve never unpickles weights)")
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


class LlamaModel:
    """Weights as plain tensors; `forward` runs one packed step."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu", linear_weights: str = "native"):
        """`linear_weights`: "native" (the linears in `dtype`) or "int8" (weight-only int8 per
        output channel, `decode_int8`; a CPU path)."""
        if linear_weights not in ("native", "int8"):
            raise ValueError(f"linear_weights {linear_weights!r}: choose native or int8")
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.linear_weights = linear_weights
        self._fused_memo: tuple | None = None          # (the KV cache pool, its DecodeLayers or None)
        if linear_weights == "int8":
            why = int8_available(self.device.type)
            if why is not None:
                raise ValueError(why)

        def w(name):
            return weights[name].to(device=self.device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")                               # (V, H)
        self.tied = cfg.tie_word_embeddings or "lm_head.weight" not in weights
        # Steps of a few sequences take `gemv` on the row-major weights (see linear.py), which keeps
        # them beside the packed copies: while that extra copy stays under GEMV_COPY_LIMIT bytes.
        # The tied head's row-major matrix is the embedding table, held anyway.
        copy_bytes = sum(t.numel() for k, t in weights.items() if (k.startswith("model.layers.")
                         and k.endswith("_proj.weight")) or (k == "lm_head.weight" and not self.tied)
                         ) * torch.empty((), dtype=dtype).element_size()
        small = copy_bytes <= GEMV_COPY_LIMIT and linear_weights == "native"

        def linear(weight, bias=None, small_rows=small):
            if linear_weights == "int8":
                return WeightInt8Linear(weight, bias)
            return Linear(weight, bias, small_rows=small_rows)

        # the tied head packs its own copy of the embedding matrix (the lookup needs it row-major)
        self.lm_head = linear(self.embed if self.tied else w("lm_head.weight"), small_rows=self.tied or small)
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "in_norm": w(p + "input_layernorm.weight"),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                # q, k, v as one matmul; gate and up as one matmul
                "wqkv": linear(torch.cat([w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"),
                                          w(p + "self_attn.v_proj.weight")]),
                               torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                               if p + "self_attn.q_proj.bias" in weights else None),
                "wo": linear(w(p + "self_attn.o_proj.weight")),
                "wgu": linear(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])),
                "wd": linear(w(p + "mlp.down_proj.weight")),
            })
        self.inv_freq = rope_inv_freq(cfg).to(self.device)
        extra = sum(v.extra_bytes() for layer in self.layers for v in layer.values() if isinstance(v, Linear))
        if not self.tied:
            extra += self.lm_head.extra_bytes()
        why = small_rows_kernel(dtype, self.device.type)
        if linear_weights == "int8":
            logger.info("decoder: weight-only int8 linears (%.0f MB read per step, activations in %s)",
                        self.weight_bytes_per_step() / 2**20, dtype)
        elif why is None and small:
            logger.info("decoder: steps of up to %d sequences take the row-major GEMV kernel (%.0f MB of "
                        "row-major weights kept beside the packed ones)", self._gemv_rows(), extra / 2**20)
        else:
            logger.info("decoder: every step takes the packed matmul: %s", why or (
                f"the row-major copy would be {copy_bytes / 2**20:.0f} MB, over {GEMV_COPY_LIMIT / 2**20:.0f} MB"))

    @classmethod
    def from_dir(cls, path: Path, dtype: torch.dtype = torch.float32, device="cpu",
                 linear_weights: str = "native") -> "LlamaModel":
        return cls(LlamaConfig.from_dir(path), load_weights(path), dtype, device, linear_weights)

    def _gemv_rows(self) -> int:
        return GEMV_MAX_ROWS if self.dtype == torch.float32 else GEMV_BF16_MAX_ROWS

    def weight_bytes_per_step(self) -> int:
        """Bytes of linear weights one decode step reads (every layer's and the head's)."""
        def nbytes(lin):
            if isinstance(lin, WeightInt8Linear):
                return lin.weight_bytes()
            return sum(t.numel() * t.element_size() for t in lin.tensors()[:1])
        return sum(nbytes(v) for layer in self.layers for k, v in layer.items() if k.startswith("w")) \
            + nbytes(self.lm_head)

    def num_parameters(self) -> int:
        n = self.embed.numel() + self.norm.numel() + (0 if self.tied else sum(t.numel() for t in self.lm_head.tensors()))
        for layer in self.layers:
            n += sum(t.numel() for v in layer.values() for t in (v.tensors() if isinstance(v, Linear) else (v,)))
        return n

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # HF's order: normalize in float32, back to the model's dtype, then scale (one fused op for
        # the normalization; bit-identical to x * rsqrt(mean(x^2) + eps) in float32)
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.cfg.rms_norm_eps).to(x.dtype) * w

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """HF's rotate-half convention, pairs (i, i + d/2): x*cos + [-x2, x1]*sin, computed as
        x*cos + [x2, x1]*sin_signed (sin with its first half negated: the same products)."""
        xf = x.float()
        half = x.shape[-1] // 2
        return (xf * cos + torch.cat((xf[..., half:], xf[..., :half]), dim=-1) * sin).to(x.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, H)."""
        cfg = self.cfg
        nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        scale = hd ** -0.5
        freqs = positions.float()[:, None] * self.inv_freq[None, :]               # (T, hd/2)
        x = self.embed[input_ids]                                                 # (T, H)
        if cpu_attention.decoder_glue_supports(x, kv_caches[0][0]):
            fused = self._fused(kv_caches, meta)
            if fused is not None:
                return fused.forward(x, freqs.cos(), freqs.sin(), meta.slot_mapping, meta.block_tables,
                                     meta.context_lens)
            return self._forward_glue(x, freqs, kv_caches, meta)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]                   # (T, 1, hd)
        sin[..., : hd // 2].neg_()                                                # sin_signed, see _rope
        T = x.shape[0]
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            h = self._rms(x, layer["in_norm"])
            qkv = layer["wqkv"](h)                                               # (T, (nh + 2 kvh) hd)
            # RoPE on q and k in one pass (they are adjacent in qkv)
            qk = self._rope(qkv[:, : (nh + kvh) * hd].view(T, nh + kvh, hd), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, (nh + kvh) * hd:].view(T, kvh, hd)
            store_kv(k, v, kc, vc, meta.slot_mapping)
            o = paged_attention(q, kc, vc, meta, scale)                           # (T, nh, hd)
            x = x + layer["wo"](o.reshape(T, nh * hd))
            h = self._rms(x, layer["post_norm"])
            gate, up = layer["wgu"](h).chunk(2, dim=-1)                           # (T, I) each
            x = x + layer["wd"](F.silu(gate) * up)
        return self._rms(x, self.norm)

    def _fused(self, kv_caches, meta: AttentionMetadata) -> DecodeLayers | None:
        """The one-call step (`kernels.cpu_decode`) where it takes this step: decodes only, float32
        with every linear row-major fp32 (at most GEMV_MAX_ROWS rows) or int8, or bfloat16 with every
        linear int8 or row-major bf16 (at most GEMV_BF16_MAX_ROWS rows: the GEMV of a CPU with
        AVX512-BF16); built once per KV cache pool and kept."""
        T = len(meta.context_lens_list)
        if (meta.num_decodes != T or not compute.current().fused_decode
                or self.dtype not in (torch.float32, torch.bfloat16)
                or (self.linear_weights == "native" and T > self._gemv_rows())):
            return None
        memo = self._fused_memo
        if memo is not None and memo[0] is kv_caches:
            return memo[1]
        lins, keep = [], []
        for layer in self.layers:
            for name in ("wqkv", "wo", "wgu", "wd"):
                lin = layer[name]
                if isinstance(lin, WeightInt8Linear):
                    d = cpu_decode.linear_descriptor(None, lin.bias, lin.packed, lin.scale, lin.out_features,
                                                     lin.in_features)
                else:
                    d = cpu_decode.linear_descriptor(lin.rows_weight, lin.bias)
                if d is None:
                    self._fused_memo = (kv_caches, None)
                    return None
                lins.append(d)
                keep.append(lin)
        norms = [t.to(self.dtype).contiguous() for layer in self.layers for t in (layer["in_norm"], layer["post_norm"])]
        fused = cpu_decode.DecodeLayers(lins, norms + [self.norm.to(self.dtype).contiguous()], kv_caches,
                                        self.cfg.hidden_size, self.cfg.intermediate_size,
                                        self.cfg.num_attention_heads, self.cfg.num_key_value_heads,
                                        self.cfg.head_dim, self.cfg.rms_norm_eps, keep)
        self._fused_memo = (kv_caches, fused)
        return fused

    def _forward_glue(self, x: torch.Tensor, freqs: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """`forward` on a CPU with the C glue kernels: per layer 4 matmuls, attention and 4 calls
        (residual add + RMSNorm, RoPE + K/V store, SiLU * up) instead of ~40 torch ops; the same
        arithmetic in the same order and rounding (tests/test_cpu_attention.py, test_generate_equivalence.py)."""
        cfg = self.cfg
        nh, kvh, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        T = x.shape[0]
        # x (the embedding rows, a fresh tensor) is the residual stream, updated in place
        cos, sin = freqs.cos(), freqs.sin()              # (T, hd/2): torch's values, as `forward`
        residual = None
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            h = cpu_attention.rms_norm(x, layer["in_norm"], eps, residual)
            q = cpu_attention.rope_store_kv(layer["wqkv"](h), cos, sin, kc, vc, meta.slot_mapping, nh, kvh)
            o = paged_attention(q, kc, vc, meta, hd ** -0.5)                      # (T, nh, hd)
            h = cpu_attention.rms_norm(x, layer["post_norm"], eps, layer["wo"](o.reshape(T, nh * hd)))
            residual = layer["wd"](cpu_attention.silu_mul(layer["wgu"](h)))
        return cpu_attention.rms_norm(x, self.norm, eps, residual)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, H) -> (n, V) float32 logits."""
        return self.lm_head(hidden).float()
