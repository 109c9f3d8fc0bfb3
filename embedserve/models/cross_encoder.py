"""Cross-encoders (rerankers): a BERT / XLM-R `*ForSequenceClassification` checkpoint scoring
query–document pairs on our own encoder.

    BERT   [CLS] q [SEP] d [SEP]      token types 0 … 0 1 … 1   pooler: tanh(W1 h[CLS] + b1), classifier W2 · + b2
    XLM-R  <s> q </s></s> d </s>      token types all 0          classifier.dense, tanh, classifier.out_proj

Both heads are the same function (a dense layer, tanh, a linear layer to the labels) on the
first token's hidden state; they differ in checkpoint names only. The pair layout is read from
the tokenizer's own post-processor (what transformers' tokenizer would build), and only the
document is ever cut: a query that leaves no room for a document is refused.

Scores: one label -> the logit, `relevance = sigmoid(logit)` (what sentence-transformers'
`CrossEncoder` and TEI return); several labels -> the label the model's `embedserve_model.json`
names as `relevant_label`, `relevance = softmax(logits)[label]`; without one, a ValueError.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .embedding_model import EmbeddingModel, is_cross_encoder
from .encoder import load_weights

logger = logging.getLogger(__name__)

_HEADS = {  # (dense, output) weight names after the encoder prefix is cut, per family
    "bert": ("pooler.dense", "classifier"),
    "xlm-roberta": ("classifier.dense", "classifier.out_proj"),
    "roberta": ("classifier.dense", "classifier.out_proj"),
}


class QueryTooLong(ValueError):
    """The query with the pair's special tokens fills the input limit: no room for a document."""

    def __init__(self, tokens: int, limit: int, specials: int):
        self.tokens, self.limit = tokens, limit
        super().__init__(f"the query has {tokens:,} tokens; with the pair's {specials} special tokens and at "
                         f"least one document token it must fit the limit of {limit:,}; shorten the query")


class DocumentTooLong(ValueError):
    def __init__(self, index: int, tokens: int, limit: int):
        self.index = index
        super().__init__(f"document {index} makes a pair of {tokens:,} tokens, over the limit of {limit:,}; "
                         "shorten it or set truncate=true")


@dataclass(slots=True)
class Pairs:
    """Token ids of (query, document) pairs, ready for the batcher."""

    inputs: list[list[int]]
    segments: list[int | None]                 # where each pair's document segment starts (token type 1)
    truncated: list[int] = field(default_factory=list)      # documents that were cut
    cut_tokens: int = 0                        # document tokens cut in all

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.inputs))


