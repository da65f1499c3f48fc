"""The Sampler: one step's tokens and log-probabilities, each sequence's state kept."""

from __future__ import annotations

import pytest
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
        kept, ids = nucleus(probs[None], [top_p])  # [1, K] each, zeros past the nucleus
        top, order = torch.sort(probs, descending=True)
        n = int((top.cumsum(0) - top < top_p).sum())
        assert int((kept > 0).sum()) == n and torch.equal(kept[0, :n], top[:n])
        assert torch.equal(torch.sort(ids[0, :n]).values, torch.sort(order[:n]).values)
        assert spread != 0.05 or n > NUCLEUS_FIRST


def _by_definition(logits: torch.Tensor, p: SamplingParams, u: float) -> int:
    """The token u picks under p by a full sort: the kept tokens' cumulative mass, in id
    order (most probable first where top-p keeps a nucleus), first passing u times their total."""
    scores = logits / p.temperature
    if p.top_k:
        scores = scores.masked_fill(scores < torch.topk(scores, min(p.top_k, scores.numel())).values[-1], float("-inf"))
    probs = torch.softmax(scores, -1)
    ids = torch.arange(probs.numel())
    if p.top_p < 1.0:
        top, order = torch.sort(probs, descending=True)
        keep = int((top.cumsum(0) - top < p.top_p).sum())
        probs, ids = top[:keep], order[:keep]
    cdf = probs.double().cumsum(0)
    i = min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), int(torch.searchsorted(cdf, cdf[-1])))
    return int(ids[i])


def _mixed_batch(rows: int, width: int, seed: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    """Logits [rows, width] of mixed spreads and every kind of sampled row: temperature
    alone, top-k, top-p (small nuclei and ones past the first partial sort), both."""
    gen = torch.Generator().manual_seed(seed)
    spreads = torch.tensor([0.02, 1.0, 6.0])[torch.randint(0, 3, (rows,), generator=gen)]
    logits = torch.randn(rows, width, generator=gen) * spreads[:, None]  # [rows, width]
    kinds = (SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=40),
             SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.5, top_k=300, top_p=0.95),
             SamplingParams(temperature=1.0, top_p=0.999), SamplingParams(temperature=2.0, top_k=width * 2))
    return logits, [kinds[r % len(kinds)] for r in range(rows)]


def test_a_whole_batch_picks_each_row_as_the_definition_does():
    """`pick` over a whole batch at once (how the sampler runs off the CPU) gives each row
    the token a full sort with the same uniform number gives, and the same as the row
    alone (how the sampler runs on the CPU)."""
    from lamina.sampling.sampler import draw, pick

    for width, seed in ((49_152, 0), (300, 1)):
        logits, params = _mixed_batch(24, width, seed)
        us = [draw(seed, r) for r in range(len(params))]
        batch = pick(logits, params, us).tolist()
        want = [_by_definition(logits[r], p, u) for r, (p, u) in enumerate(zip(params, us))]
        assert batch == want
        assert batch == [int(pick(logits[r:r + 1], [p], [u])[0]) for r, (p, u) in enumerate(zip(params, us))]
        # sample() with greedy rows among them: those take the argmax, the others as above.
        mixed = [SamplingParams(temperature=0.0) if r % 4 == 0 else p for r, p in enumerate(params)]
        got = sample(logits, mixed, [seed] * len(params), list(range(len(params))))
        assert got == [int(logits[r].argmax()) if r % 4 == 0 else want[r] for r in range(len(params))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch finds none here)")
def test_the_sampler_on_cuda_picks_what_it_picks_on_the_cpu():
    """Logits on the GPU: the batch is picked there, with penalties, a grammar-free batch of
    every kind of row and logprobs, and gives the CPU's tokens and (within float32
    rounding) its log-probabilities."""
    logits, params = _mixed_batch(64, 49_152, 2)
    params[0] = SamplingParams(temperature=0.0, logprobs=3)
    params[1] = SamplingParams(temperature=0.8, frequency_penalty=1.5, logit_bias=((7, 5.0),), logprobs=0)
    params[2] = SamplingParams(temperature=0.0, repetition_penalty=1.3, min_tokens=2)

    def run(device: str) -> tuple[list[int], list]:
        sampler = Sampler(None, (EOS,))
        seqs = [sampler.join(p, prompt_ids=[1, 2, 3], output_ids=[7, 7, 9], seed=11 + r, num_output=1)
                for r, p in enumerate(params)]
        return sampler(logits.to(device), seqs)

    cpu_tokens, cpu_lp = run("cpu")
    gpu_tokens, gpu_lp = run("cuda")
    assert gpu_tokens == cpu_tokens
    for a, b in zip(cpu_lp, gpu_lp):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
