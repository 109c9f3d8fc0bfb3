"""An embedding model: tokenizer + encoder + heads + the model's own conventions.

Conventions (pooling, normalization, query/passage prefixes) live here with the model,
never in the HTTP layer. BGE-M3 (FlagEmbedding's formulas), from one forward pass:

    dense   = normalize(h[CLS])
    sparse  = max over positions of relu(sparse_linear(h)) per token id, specials removed, > 0 kept
    colbert = normalize(colbert_linear(h[1:]))  per token (CLS excluded)
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from kernels import compute
from kernels.cpu_wordpiece import FastWordPiece, read_spec

from ..precision import (ProbeResult, cached_probe, check_gate, encoder_precision, store_probe,
                         why as precision_reason)
from .encoder import AttentionPlan, Encoder, EncoderConfig, load_encoder
from .model_dir import fingerprint_dir, is_cross_encoder, is_splade, read_conventions  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

OUTPUT_TYPES = ("dense", "sparse", "colbert")

# Probe texts for the precision gates (English, Chinese, French; short and long).
PROBE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "How much protein should a female eat per day?",
    "北京是中华人民共和国的首都，也是全国的政治和文化中心。",
    "La tour Eiffel est une tour de fer puddlé de 330 mètres de hauteur située à Paris.",
    "Retrieval-augmented generation combines a retriever over a document index with a "
    "generator that conditions on the retrieved passages to answer questions. " * 3,
    "量子计算利用量子力学现象进行计算。",
]


@dataclass(slots=True)
class ModelSpec:
    """What the outside world may know about the served model (also the index manifest's source)."""

    name: str
    path: str
    model_type: str
    dim: int
    pooling: str            # "cls" | "mean"
    normalize: bool
    query_prefix: str
    passage_prefix: str
    max_input_length: int
    vocab_size: int
    has_sparse: bool
    has_colbert: bool
    dtype: str
    fingerprint: str
    task: str = "embed"     # "embed" | "rerank" (a cross-encoder: scores query-document pairs)
    has_dense: bool = True  # False: a sparse-only encoder (SPLADE)
    prompts: dict = field(default_factory=dict)     # named prompts, name -> text (query / passage included)
    num_labels: int = 0     # a cross-encoder's classifier outputs

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]

    @property
    def embedding_types(self) -> set[str]:
        """What the model produces from one forward pass: dense, and its heads (a cross-encoder:
        its classifier's logits, `score`)."""
        if self.task == "rerank":
            return {"score"}
        return (({"dense"} if self.has_dense else set()) | ({"sparse"} if self.has_sparse else set())
                | ({"colbert"} if self.has_colbert else set()))


@dataclass(slots=True)
class EmbedOutput:
    """One input's results; fields not requested stay None."""

    dense: np.ndarray | None = None                          # (D,) float32
    sparse: tuple[np.ndarray, np.ndarray] | None = None      # (token ids int64, weights float32)
    colbert: np.ndarray | None = None                        # (n_tokens - 1, D_c) float32
    score: np.ndarray | None = None                          # (num_labels,) float32 logits (a cross-encoder)


