"""The sampler: one step's tokens and log-probabilities from its logits.

Every place that samples (the local engine's step, the prefill worker's first tokens,
the model worker's decode steps) keeps one `SeqSampling` per sequence, built by
`Sampler.join` when the sequence joins, and calls the `Sampler` once per step. The
order is fixed here, once: penalties and biases, then the grammar's mask, then the
pick (greedy, or temperature, top-k, top-p with the token's own seeded generator),
then the log-probabilities of the raw logits; the sampled tokens are then appended to
each sequence's penalty and grammar state.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from lamina.sampling.grammar import Grammars, GrammarState, apply_grammars
from lamina.sampling.logprobs import TokenLogprobs, token_logprobs
from lamina.sampling.params import SamplingParams, new_seed
from lamina.sampling.penalties import PenaltyState, apply_penalties, needs_state


@dataclass
class SeqSampling:
    """One sequence's sampling state where it samples."""

    params: SamplingParams
    seed: int  # the request's seed (or a random one): with num_output, the token's generator
    num_output: int = 0  # index among the outputs of the token it samples next
    penalties: PenaltyState | None = None  # when its params change logits (lamina.sampling.penalties)
    grammar: GrammarState | None = None  # when its params have a grammar (lamina.sampling.grammar)

    def append(self, token: int) -> None:
        """`token` became this sequence's output number `num_output`."""
        self.num_output += 1
        if self.penalties is not None:
            self.penalties.append(token)
        if self.grammar is not None:
            self.grammar.append(token)


class Sampler:
    """Builds sequences' sampling state and samples their tokens, one step at a time.

    `grammars`: the process's grammar compiler (None where no sequence may have a
    grammar); `eos_ids`: the ids min_tokens holds back unless a request ignores EOS.
    Used from one thread, as its Grammars is."""

    def __init__(self, grammars: Grammars | None, eos_ids: Collection[int]) -> None:
        self._grammars = grammars
        self._eos_ids = tuple(eos_ids)

    def join(self, params: SamplingParams, prompt_ids: Iterable[int] = (), output_ids: Sequence[int] = (),
             seed: int | None = None, num_output: int | None = None) -> SeqSampling:
        """The state of a sequence that generated `output_ids` after `prompt_ids`
        (`prompt_ids` matter only to a repetition penalty). seed: the params' when None
        (a random one when they have none either); num_output: len(output_ids) when None."""
        if seed is None:
            seed = params.seed if params.seed is not None else new_seed()
        penalties = PenaltyState.build(params, prompt_ids, output_ids, self._eos_ids) if needs_state(params) else None
        grammar = None
        if params.grammar is not None:
            if self._grammars is None:
                raise ValueError("a sequence has a grammar and this sampler has no grammar compiler")
            grammar = self._grammars.state(params.grammar, output_ids)
        return SeqSampling(params, seed, len(output_ids) if num_output is None else num_output, penalties, grammar)

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SeqSampling]
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [B, V] float32, one row per sequence in `seqs`, left as they are.
        Returns the B sampled token ids and, per row, its log-probabilities (None where
        its params ask for none); each sequence's state has then taken its token."""
        tokens = sample(logits, [s.params for s in seqs], [s.seed for s in seqs], [s.num_output for s in seqs],
                        [s.penalties for s in seqs], [s.grammar for s in seqs])
        logprobs = token_logprobs(logits, tokens, [s.params.logprobs for s in seqs])
        for seq, token in zip(seqs, tokens):
            seq.append(token)
        return tokens, logprobs


def _generator(seed: int, index: int) -> torch.Generator:
    # Each sampled token gets its own generator derived from (request seed, token
    # index): sampling is then independent of batching and of which service samples
    # (prefill samples the first token, the model worker the rest).
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + index) % (2**63))
    return gen


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
           indices: Sequence[int], states: Sequence[PenaltyState | None] | None = None,
           grammars: Sequence[GrammarState | None] | None = None) -> list[int]:
    """logits: [B, V] float32, one row per request; seeds and output indices per row;
    `states`: per row, its PenaltyState when its params change logits (None otherwise);
    `grammars`: per row, its GrammarState when its params have a grammar (None otherwise):
    its mask applies after the penalties, so no bias brings back a token it forbids.
    `logits` itself is left as it is (logprobs are taken from it).

    Returns B token ids.
    """
    penalized = states is not None and any(s is not None for s in states)
    constrained = grammars is not None and any(g is not None for g in grammars)
    if penalized or constrained:
        logits = logits.clone()
    if states is not None and penalized:
        for row, (p, state, index) in enumerate(zip(params, states, indices)):
            if state is not None:
                apply_penalties(logits[row], p, state, index)
    if grammars is not None and constrained:
        apply_grammars(logits, grammars)
    greedy = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for row, (p, seed, index) in enumerate(zip(params, seeds, indices)):
        if p.is_greedy:
            out.append(greedy[row])
        else:
            out.append(_sample_row(logits[row], p, _generator(seed, index)))
    return out


# The nucleus (top-p) is looked for among this many most probable tokens first, then
# NUCLEUS_GROWTH times more until it is found: a partial sort of a few hundred tokens
# instead of a sort of the whole vocabulary (4.8 ms for SmolLM2's 49,152 on one core).
NUCLEUS_FIRST = 64
NUCLEUS_GROWTH = 8


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """One token from logits [V] under temperature, top-k and top-p, drawn with `gen`:
    one uniform number against the cumulative distribution of the kept tokens (float64
    sums), which draws each with its probability. torch.multinomial does the same job
    in about 1 ms for 49,152 tokens; this in about 0.1 ms (0.2-0.35 ms with top-p)."""
    scores = logits / p.temperature  # [V]
    if p.top_k:
        kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [V]
    ids = None  # kept tokens' ids where only some are kept ([N]), else probs is indexed by id
    if p.top_p < 1.0:
        probs, ids = nucleus(probs, p.top_p)  # [N] each, most probable first
    cdf = probs.double().cumsum(0)  # [N]
    u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))  # the first token whose cumulative mass passes u
    if i >= cdf.numel():  # u rounded up to the total: the last token with any mass
        i = int(torch.searchsorted(cdf, cdf[-1]))
    return i if ids is None else int(ids[i])


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of most probable tokens whose mass reaches top_p (at least one):
    (their probabilities, their ids), [N] each, most probable first. probs: [V]."""
    k = NUCLEUS_FIRST
    while True:
        if k >= probs.numel():
            top, ids = torch.sort(probs, descending=True)
        else:
            top, ids = torch.topk(probs, k)  # [k] each, sorted
        before = top.cumsum(0) - top  # mass of the more probable tokens
        keep = int((before < top_p).sum())  # a prefix: `before` only grows
        if keep < top.numel() or k >= probs.numel():
            return top[:keep], ids[:keep]
        k *= NUCLEUS_GROWTH
