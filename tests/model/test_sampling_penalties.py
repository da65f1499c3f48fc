"""Penalties and biases on logits: a hand-computed case, and transformers' logits processors."""

from __future__ import annotations

import pytest
import torch

from lamina.sampling.params import SamplingParams
from lamina.sampling.penalties import PenaltyState, apply_penalties, needs_state
from lamina.sampling.sampler import sample

V = 8


def _apply(logits, p, prompt, outputs, eos=(7,)):
    row = torch.tensor(logits, dtype=torch.float32)
    apply_penalties(row, p, PenaltyState.build(p, prompt, outputs, eos), len(outputs))
    return row.tolist()


def test_hand_computed_case():
    p = SamplingParams(max_tokens=10, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                       logit_bias=((0, 1.0), (6, -3.0)))
    logits = [1.0, 2.0, -1.0, 4.0, 0.5, -2.0, 3.0, 0.0]
    # prompt holds 1 and 2; the output so far is 3, 3, 5.
    got = _apply(logits, p, prompt=[1, 2], outputs=[3, 3, 5])
    want = [
        1.0 + 1.0,                  # 0: bias only
        2.0 / 2,                    # 1: in the prompt, positive: divided
        -1.0 * 2,                   # 2: in the prompt, negative: multiplied
        4.0 / 2 - 0.25 * 2 - 0.5,   # 3: output twice: repetition, then frequency x2 and presence
        0.5,                        # 4: untouched
        -2.0 * 2 - 0.25 - 0.5,      # 5: output once
        3.0 - 3.0,                  # 6: bias -3
        0.0,                        # 7
    ]
    assert got == pytest.approx(want)


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    p = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=(4,))
    assert _apply([0.0] * V, p, [1], [])[4] == float("-inf")
    assert _apply([0.0] * V, p, [1], [3])[7] == float("-inf")  # EOS
    assert _apply([0.0] * V, p, [1], [3, 3]) == [0.0] * V  # two outputs: free again
    ignoring = SamplingParams(max_tokens=10, min_tokens=2, ignore_eos=True)
    assert _apply([0.0] * V, ignoring, [1], [])[7] == 0.0


def test_defaults_change_nothing_and_need_no_state():
    assert not needs_state(SamplingParams())
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    p = SamplingParams(temperature=0.0)
    assert sample(logits, [p, p], [1, 1], [0, 0], [None, None]) == [1, 0]


def test_greedy_picks_the_argmax_of_the_penalized_logits_and_leaves_the_raw_ones():
    logits = torch.tensor([[5.0, 4.5, 0.0]])
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    state = PenaltyState.build(p, [], [0], ())
    assert sample(logits, [p], [1], [1], [state]) == [1]
    assert logits.tolist() == [[5.0, 4.5, 0.0]]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 50, generator=gen)
    prompt, outputs = [3, 7, 7, 11], [11, 20, 42]
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + outputs]), logits.clone())
    p = SamplingParams(repetition_penalty=penalty)
    assert _apply(logits[0].tolist(), p, prompt, outputs) == pytest.approx(ref[0].tolist())


def test_min_tokens_equals_transformers():
    from transformers import MinNewTokensLengthLogitsProcessor

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(4))
    prompt = [1, 2, 3]
    p = SamplingParams(min_tokens=3)
    for outputs in ([], [5], [5, 6], [5, 6, 8]):
        proc = MinNewTokensLengthLogitsProcessor(len(prompt), 3, eos_token_id=[49])
        ref = proc(torch.tensor([prompt + outputs]), logits.clone())
        assert _apply(logits[0].tolist(), p, prompt, outputs, eos=(49,)) == ref[0].tolist()


def test_logit_bias_equals_transformers_sequence_bias():
    from transformers import SequenceBiasLogitsProcessor

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(5))
    bias = {(4,): 2.5, (9,): -100.0}
    ref = SequenceBiasLogitsProcessor(bias)(torch.tensor([[1, 2]]), logits.clone())
    p = SamplingParams(logit_bias=((4, 2.5), (9, -100.0)))
    assert _apply(logits[0].tolist(), p, [1, 2], []) == pytest.approx(ref[0].tolist())