def _load_head(path: Path, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Weights only: never unpickle arbitrary objects from a model directory.
    sd = torch.load(str(path), map_location="cpu", weights_only=True)
    return sd["weight"].float().to(device), sd["bias"].float().to(device)


class EmbeddingModel:
    """Tokenize, then embed token-id lists into dense / sparse / ColBERT outputs."""

    task = "embed"

    def __init__(self, path: str | Path, name: str | None = None, dtype: str = "auto",
                 device: str = "cpu"):
        self.path = Path(path)
        if not (self.path / "config.json").exists():
            raise FileNotFoundError(f"{self.path} is not a Hugging Face model directory (no config.json)")
        if self.task == "embed" and is_cross_encoder(self.path):
            raise ValueError(f"{self.path.name} is a reranker (a sequence-classification cross-encoder): it scores "
                             "query-document pairs and gives no embeddings; use an embedding model here")
        if type(self) is EmbeddingModel and is_splade(self.path):
            raise ValueError(f"{self.path.name} is a masked-LM (SPLADE) checkpoint: load it with "
                             "models.cross_encoder.load_model, which serves it as a sparse encoder")
        self.device = torch.device(device)
        self.cfg = EncoderConfig.from_dir(self.path)
        conv = self._conventions()
        self.pooling = conv.get("pooling", "mean")
        self.normalize = bool(conv.get("normalize", True))
        # named prompts: query / passage (the two every model has, empty where it has none) and its own
        self.prefixes = {**{str(k): str(v) for k, v in (conv.get("prompts") or {}).items()},
                         "query": conv.get("query_prefix", ""), "passage": conv.get("passage_prefix", "")}
        self.default_prompt_name = conv.get("default_prompt_name") or None
        if self.default_prompt_name is not None and self.default_prompt_name not in self.prefixes:
            raise ValueError(f"{self.path}: default_prompt_name {self.default_prompt_name!r} is none of its prompts "
                             f"({', '.join(sorted(self.prefixes))})")
        self.tokenizer = self._load_tokenizer()
        self.fast_tokenizer = self._load_fast_tokenizer()
        self.sparse_head = self.colbert_head = None
        if (self.path / "sparse_linear.pt").exists():
            self.sparse_head = _load_head(self.path / "sparse_linear.pt", self.device)
        if (self.path / "colbert_linear.pt").exists():
            self.colbert_head = _load_head(self.path / "colbert_linear.pt", self.device)
        self.special_ids = self._special_ids()
        self.fingerprint = fingerprint_dir(self.path)
        self.precision, encoder = self._settle_precision(dtype)
        self.encoder = encoder or load_encoder(self.path, self.precision, self.device)
        self.spec = ModelSpec(
            name=name or conv.get("name") or self.path.name, path=str(self.path),
            model_type=self.cfg.model_type, dim=self.cfg.hidden_size, pooling=self.pooling,
            normalize=self.normalize, query_prefix=self.prefixes["query"],
            passage_prefix=self.prefixes["passage"], max_input_length=self.max_input_length,
            vocab_size=self.cfg.vocab_size, has_sparse=self.sparse_head is not None,
            has_colbert=self.colbert_head is not None,
            dtype=self.precision, fingerprint=self.fingerprint, task=self.task, prompts=dict(self.prefixes))

    def _conventions(self) -> dict:
        return read_conventions(self.path)

    # ----------------------------------------------------------------- loading
    def _load_tokenizer(self) -> Tokenizer:
        tj = self.path / "tokenizer.json"
        if not tj.exists():
            raise FileNotFoundError(f"{self.path} has no tokenizer.json (a `tokenizers` fast tokenizer)")
        tok = Tokenizer.from_file(str(tj))
        tok.no_truncation()
        tok.no_padding()
        # Specials the post-processor adds around content: [CLS] … [SEP] or <s> … </s>.
        empty = tok.encode("").ids
        self.bos_ids, self.eos_ids = empty[:1], empty[1:]
        limit = self.cfg.max_input_length
        tc = self.path / "tokenizer_config.json"
        if tc.exists():
            mml = json.loads(tc.read_text()).get("model_max_length")
            if isinstance(mml, int) and 0 < mml < limit:
                limit = mml
        self.max_input_length = limit
        return tok

    def _load_fast_tokenizer(self) -> FastWordPiece | None:
        """The C WordPiece tokenizer for this model's ASCII and Chinese texts (`kernels.cpu_wordpiece`),
        where it takes this tokenizer.json and agrees with `tokenizers` on its probes; else None."""
        if not compute.current().fast_tokenizer:
            return None
        fast, why = FastWordPiece.build(read_spec(self.path / "tokenizer.json"), self.tokenizer)
        if fast is None:
            logger.info("%s: every text through tokenizers (the C WordPiece does not take it: %s)", self.path.name, why)
        else:
            logger.info("%s: ASCII and Chinese texts through the C WordPiece, others via tokenizers", self.path.name)
        return fast

    def _special_ids(self) -> set[int]:
        ids = set(self.bos_ids) | set(self.eos_ids) | {self.cfg.pad_token_id}
        for unk in ("<unk>", "[UNK]"):
            i = self.tokenizer.token_to_id(unk)
            if i is not None:
                ids.add(i)
        return ids

    def _settle_precision(self, requested: str) -> tuple[str, Encoder | None]:
        """The encoder's precision (`embedserve.precision` decides; the probe runs here once per
        model and machine when `auto` has not measured this one yet), and the encoder in it if
        deciding already built one."""
        choice = encoder_precision(requested, self.device, self.fingerprint)
        if choice.dtype is None:
            kept: dict[str, Encoder] = {}
            result = self.probe_precisions(choice.candidates, keep=kept)
            store_probe(self.fingerprint, self.device, result)
            dtype = result.fastest_passing()
            logger.info("dtype auto -> %s (%s)", dtype, precision_reason(result, dtype))
            return dtype, kept.get(dtype)
        encoder = None
        if choice.requested == "int8":
            cached = cached_probe(self.fingerprint, self.device)
            cos = cached.min_cosine.get("int8") if cached else None
            if cos is None:
                cos, encoder = self._agreement(choice.dtype, self._probe_ids())
            check_gate("int8", cos, self.path.name)
        logger.info("dtype %s -> %s (%s)", choice.requested, choice.dtype, choice.reason)
        return choice.dtype, encoder

    def probe_precisions(self, candidates, texts: list[str] | None = None,
                         keep: dict | None = None, rounds: int = 3) -> ProbeResult:
        """Each candidate's minimum cosine to float32 on the probe texts, and its speed against
        float32's on one ~2,000-token batch of them and on 8 of them (what 1 text/request x 8
        clients forms): after a warm-up, `rounds` rounds alternating float32 and the candidate,
        the median of the rounds' ratios (sequential blocks let a shared machine's noise decide).
        The float32 encoder stays loaded while the candidates are measured; with `keep`, so does
        the encoder of the precision chosen so far (only that one: memory)."""
        ids = self._probe_ids(texts)
        big = (ids * (1 + 2000 // sum(map(len, ids))))[:256]
        small = (ids * 8)[:8]
        result = ProbeResult()
        ref = load_encoder(self.path, "float32", self.device)
        ref_dense = self._dense_with(ref, ids)
        shapes = ((big, result.tokens_per_s, 1), (small, result.small_tokens_per_s, 4))

        def run(enc, batch, times):
            for _ in range(times):
                self.embed_with(enc, batch, {"dense"})
        for batch, _, times in shapes:
            run(ref, batch, 1)                                     # warm-up
        for batch, speeds, times in shapes:
            speeds["float32"] = times * sum(map(len, batch)) / _timed(lambda: run(ref, batch, times))
        if keep is not None:
            keep.clear()
            keep["float32"] = ref
        for dtype in candidates:
            try:
                enc = load_encoder(self.path, dtype, self.device)
                dense = self._dense_with(enc, ids)
            except RuntimeError as exc:           # e.g. int8 without a working torch.compile
                result.unavailable[dtype] = str(exc)
                continue
            result.min_cosine[dtype] = _min_cosine(ref_dense, dense)
            for batch, speeds, times in shapes:
                run(enc, batch, 1)
                ratios = []
                for r in range(rounds):          # alternated, the order swapped each round
                    pair = [(ref, 0), (enc, 1)] if r % 2 == 0 else [(enc, 1), (ref, 0)]
                    t = [0.0, 0.0]
                    for e, i in pair:
                        t[i] = _timed(lambda: run(e, batch, times))
                    ratios.append(t[0] / max(t[1], 1e-9))
                speeds[dtype] = speeds["float32"] * statistics.median(ratios)
            if keep is not None and result.fastest_passing() == dtype:
                keep.clear()
                keep[dtype] = enc
            del enc
        return result

    def agreement(self, dtype: str, texts: list[str] | None = None) -> float:
        """Minimum cosine between `dtype`'s and float32's dense embeddings of `texts` (probe set by default)."""
        return self._agreement(dtype, self._probe_ids(texts))[0]

    def _probe_ids(self, texts: list[str] | None = None) -> list[list[int]]:
        """The probe texts' token ids, cut to the model's limit (a tiny model has few positions)."""
        return [self.truncate(x) for x in self.tokenize(texts or PROBE_TEXTS)]

    def _agreement(self, dtype: str, ids: list[list[int]]) -> tuple[float, Encoder]:
        ref = self._dense_with(load_encoder(self.path, "float32", self.device), ids)
        encoder = load_encoder(self.path, dtype, self.device)
        return _min_cosine(ref, self._dense_with(encoder, ids)), encoder

    def _dense_with(self, encoder: Encoder, ids: list[list[int]]) -> np.ndarray:
        return np.stack([o.dense for o in self.embed_with(encoder, ids, {"dense"})[0]])

    # -------------------------------------------------------------- tokenizing
    def tokenize(self, texts: list[str], input_type: str | None = None) -> list[list[int]]:
        """Token ids with specials, untruncated (the caller decides what is too long)."""
        prefix = self.prefixes.get(input_type or "", "")
        if prefix:
            texts = [prefix + t for t in texts]
        return self._encode(texts, True)

    def content_ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids without specials (a cross-encoder's query and documents, placed in its pair template)."""
        return self._encode(texts, False)

    def _encode(self, texts: list[str], specials: bool) -> list[list[int]]:
        # `tokenizers`' encode_batch_fast: the same ids without the character offsets, ~15 % less
        # CPU (multilingual-e5-small, 32 texts: 2.84 vs 3.39 ms, `studies.tokenize_bench`)
        if self.fast_tokenizer is None:
            return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=specials)]
        out = self.fast_tokenizer.encode(texts, specials)       # ASCII, CJK; None for the others
        rest = [i for i, ids in enumerate(out) if ids is None]
        if rest:
            encoded = self.tokenizer.encode_batch_fast([texts[i] for i in rest], add_special_tokens=specials)
            for i, e in zip(rest, encoded):
                out[i] = e.ids
        return out  # type: ignore[return-value]

    def wrap_token_ids(self, ids: list[int]) -> list[int]:
        """Client-supplied content token ids get the model's specials, like text does."""
        return self.bos_ids + list(ids) + self.eos_ids

    def truncate(self, ids: list[int], limit: int | None = None, direction: str = "right") -> list[int]:
        """Cut to `limit` tokens (default: the model's), keeping the special tokens around the
        content; `right` keeps the first content tokens, `left` the last."""
        limit = limit or self.max_input_length
        if len(ids) <= limit:
            return ids
        if direction == "left":
            keep = limit - len(self.bos_ids) - len(self.eos_ids)
            end = len(ids) - len(self.eos_ids)
            return self.bos_ids + ids[end - keep:end] + self.eos_ids
        return ids[: limit - len(self.eos_ids)] + self.eos_ids

    # --------------------------------------------------------------- embedding
    def embed(self, batch: list[list[int]], want: set[str], segments: list[int | None] | None = None
              ) -> tuple[list[EmbedOutput], int]:
        """Embed token-id lists; returns outputs in input order and the computed token count
        (real tokens plus attention padding) for the padding-efficiency metric. `segments`: per
        input, where its second segment (token type 1) starts, or None (a cross-encoder's pairs)."""
        return self.embed_with(self.encoder, batch, want, segments)

    def embed_with(self, encoder: Encoder, batch: list[list[int]], want: set[str],
                   segments: list[int | None] | None = None) -> tuple[list[EmbedOutput], int]:
        """`embed` through `encoder`: this model's, or another precision's from `load_encoder`
        (what the precision probe and the studies compare)."""
        order = sorted(range(len(batch)), key=lambda i: -len(batch[i]))
        lengths = [len(batch[i]) for i in order]
        if lengths and lengths[0] > self.max_input_length:     # past the position embeddings
            raise ValueError(f"an input of {lengths[0]} tokens reached the encoder of {self.path.name}, whose limit "
                             f"is {self.max_input_length}: truncate (model.truncate) or refuse it before")
        plan = AttentionPlan.build(lengths)
        dev = self.device
        ids = torch.tensor([t for i in order for t in batch[i]], dtype=torch.long, device=dev)
        pos = torch.cat([torch.arange(L) for L in lengths]).to(dev)
        types = None
        if segments is not None and any(s is not None for s in segments):
            # 0 up to each input's second segment, then that segment's type (BERT: 1)
            types = (pos >= torch.tensor([segments[i] if segments[i] is not None else L
                                          for i, L in zip(order, lengths)]).repeat_interleave(
                torch.tensor(lengths)).to(dev)).long() * self.second_type
        # only the first tokens are read (a cross-encoder's head, CLS pooling): the last layer
        # computes them alone (Encoder.forward)
        first_only = bool(want) and want <= ({"score", "dense"} if self.pooling == "cls" else {"score"})
        h = encoder(ids, pos, plan, types, first_only=first_only)             # (T, H), or (B, H)
        starts = (np.arange(len(lengths)) if first_only else
                  np.concatenate([[0], np.cumsum(lengths)[:-1]])).astype(np.int64)
        outs = [EmbedOutput() for _ in batch]
        if "score" in want:
            logits = self.classify(h[torch.as_tensor(starts, device=h.device)]).cpu().numpy()   # (B, labels)
            for k, i in enumerate(order):
                outs[i].score = logits[k]
        if "dense" in want:
            dense = self.pool(h, lengths, starts)                            # (B, H) fp32
            dense_np = dense.cpu().numpy()
            for k, i in enumerate(order):
                outs[i].dense = dense_np[k]
        if "sparse" in want:
            for k, sparse in enumerate(self.sparse_vectors(h, ids, lengths, starts)):
                outs[order[k]].sparse = sparse
        if "colbert" in want:
            c = F.normalize(F.linear(h.float(), *self.colbert_head), dim=-1).cpu().numpy()  # (T, Dc)
            for k, i in enumerate(order):
                s, L = starts[k], lengths[k]
                outs[i].colbert = c[s + 1:s + L]
        return outs, plan.computed_tokens

    second_type = 1

    def classify(self, cls: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's head over the first token's hidden states (`CrossEncoderModel`)."""
        raise ValueError(f"{self.path.name} is an embedding model: it has no classifier to score pairs")

    def pool(self, h: torch.Tensor, lengths: list[int], starts: np.ndarray) -> torch.Tensor:
        """The encoder's packed rows `h` (T, H) of sequences of `lengths` from `starts` pooled into
        one fp32 vector each (B, H): CLS or mean, by the model, normalized where it is."""
        if self.pooling == "cls":
            pooled = h[torch.as_tensor(starts, device=h.device)].float()
        else:
            seg = torch.repeat_interleave(torch.arange(len(lengths), device=h.device),
                                          torch.as_tensor(lengths, device=h.device))
            sums = torch.zeros(len(lengths), h.shape[1], dtype=torch.float32, device=h.device)
            sums.index_add_(0, seg, h.float())
            pooled = sums / torch.as_tensor(lengths, dtype=torch.float32, device=h.device)[:, None]
        return F.normalize(pooled, dim=-1) if self.normalize else pooled

    def sparse_vectors(self, h: torch.Tensor, ids: torch.Tensor, lengths: list[int], starts: np.ndarray
                       ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each packed sequence's lexical weights (BGE-M3's sparse head: one weight per token,
        the largest per token id kept); `SpladeModel` has its own."""
        w = torch.relu(F.linear(h.float(), *self.sparse_head)).squeeze(-1).cpu().numpy()  # (T,)
        ids_np = ids.cpu().numpy()
        return [self._lexical_weights(ids_np[s:s + L], w[s:s + L]) for s, L in zip(starts, lengths)]

    def _lexical_weights(self, ids: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keep = (w > 0) & ~np.isin(ids, list(self.special_ids))
        ids, w = ids[keep], w[keep]
        if not len(ids):
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        order = np.lexsort((-w, ids))           # by id, largest weight first within an id
        ids, w = ids[order], w[order]
        first = np.concatenate([[True], ids[1:] != ids[:-1]])
        return ids[first].astype(np.int64), w[first].astype(np.float32)


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def _timed(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0
