"""SPLADE: a masked-language-model checkpoint (`*ForMaskedLM`) served as a learned sparse encoder.

    w[v] = max over the input's positions t of log(1 + relu(logits[t, v]))      (SPLADE-max; TEI's
    `--pooling splade`), then the vocabulary entries of the special tokens ([CLS], [SEP], [PAD],
    [UNK], [MASK]) dropped and only w > 0 kept: (token ids, weights), like BGE-M3's lexical weights.

The MLM head (BERT: dense -> gelu -> LayerNorm -> decoder tied to the word embeddings + bias)
maps every token to the whole vocabulary, so a 4,096-token batch would hold 4,096 × 30,522 fp32
logits (500 MB) at once, and as many again for the activation. The head runs on `CHUNK` tokens at
a time and folds each chunk into a running per-sequence maximum (`scatter_reduce_` amax), so the
peak is CHUNK × V × 4 B × 2 (logits and their activation) + sequences × V × 4 B: 62.5 MB + 31 MB
for 256 sequences of a 30,522-word vocabulary, whatever the batch's token count. Measured (the
resident-set high-water mark over the loaded model, splade-tiny, fp32): a 4,010-token batch of 41
Wikipedia summaries peaks 120 MB higher in chunks, 921 MB higher with the whole batch at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .embedding_model import EmbeddingModel
from .encoder import load_weights

CHUNK = 256             # tokens through the vocabulary-wide head at a time (the peak memory's knob)


class SpladeModel(EmbeddingModel):
    """Sparse vectors from an MLM head; no dense output (`spec.has_dense` is False)."""

    def __init__(self, path: str | Path, name: str | None = None, dtype: str = "auto", device: str = "cpu"):
        super().__init__(path, name=name, dtype=dtype, device=device)
        if self.cfg.model_type != "bert":
            raise ValueError(f"{self.path}: SPLADE needs a BERT masked-LM head; model_type is {self.cfg.model_type!r}")
        names = ["cls.predictions.transform.dense.weight", "cls.predictions.transform.dense.bias",
                 "cls.predictions.transform.LayerNorm.weight", "cls.predictions.transform.LayerNorm.bias",
                 "cls.predictions.bias", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias",
                 "embeddings.word_embeddings.weight"]
        w = load_weights(self.path, keys=lambda k: k in names)
        missing = [n for n in names[:5] if n not in w]
        if missing:
            raise ValueError(f"{self.path} is a masked-LM checkpoint without {', '.join(missing)}; SPLADE needs "
                             "the MLM head's weights")
        dev = self.device
        self.transform = [w[n].float().to(dev) for n in names[:4]]
        # the decoder is tied to the word embeddings unless the checkpoint carries its own
        self.decoder = w.get("cls.predictions.decoder.weight", w["embeddings.word_embeddings.weight"]).float().to(dev)
        self.decoder_bias = w.get("cls.predictions.decoder.bias", w["cls.predictions.bias"]).float().to(dev)
        self.drop = torch.tensor(sorted(self._special_vocab()), dtype=torch.long, device=dev)
        self.spec.has_dense, self.spec.has_sparse = False, True
        self.spec.dim = self.cfg.vocab_size

    def _conventions(self) -> dict:
        own = self.path / "embedserve_model.json"
        conv = json.loads(own.read_text()) if own.exists() else {}
        # `pooling` names the sparse pooling; the precision probe compares mean-pooled hidden states
        return {"query_prefix": "", "passage_prefix": "", **conv, "pooling": "splade", "normalize": False}

    def _special_vocab(self) -> set[int]:
        """The special tokens' vocabulary ids: never a term of a sparse vector."""
        ids = set(self.special_ids)
        for token in ("[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]", "<s>", "</s>", "<pad>", "<unk>", "<mask>"):
            i = self.tokenizer.token_to_id(token)
            if i is not None:
                ids.add(i)
        return ids

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The MLM head on hidden states (t, H) -> vocabulary logits (t, V), fp32."""
        w1, b1, g, b = self.transform
        x = F.gelu(F.linear(h.float(), w1, b1))
        x = F.layer_norm(x, (x.shape[-1],), g, b, self.cfg.layer_norm_eps)
        return F.linear(x, self.decoder, self.decoder_bias)

    def sparse_vectors(self, h: torch.Tensor, ids: torch.Tensor, lengths: list[int], starts: np.ndarray
                       ) -> list[tuple[np.ndarray, np.ndarray]]:
        B, V = len(lengths), self.decoder.shape[0]
        seg = torch.repeat_interleave(torch.arange(B, device=h.device), torch.as_tensor(lengths, device=h.device))
        best = torch.zeros(B, V, dtype=torch.float32, device=h.device)      # log1p(relu(.)) >= 0
        for s in range(0, h.shape[0], CHUNK):
            w = torch.log1p(torch.relu(self.logits(h[s:s + CHUNK])))
            # each row into its sequence's maximum (the expanded index is a view: no t × V ints)
            best.scatter_reduce_(0, seg[s:s + CHUNK, None].expand_as(w), w, reduce="amax")
        best[:, self.drop] = 0
        out = []
        for row in best:
            nz = torch.nonzero(row, as_tuple=True)[0]
            out.append((nz.cpu().numpy().astype(np.int64), row[nz].cpu().numpy().astype(np.float32)))
        return out