class CrossEncoderModel(EmbeddingModel):
    """A reranker: `pairs(query, documents)` -> token ids; `embed(..., {"score"})` -> logits."""

    task = "rerank"

    def __init__(self, path: str | Path, name: str | None = None, dtype: str = "auto", device: str = "cpu"):
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        self.num_labels = int(raw.get("num_labels") or len(raw.get("id2label") or {}) or 1)
        self.labels = {int(k): str(v) for k, v in (raw.get("id2label") or {}).items()}
        super().__init__(path, name=name, dtype=dtype, device=device)
        if self.cfg.model_type not in _HEADS:
            raise ValueError(f"{path}: no cross-encoder head for model_type {self.cfg.model_type!r}")
        dense, out = _HEADS[self.cfg.model_type]
        names = [f"{dense}.weight", f"{dense}.bias", f"{out}.weight", f"{out}.bias"]
        w = load_weights(path, keys=lambda k: k in names)
        missing = [n for n in names if n not in w]
        if missing:
            raise ValueError(f"{path} is a sequence-classification checkpoint without {', '.join(missing)}; "
                             "embedserve needs the classification head's weights")
        self.head = [w[n].float().to(self.device) for n in names]
        if self.head[2].shape[0] != self.num_labels:
            raise ValueError(f"{path}: config.json says {self.num_labels} labels, the classifier has "
                             f"{self.head[2].shape[0]}")
        self.relevant_label = self._relevant_label()
        # XLM-R has one token type: both segments are type 0
        self.second_type = 1 if self.cfg.type_vocab_size > 1 else 0
        self._layout = self._pair_layout()
        self.spec.num_labels = self.num_labels

    # ----------------------------------------------------------------- conventions
    def _conventions(self) -> dict:
        """A cross-encoder pools nothing: the head reads the first token (`dense` is its hidden
        state, unnormalized, which is what the precision probe compares)."""
        own = self.path / "embedserve_model.json"
        conv = json.loads(own.read_text()) if own.exists() else {}
        return {"pooling": "cls", "normalize": False, "query_prefix": "", "passage_prefix": "",
                **{k: v for k, v in conv.items() if k == "name"}}

    def _relevant_label(self) -> int | None:
        """The label index `relevance_score` reads: the only one, or the one embedserve_model.json names."""
        if self.num_labels == 1:
            return 0
        own = self.path / "embedserve_model.json"
        want = json.loads(own.read_text()).get("relevant_label") if own.exists() else None
        if want is None:
            return None
        for i, name in self.labels.items():
            if name == want or str(i) == str(want):
                return i
        raise ValueError(f"{own}: relevant_label {want!r} is none of the model's labels "
                         f"({', '.join(self.labels.values())})")

    def label_problem(self) -> str | None:
        """Why this model cannot give a relevance score, or None."""
        if self.relevant_label is not None:
            return None
        return (f"model {self.spec.name!r} has {self.num_labels} labels ({', '.join(self.labels.values())}) and "
                "does not say which means relevant: add {\"relevant_label\": \"<label>\"} to its "
                "embedserve_model.json")

    def _pair_layout(self) -> tuple[list[int], list[int], list[int]]:
        """(before the query, between query and document, after the document) special token ids,
        read from the tokenizer's pair template; the family's layout if it has none."""
        tok = self.tokenizer
        try:
            a, b = tok.encode("hello", add_special_tokens=False), tok.encode("world", add_special_tokens=False)
            enc = tok.post_process(a, b, add_special_tokens=True)
            seq = enc.sequence_ids
            ids = enc.ids
            first_a, first_b = seq.index(0), seq.index(1)
            last_a = max(i for i, s in enumerate(seq) if s == 0)
            last_b = max(i for i, s in enumerate(seq) if s == 1)
            layout = ids[:first_a], ids[last_a + 1:first_b], ids[last_b + 1:]
            if enc.type_ids[first_b] not in (0, self.second_type):
                raise ValueError("unexpected type id")
            return layout
        except Exception:       # no pair template (tokenizers raises its own errors): the family's own
            mid = self.eos_ids * (2 if self.cfg.model_type in ("xlm-roberta", "roberta") else 1)
            return self.bos_ids, mid, self.eos_ids

    @property
    def pair_specials(self) -> int:
        return sum(map(len, self._layout))

    # --------------------------------------------------------------------- pairs
    def query_ids(self, query: str) -> list[int]:
        return self.content_ids([query])[0]

    def pairs(self, query: str | list[int], documents: list[str], limit: int | None = None,
              max_doc_tokens: int | None = None, truncate: bool = True) -> Pairs:
        """Each (query, document) pair's token ids; the document cut to what the limit (and
        `max_doc_tokens`) leaves, or DocumentTooLong without `truncate`; QueryTooLong when the
        query leaves no room."""
        limit = limit or self.max_input_length
        q = self.query_ids(query) if isinstance(query, str) else list(query)
        pre, mid, post = self._layout
        room = limit - len(q) - self.pair_specials
        if room < 1:
            raise QueryTooLong(len(q), limit, self.pair_specials)
        if max_doc_tokens is not None:
            room = min(room, max_doc_tokens)
        head = pre + q + mid
        out = Pairs([], [])
        for i, d in enumerate(self.content_ids(documents)):
            if len(d) > room:
                if not truncate:
                    raise DocumentTooLong(i, len(head) + len(d) + len(post), limit)
                out.truncated.append(i)
                out.cut_tokens += len(d) - room
                d = d[:room]
            out.inputs.append(head + d + post)
            out.segments.append(len(head) if self.second_type else None)
        return out

    # --------------------------------------------------------------------- scores
    def classify(self, cls: torch.Tensor) -> torch.Tensor:
        """The head on the first token's hidden states (B, H) -> logits (B, labels), fp32."""
        w1, b1, w2, b2 = self.head
        return torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(cls.float(), w1, b1)), w2, b2)

    def relevance(self, logits: np.ndarray, raw: bool = False) -> float:
        """One pair's relevance from its logits: sigmoid of the single logit (or the logit with
        `raw`), else the relevant label's softmax probability (or its logit)."""
        if self.relevant_label is None:
            raise ValueError(self.label_problem())
        x = logits.astype(np.float64)
        if raw:
            return float(x[self.relevant_label])
        if self.num_labels == 1:
            return float(1.0 / (1.0 + np.exp(-x[0])))
        e = np.exp(x - x.max())
        return float(e[self.relevant_label] / e.sum())

    def score_pairs(self, query: str, documents: list[str], raw: bool = True) -> np.ndarray:
        """In process (tests, studies): every document's score against `query`, in order."""
        p = self.pairs(query, documents)
        outs, _ = self.embed(p.inputs, {"score"}, p.segments)
        return np.array([self.relevance(o.score, raw) for o in outs])


def load_model(path: Path, name: str | None = None, dtype: str = "auto", device: str = "cpu") -> EmbeddingModel:
    """The model of directory `path`, by its architecture: a cross-encoder (`*ForSequenceClassification`),
    a SPLADE sparse encoder (`*ForMaskedLM`), else an embedder."""
    from .embedding_model import is_splade
    from .splade import SpladeModel
    kind = CrossEncoderModel if is_cross_encoder(path) else SpladeModel if is_splade(path) else EmbeddingModel
    return kind(path, name=name, dtype=dtype, device=device)
