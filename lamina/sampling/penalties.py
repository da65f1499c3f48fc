"""Penalties and biases on a sequence's logits before it samples: OpenAI's `logit_bias`,
`presence_penalty` and `frequency_penalty`, and vLLM's `min_tokens` and `repetition_penalty`.

They change the logits in vLLM's order: logit_bias and min_tokens first, then the
repetition penalty (over the prompt's and the output's tokens), then the frequency and
presence penalties (over the output's tokens alone). Greedy requests pick the argmax of
the changed logits; logprobs are still taken from the raw ones (lamina.sampling.logprobs).

A sequence's `PenaltyState` is kept where it samples, in its `SeqSampling`
(lamina.sampling.sampler: the engine's Sequence, the model worker's DecodeSeq, built whole
from the ids sent when it joins), so a sequence rebuilt elsewhere samples exactly as it
would have.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lamina.sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch


def needs_state(p: SamplingParams) -> bool:
    """Whether `p` changes logits at all (most requests do not, and cost nothing here)."""
    return bool(p.logit_bias or p.min_tokens or p.presence_penalty or p.frequency_penalty
                or p.repetition_penalty != 1.0)


def needs_prompt(p: SamplingParams) -> bool:
    """Only the repetition penalty looks at the prompt's tokens."""
    return p.repetition_penalty != 1.0


@dataclass
class PenaltyState:
    """What one sequence's penalties need: which tokens its prompt holds (only with a
    repetition penalty), how often each output token appeared, and the ids min_tokens
    holds back (EOS unless ignore_eos, and the stop token ids)."""

    prompt_ids: frozenset[int] = frozenset()
    output_counts: Counter[int] = field(default_factory=Counter)
    stop_ids: tuple[int, ...] = ()

    @classmethod
    def build(cls, p: SamplingParams, prompt_ids: Iterable[int], output_ids: Iterable[int],
              eos_ids: Iterable[int]) -> PenaltyState:
        stop = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        return cls(frozenset(prompt_ids) if needs_prompt(p) else frozenset(), Counter(output_ids),
                   tuple(sorted(stop)))

    def append(self, token: int) -> None:
        self.output_counts[token] += 1


def apply_penalties(row: torch.Tensor, p: SamplingParams, state: PenaltyState, num_output: int) -> None:
    """Change one sequence's logits `row` ([V], float32, on any device) in place before it
    samples its output number `num_output` (0-based)."""
    import torch  # here: the gateway and the scheduler read this module's predicates, never its tensors

    device = row.device
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=device)
        row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype, device=device))
    if num_output < p.min_tokens and state.stop_ids:
        row[torch.tensor(state.stop_ids, device=device)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = state.prompt_ids | state.output_counts.keys()
        if seen:
            ids = torch.tensor(sorted(seen), device=device)
            picked = row[ids]
            # As transformers' RepetitionPenaltyLogitsProcessor and vLLM: a positive logit
            # is divided by the penalty, a negative one multiplied, so both become less likely.
            row[ids] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and state.output_counts:
        ids = torch.tensor(list(state.output_counts.keys()), device=device)
        counts = torch.tensor(list(state.output_counts.values()), dtype=row.dtype, device=device)
        row[ids] -= p.frequency_penalty * counts + p.presence_penalty
