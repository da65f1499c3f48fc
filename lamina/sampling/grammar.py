"""Constrained decoding: a grammar's token mask on a sequence's logits, by llguidance.

A request's `SamplingParams.grammar` is an llguidance grammar in its serialized form (what
`llguidance.LLMatcher.grammar_from_json_schema` or `grammar_from_lark` return; the
gateway writes it, see gateway/structured.py). Where a sequence samples (the engine's
Sequence, the prefill worker's first token, the model worker's DecodeSeq), its
`SeqSampling` (lamina.sampling.sampler) holds a `GrammarState`, which holds its matcher.
It is built from the grammar and the tokens the sequence generated so far, so a
sequence rebuilt, or moved to another model worker, is constrained exactly as it would
have been where it was. Before each sample the state's mask sets every token the
grammar does not allow next to -inf; EOS is allowed exactly when the grammar accepts
what was generated (and is then the only token left once the grammar can go no
further). After the sample the state consumes the token.

A matcher that fails (a grammar llguidance cannot compile here, a token history it
refuses) allows EOS alone, so the sequence ends instead of hanging; the failure is
logged once per sequence.

Cost: `Grammars` compiles each grammar text once per process (an LRU of compiled
matchers, copied per sequence, which is microseconds) and builds llguidance's view of the
tokenizer once, on first use (about 0.6 s for SmolLM2's). Sequences without a grammar
cost nothing here; a constrained one costs one mask computation (tens of microseconds to
a few milliseconds for JSON) and one token consumption per step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import llguidance
import numpy as np
import torch

from lamina.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Compiled grammars kept per process; a request's grammar is usually one of a few.
GRAMMAR_CACHE_SIZE = 64


class Grammars:
    """One process's grammar compiler: llguidance's tokenizer and the compiled-grammar cache.

    Used from one thread (its owner's event loop or step loop)."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            import llguidance.hf  # (imports transformers: only where a grammar is used)

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._tokenizer.hf_tokenizer, eos_token=list(self._tokenizer.eos_token_ids))
        return self._ll_tokenizer

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = self._compiled.get(grammar)
        if matcher is None:
            # log_level 0: failures are read with get_error() and logged here, once.
            matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
            self._compiled[grammar] = matcher
            if len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return matcher

    def state(self, grammar: str, output_ids: Iterable[int] = ()) -> GrammarState:
        """A sequence's state after it generated `output_ids` under `grammar`."""
        matcher = self._compile(grammar).deep_copy()
        ids = list(output_ids)
        if ids:
            matcher.consume_tokens(ids)
        return GrammarState(matcher)


class GrammarState:
    """One sequence's matcher: the tokens its grammar allows next."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self._logged = False
        self._check()

    def _check(self) -> None:
        if not self._logged and self._matcher.is_error():
            self._logged = True
            log.warning("a grammar-constrained sequence can only end: %s", self._matcher.get_error().split("\n")[0])

    @property
    def is_error(self) -> bool:
        return self._matcher.is_error()

    @property
    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool: the tokens the grammar allows next."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        # One bit per token, token i at bit i % 8 of byte i // 8.
        allowed = np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)
        if allowed.size < vocab_size:  # logits wider than the tokenizer's vocabulary: padding ids
            allowed = np.concatenate([allowed, np.zeros(vocab_size - allowed.size, dtype=bool)])
        return torch.from_numpy(allowed)

    def append(self, token: int) -> None:
        self._matcher.consume_token(token)
        self._check()


def apply_grammars(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
    """logits: [B, V] on any device, changed in place: in each row with a state, the tokens
    its grammar does not allow next become -inf (the mask is made on the host, where the
    grammar runs, and copied to the logits' device)."""
    vocab_size = logits.shape[1]
    for row, state in enumerate(states):
        if state is not None:
            logits[row].masked_fill_(~state.allowed(vocab_size).to(logits.device), float("-inf"))
