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
