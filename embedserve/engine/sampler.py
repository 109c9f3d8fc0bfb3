"""Next-token choice per sequence: logit bias and presence / frequency penalties, then greedy,
or temperature / top-k / top-p with an optional seed; log-probabilities on request."""

from __future__ import annotations

import torch

from .sequence import Sequence, TokenLogprob


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits (n, V) float32, one row per sequence -> (one token id each, its TokenLogprob where
    the sequence asked for logprobs, else None)."""
    logits = process_logits(logits, seqs)
    out = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            drop = cum - sorted_p > p.top_p           # keep the smallest set reaching top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out[i] = int(torch.multinomial(probs, 1, generator=seq.generator).item())
    return out, token_logprobs(logits, seqs, out)


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
