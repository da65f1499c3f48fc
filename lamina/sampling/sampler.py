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


def draw(seed: int, index: int) -> float:
    """The uniform number in [0, 1) that picks a sequence's output number `index`.

    Each sampled token gets its own generator derived from (request seed, token index),
    always on the CPU: sampling is then independent of batching, of which service samples
    (prefill samples the first token, the model worker the rest) and of the device its
    logits are on."""
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + index) % (2**63))
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
           indices: Sequence[int], states: Sequence[PenaltyState | None] | None = None,
           grammars: Sequence[GrammarState | None] | None = None) -> list[int]:
    """logits: [B, V] float32 on any device, one row per request; seeds and output indices
    per row; `states`: per row, its PenaltyState when its params change logits (None
    otherwise); `grammars`: per row, its GrammarState when its params have a grammar (None
    otherwise): its mask applies after the penalties, so no bias brings back a token it
    forbids. `logits` itself is left as it is (logprobs are taken from it).

    The tokens are picked on the logits' device, off the CPU the whole batch at once, and
    only the B token ids come back (one copy to the host): on a GPU the [B, V] logits
    never cross to the CPU. Returns B token ids.
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
    tokens = logits.argmax(dim=-1)  # [B]
    rows = [row for row, p in enumerate(params) if not p.is_greedy]
    if not rows:
        return tokens.tolist()
    us = [draw(seeds[r], indices[r]) for r in rows]
    if logits.device.type == "cpu":
        # One row at a time: a row's float64 sums stay in the core's cache (0.4 MB for
        # 49,152 tokens) where the whole batch's would not, 2-4x faster at batch 48. The
        # rows' picks are the same either way.
        out = tokens.tolist()
        for r, u in zip(rows, us):
            out[r] = int(pick(logits[r:r + 1], [params[r]], [u])[0])
        return out
    tokens[torch.tensor(rows, device=tokens.device)] = pick(logits[rows], [params[r] for r in rows], us)  # [R]
    return tokens.tolist()


# The nucleus (top-p) is looked for among this many most probable tokens first, then
# NUCLEUS_GROWTH times more until every row's is found: a partial sort of a few hundred
# tokens instead of a sort of the whole vocabulary (4.8 ms for SmolLM2's 49,152 on one core).
NUCLEUS_FIRST = 64
NUCLEUS_GROWTH = 8


def pick(logits: torch.Tensor, params: Sequence[SamplingParams], us: Sequence[float]) -> torch.Tensor:
    """One token per row of logits [R, V] under its row's temperature, top-k and top-p,
    chosen by its uniform number u (`draw`): the first token whose cumulative mass among
    the kept ones passes u times their total (float64 sums), which draws each with its
    probability. The kept tokens are summed in id order, or most probable first where
    top-p keeps a nucleus. Every row at once, on the logits' device, with no copy to the
    host until the caller asks for the ids; a row's pick does not depend on the others.
    Returns [R] int64 token ids on that device.

    torch.multinomial does the same job in about 1 ms for 49,152 tokens on one core; this
    in about 0.1 ms a row (0.2-0.35 ms with top-p)."""
    device, width = logits.device, logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)  # [R]
    scores = logits / temperature[:, None]  # [R, V]
    top_ks = [min(p.top_k, width) for p in params]
    if any(top_ks):
        kth = torch.topk(scores, max(top_ks), dim=-1).values  # [R, kmax], largest first
        at = torch.tensor([max(k - 1, 0) for k in top_ks], device=device)  # [R]
        bound = kth.gather(1, at[:, None])  # [R, 1]: the k-th largest score
        bound.masked_fill_(torch.tensor([k == 0 for k in top_ks], device=device)[:, None], float("-inf"))
        scores = scores.masked_fill(scores < bound, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [R, V]
    u = torch.tensor(us, dtype=torch.float64, device=device)  # [R]
    cut = [r for r, p in enumerate(params) if p.top_p < 1.0]
    if not cut:
        return _search(probs, u)
    if len(cut) == len(params):
        return _from_nucleus(probs, [p.top_p for p in params], u)
    whole = [r for r, p in enumerate(params) if p.top_p >= 1.0]
    out = torch.empty(len(params), dtype=torch.int64, device=device)  # [R]
    for rows, picked in ((whole, None), (cut, [params[r].top_p for r in cut])):
        at = torch.tensor(rows, device=device)
        out[at] = _search(probs[at], u[at]) if picked is None else _from_nucleus(probs[at], picked, u[at])
    return out


def _from_nucleus(probs: torch.Tensor, top_ps: Sequence[float], u: torch.Tensor) -> torch.Tensor:
    top, ids = nucleus(probs, top_ps)  # [R, K] each, zeros past the nucleus
    return ids.gather(1, _search(top, u)[:, None]).squeeze(1)


def _search(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [R, K] (zeros at the end of a row count for nothing), u [R] float64 in [0, 1):
    per row, the column whose cumulative mass first passes u times the row's total."""
    cdf = probs.double().cumsum(-1)  # [R, K]
    total = cdf[:, -1:].contiguous()  # [R, 1]
    col = torch.searchsorted(cdf, u[:, None] * total, right=True)  # [R, 1]
    # u rounded up to the total: the last token with any mass.
    last = torch.searchsorted(cdf, total)  # [R, 1]
    return torch.where(col >= probs.shape[1], last, col).squeeze(1)


def nucleus(probs: torch.Tensor, top_ps: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of probs [R, V], the smallest set of most probable tokens whose mass
    reaches its top_p (at least one): (their probabilities, their ids), [R, K] each, most
    probable first, the probabilities past a row's nucleus set to 0."""
    width = probs.shape[1]
    limit = torch.tensor(top_ps, dtype=probs.dtype, device=probs.device)[:, None]  # [R, 1]
    k = NUCLEUS_FIRST
    while True:
        if k >= width:
            top, ids = torch.sort(probs, dim=-1, descending=True)  # [R, V] each
        else:
            top, ids = torch.topk(probs, k, dim=-1)  # [R, k] each, sorted
        before = top.cumsum(-1) - top  # [R, k]: mass of the more probable tokens
        inside = before < limit  # a prefix of each row: `before` only grows
        if k >= width or bool(inside[:, -1].logical_not().all()):
            return top.masked_fill(~inside, 0.0), ids
        k *= NUCLEUS_GROWTH
