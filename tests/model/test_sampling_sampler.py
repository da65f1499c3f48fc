"""The Sampler: one step's tokens and log-probabilities, each sequence's state kept."""

from __future__ import annotations

import torch

from lamina.sampling.params import SamplingParams
from lamina.sampling.sampler import Sampler, sample

V = 16
EOS = 15


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))  # [B, V]


def test_a_sequence_samples_the_same_alone_or_in_a_batch():
    sampler = Sampler(None, (EOS,))
    p = SamplingParams(temperature=0.8, top_k=8, seed=3, logprobs=2)
    logits = _logits(3)
    alone = sampler(logits[1:2], [sampler.join(p)])
    others = [sampler.join(SamplingParams(temperature=0.0)), sampler.join(p), sampler.join(SamplingParams(seed=9))]
    batched = sampler(logits, others)
    assert batched[0][1] == alone[0][0] and batched[1][1] == alone[1][0]
    assert batched[1][0] is None  # the greedy row asked for no logprobs
    assert sample(logits[1:2], [p], [3], [0]) == alone[0]  # seed and output index 0: as sample() picks


def test_each_step_advances_the_output_index_and_the_penalty_state():
    sampler = Sampler(None, (EOS,))
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0, min_tokens=1, max_tokens=4)
    seq = sampler.join(p, prompt_ids=[1, 2])
    logits = torch.zeros(1, V)
    logits[0, EOS] = 3.0
    logits[0, 4] = 2.0
    logits[0, 5] = 1.0
    (first,), _ = sampler(logits, [seq])
    assert first == 4 and seq.num_output == 1  # EOS held back by min_tokens
    (second,), _ = sampler(logits, [seq])
    assert second == EOS and seq.num_output == 2
    # A sequence rebuilt elsewhere from its outputs samples as this one would.
    rebuilt = sampler.join(p, prompt_ids=[1, 2], output_ids=[4])
    assert rebuilt.num_output == 1 and rebuilt.penalties.output_counts == {4: 1}


def test_join_takes_the_seed_of_the_params_or_the_one_given():
    sampler = Sampler(None, ())
    assert sampler.join(SamplingParams(seed=7)).seed == 7
    assert sampler.join(SamplingParams(seed=7), seed=11).seed == 11
    assert sampler.join(SamplingParams(), num_output=5).num_output == 5


def _draws(logits: torch.Tensor, p: SamplingParams, n: int) -> torch.Tensor:
    """How often each token of logits [V] was drawn in n draws (seeds 0 .. n - 1)."""
    counts = torch.zeros(logits.numel())
    for seed in range(n):
        counts[sample(logits[None], [p], [seed], [0])[0]] += 1
    return counts


def _expected(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution temperature, top-k and top-p define, by a full sort (the definition)."""
    scores = logits / p.temperature
    if p.top_k:
        scores = scores.masked_fill(scores < torch.topk(scores, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(scores.double(), -1)
    top, order = torch.sort(probs, descending=True)
    top = top.masked_fill(top.cumsum(0) - top >= p.top_p, 0.0)
    return torch.zeros_like(probs).scatter_(0, order, top / top.sum())


def test_sampled_tokens_follow_the_distribution_the_params_define():
    """Each token is drawn with its probability (a chi-square test at 1e-4), and tokens that
    temperature, top-k or top-p leave out are never drawn."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, -20.0, 1.2, 0.3, -0.2])
    n = 6000
    for p in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=2.0, top_k=8, top_p=0.9)):
        counts, want = _draws(logits, p, n), _expected(logits, p)
        assert (counts[want == 0] == 0).all(), p
        seen = want > 0
        chi2 = float((((counts[seen] - n * want[seen]) ** 2) / (n * want[seen])).sum())
        assert chi2 < 37.0, (p, chi2)  # the 1e-4 tail of chi-square with at most 11 degrees of freedom


def test_the_nucleus_grows_past_its_first_guess_to_the_full_sort():
    """top-p's kept set is the definition's whether the nucleus is small, needs more tokens
    than the first partial sort holds, or needs the whole vocabulary."""
    from lamina.sampling.sampler import NUCLEUS_FIRST, nucleus

    gen = torch.Generator().manual_seed(0)
    for spread, top_p in ((8.0, 0.9), (0.05, 0.5), (0.0, 0.999)):  # peaked, flat (past the first guess), uniform
        probs = torch.softmax(torch.randn(5000, generator=gen) * spread, -1)
        kept, ids = nucleus(probs, top_p)
        top, order = torch.sort(probs, descending=True)
        n = int((top.cumsum(0) - top < top_p).sum())
        assert kept.numel() == n and torch.equal(torch.sort(ids).values, torch.sort(order[:n]).values)
        assert spread != 0.05 or n > NUCLEUS_FIRST
