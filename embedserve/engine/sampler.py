"""Next-token choice for the sequences of a step: logit bias and presence / frequency penalties,
then greedy, or temperature / top-k / top-p with an optional seed; log-probabilities on request.

Batched over the step's rows: one argmax serves every greedy row. The sampled rows share one
temperature scaling and softmax; top-k / top-p rows take one `topk` of a bounded number of
candidates and find their nucleus among them (a row whose nucleus is wider is sorted whole, on
its own). Each sampled row then draws one uniform number, from its own generator when the
request has a seed (so its tokens do not depend on the rest of the batch), and takes the token
where that number falls in its candidates' cumulative distribution.
"""

from __future__ import annotations

import torch

from .sequence import Sequence, TokenLogprob

# top-k / top-p rows look for their nucleus among this many best tokens first; a wider nucleus
# (a flat distribution under a top_p near 1) falls back to sorting that row's whole vocabulary
CANDIDATES = 256


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits (n, V) float32, one row per sequence -> (one token id each, its TokenLogprob where
    the sequence asked for logprobs, else None)."""
    logits = process_logits(logits, seqs)
    out = logits.argmax(dim=-1).tolist()                  # every greedy row in one reduction
    rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    if rows:
        sampled = _sample_rows(logits[rows] if len(rows) < len(seqs) else logits, [seqs[i] for i in rows])
        for i, tok in zip(rows, sampled):
            out[i] = tok
    return out, token_logprobs(logits, seqs, out)


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits (m, V) of sequences that sample (temperature > 0) -> one token id each."""
    V = logits.shape[-1]
    temps = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype, device=logits.device)
    x = logits / temps[:, None]                                                   # (m, V)
    u = _uniforms(seqs).to(x.device)                                              # (m,) in [0, 1)
    tokens = torch.empty(len(seqs), dtype=torch.long, device=x.device)
    plain = [j for j, s in enumerate(seqs) if not _truncates(s, V)]
    cut = [j for j, s in enumerate(seqs) if _truncates(s, V)]
    if plain:                                   # the whole vocabulary, in id order
        tokens[plain] = _inverse_cdf(torch.softmax(x[plain], dim=-1), None, u[plain])
    if cut:
        xc, sc = x[cut], [seqs[j] for j in cut]
        k = min(V, max(CANDIDATES, *(s.params.top_k for s in sc)))
        probs, ids, covered = _nucleus(xc, sc, k)
        tokens[cut] = _inverse_cdf(probs, ids, u[cut])
        for r in (~covered).nonzero()[:, 0].tolist():       # nucleus wider than k: sort the row
            probs, ids, _ = _nucleus(xc[r:r + 1], sc[r:r + 1], V)
            tokens[cut[r]] = _inverse_cdf(probs, ids, u[cut[r]:cut[r] + 1])[0]
    return tokens.tolist()


def _truncates(seq: Sequence, vocab: int) -> bool:
    p = seq.params
    return 0 < p.top_k < vocab or p.top_p < 1.0


def _nucleus(x: torch.Tensor, seqs: list[Sequence], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k best tokens of each row of `x` (temperature-scaled logits (m, V)), best first: their
    probabilities after top-k and top-p (0 where cut) (m, k), their ids (m, k), and whether the
    row's nucleus surely lies inside them (m,). k must be >= every row's top_k."""
    V = x.shape[-1]
    vals, ids = x.topk(k, dim=-1)                                                 # sorted, best first
    top_k = torch.tensor([s.params.top_k if 0 < s.params.top_k < V else 0 for s in seqs], device=x.device)
    top_p = torch.tensor([s.params.top_p if s.params.top_p < 1.0 else 2.0 for s in seqs],
                         dtype=x.dtype, device=x.device)                          # 2.0: no top-p
    has_k = top_k > 0
    # top-k keeps every token at least as likely as the k-th one (ties too, as a mask of the logits does)
    kth = vals.gather(1, (top_k - 1).clamp(min=0)[:, None])
    vals = vals.masked_fill(has_k[:, None] & (vals < kth), float("-inf"))
    # softmax over what top-k kept, or over the whole vocabulary where there is no top-k (a
    # reduction over V, skipped when every row has a top-k)
    lse = torch.where(has_k, vals.logsumexp(-1), 0.0 if has_k.all() else x.logsumexp(-1))
    probs = (vals - lse[:, None]).exp()
    cum = probs.cumsum(-1)
    drop = cum - probs > top_p[:, None]               # keep the smallest set reaching top_p
    probs = probs.masked_fill(drop, 0.0)
    covered = has_k | drop[:, -1] | (top_p > 1.0) | (k == V)
    return probs, ids, covered


def _uniforms(seqs: list[Sequence]) -> torch.Tensor:
    """One float64 uniform in [0, 1) per sequence: a seeded one draws from its own generator, the
    others from torch's global generator in one call."""
    u = torch.empty(len(seqs), dtype=torch.float64)
    free = [j for j, s in enumerate(seqs) if s.generator is None]
    if free:
        u[free] = torch.rand(len(free), dtype=torch.float64)
    for j, s in enumerate(seqs):
        if s.generator is not None:
            u[j] = torch.rand(1, dtype=torch.float64, generator=s.generator)
    return u


def _inverse_cdf(probs: torch.Tensor, ids: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """For each row of `probs` (m, K), unnormalised, the candidate where u (m,) falls in its
    cumulative distribution: ids[row, j] (or j itself when `ids` is None). A candidate of
    probability 0 is never taken."""
    cum = probs.to(torch.float64).cumsum(-1)                                      # (m, K)
    total = cum[:, -1:]
    # strictly below the total, so the candidate found has cum[j] > target >= cum[j-1]: p_j > 0
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    j = torch.searchsorted(cum, target, right=True)                               # (m, 1)
    return (j if ids is None else ids.gather(1, j))[:, 0]


def process_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Logit bias, then OpenAI's penalties over the tokens the sequence has generated so far (not
    its prompt): logit[t] -= presence * (count[t] > 0) + frequency * count[t]. Returns `logits`
    itself when no sequence asks for either, else a processed copy."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.processes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        seq, row = seqs[i], logits[i]
        p = seq.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device))
        if (p.presence_penalty or p.frequency_penalty) and seq.completion_ids:
            out = torch.tensor(seq.completion_ids, dtype=torch.long, device=row.device)
            counts = torch.bincount(out, minlength=row.shape[-1]).to(row.dtype)
            row -= p.presence_penalty * (counts > 0).to(row.dtype) + p.frequency_penalty * counts
    return logits


def token_logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprob | None]:
    """log_softmax of the processed logits: after logit bias and penalties, before temperature,
    top-k and top-p (so they do not depend on the sampling settings, and greedy's choice is the
    top-1). vLLM's default reports the raw model's instead. Nothing is computed unless a
    sequence asks."""
    want = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if not want:
        return out
    lp = torch.log_softmax(logits[want], dim=-1)                                   # (m, V)
    chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in want], device=lp.device))[:, 0].tolist()
    k = max(seqs[i].params.logprobs for i in want)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())    # best first
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(want):
        n = seqs[i].params.logprobs
        out[i] = TokenLogprob(tokens[i], chosen[j], list(zip(top_i[j][:n], top_v[j][:n])))
    return out
