"""The batched sampler: greedy rows are the per-row argmax; top-k / top-p never take a token
outside the nucleus that a full sort defines, and draw from it with the reference probabilities;
a seeded row's tokens do not depend on the rest of the batch."""

import math

import pytest
import torch

from embedserve.engine import sampler
from embedserve.engine.sampler import sample
from embedserve.engine.sequence import SamplingParams, Sequence

V = 49152                               # SmolLM2's vocabulary


def _seq(**params) -> Sequence:
    return Sequence(0, [0], SamplingParams(**params))


def reference_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution the previous sampler drew from: temperature, a top-k mask of the logits,
    softmax, then a full descending sort for top-p (the smallest set reaching top_p), renormalised."""
    row = row.double() / temperature
    if 0 < top_k < row.shape[-1]:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        drop = sorted_p.cumsum(0) - sorted_p > top_p
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p.masked_fill(drop, 0.0))
    return probs / probs.sum()


def test_batched_greedy_equals_per_row_argmax():
    torch.manual_seed(0)
    logits = torch.randn(12, V) * 4
    seqs = [_seq(temperature=0) if i % 3 else _seq(temperature=0.8, top_p=0.9, seed=i) for i in range(12)]
    seqs[4] = _seq(temperature=1.3, top_k=1)                        # top_k 1 is greedy too
    tokens, _ = sample(logits, seqs)
    for i, seq in enumerate(seqs):
        if seq.params.greedy:
            assert tokens[i] == int(logits[i].argmax())
    alone = [sample(logits[i:i + 1], [_seq(temperature=0)])[0][0] for i in range(12)]
    assert [t for t, s in zip(tokens, seqs) if s.params.greedy] == [a for a, s in zip(alone, seqs) if s.params.greedy]


@pytest.mark.parametrize("temperature,top_k,top_p,scale", [
    (1.0, 0, 0.9, 8.0),          # peaked (a few tokens): the nucleus is among the candidates
    (1.0, 0, 0.9, 3.0),          # ~2,800 tokens wide: the full-sort fallback
    (0.7, 40, 1.0, 1.0),         # top-k alone
    (1.0, 50, 0.8, 1.0),         # both
    (1.0, 0, 0.95, 0.1),         # nearly flat: tens of thousands wide
    (1.5, 0, 0.5, 0.3),
])
@pytest.mark.slow               # many thousand draws over 49,152-wide rows: seconds each
def test_truncated_sampling_never_leaves_the_nucleus(temperature, top_k, top_p, scale):
    torch.manual_seed(1)
    logits = torch.randn(8, V) * scale
    params = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    for draw in range(6):
        seqs = [_seq(**params, seed=100 * draw + r) if r % 2 else _seq(**params) for r in range(8)]
        tokens, _ = sample(logits, seqs)
        for r, tok in enumerate(tokens):
            assert reference_probs(logits[r], temperature, top_k, top_p)[tok] > 0, (r, tok)


def test_the_full_sort_runs_only_for_a_nucleus_wider_than_the_candidates(monkeypatch):
    widths = []
    real = sampler._nucleus

    def spy(x, seqs, k):
        widths.append(k)
        return real(x, seqs, k)
    monkeypatch.setattr(sampler, "_nucleus", spy)
    torch.manual_seed(2)
    peaked, flat = torch.randn(1, V) * 8, torch.randn(1, V) * 0.05   # nucleus 0.9: 4 and ~40,000 wide
    sample(torch.cat([peaked, peaked]), [_seq(top_p=0.9, seed=1), _seq(top_k=20, top_p=0.99)])
    assert widths == [sampler.CANDIDATES]
    widths.clear()
    sample(torch.cat([peaked, flat]), [_seq(top_p=0.9), _seq(top_p=0.9)])
    assert widths == [sampler.CANDIDATES, V], "only the flat row is sorted whole"


@pytest.mark.slow               # many thousand draws over 49,152-wide rows: seconds each
@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.7), (0.8, 4, 0.9), (2.0, 0, 0.6)])
def test_draws_follow_the_reference_distribution(temperature, top_k, top_p):
    # 8 tokens with distinct probabilities; 40,000 rows of the same logits in one batch
    logits = torch.log(torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.07, 0.04, 0.02]))
    ref = reference_probs(logits, temperature, top_k, top_p)
    n = 40_000
    torch.manual_seed(3)
    tokens, _ = sample(logits.expand(n, -1).contiguous(),
                       [_seq(temperature=temperature, top_k=top_k, top_p=top_p)] * n)
    freq = torch.bincount(torch.tensor(tokens), minlength=8).double() / n
    assert (freq[ref == 0] == 0).all(), "a token outside the nucleus was drawn"
    # 5 standard errors of a binomial frequency: fails by chance about once in 10^6 runs per token
    tol = 5 * torch.sqrt(ref * (1 - ref) / n) + 1e-9
    assert ((freq - ref).abs() <= tol).all(), (freq.tolist(), ref.tolist())
    # and a chi-square over the kept tokens (critical value at p = 1e-4 for up to 7 degrees of freedom: 29.9)
    kept = ref > 0
    chi2 = float((((freq - ref) ** 2 / ref)[kept]).sum() * n)
    assert chi2 < 29.9


@pytest.mark.slow               # many thousand draws over 49,152-wide rows: seconds each
def test_seeded_rows_repeat_and_do_not_depend_on_the_batch():
    torch.manual_seed(4)
    steps = [torch.randn(5, V) * 2 for _ in range(10)]

    def run(batch_rows):
        seqs = [_seq(temperature=0.9, top_p=0.95, seed=7)] + [_seq(temperature=1.0, top_k=30) for _ in range(batch_rows)]
        out = []
        for logits in steps:
            rows = torch.cat([logits[:1], logits[1:1 + batch_rows]])
            out.append(sample(rows, seqs)[0][0])
        return out
    alone, crowded, again = run(0), run(4), run(2)
    assert alone == crowded == again
    other = [_seq(temperature=0.9, top_p=0.95, seed=8)]
    assert [sample(s[:1], other)[0][0] for s in steps] != alone


def test_uniform_draw_is_never_a_zero_probability_token():
    # u at the very top of [0, 1): the last candidate with a probability above 0, not a cut one
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    ids = torch.tensor([[10, 11, 12, 13]])
    top = torch.tensor([math.nextafter(1.0, 0.0)], dtype=torch.float64)
    assert sampler._inverse_cdf(probs, ids, top).tolist() == [11]
    assert sampler._inverse_cdf(probs, ids, torch.tensor([0.0], dtype=torch.float64)).tolist() == [10]


def test_the_sampler_study_times_both_samplers_on_every_case():
    """`python -m embedserve.studies.cpu_paths --only sampler`: one row per case, both sides timed,
    the peer a real sampler (greedy rows its argmax, sampled rows inside the top-k)."""
    from embedserve.studies import cpu_paths
    rows = cpu_paths.sampler(rows=4, vocab=2000, reps=2)
    assert [r["case"] for r in rows] == list(cpu_paths.SAMPLER_CASES)
    assert all(r["batched_ms"] > 0 and r["per_row_ms"] > 0 and r["speedup"] > 0 for r in rows)
    logits = torch.randn(3, 2000, generator=torch.Generator().manual_seed(3))
    seqs = [_seq(temperature=0), _seq(temperature=0.8, top_k=5), _seq(temperature=0.8, top_k=5)]
    picks = cpu_paths._per_row_sample(logits, seqs)
    assert picks[0] == int(logits[0].argmax())
    assert all(t in set(torch.topk(logits[i], 5).indices.tolist()) for i, t in enumerate(picks[1:], 1))
    assert "sampler, 16 x 49,152 logits" in cpu_paths.markdown(
        {"cpu": "x", "flags": [], "threads": 1, "date": "d", "sampler": rows})
