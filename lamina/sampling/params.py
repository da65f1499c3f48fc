"""Sampling parameters: how one request picks its tokens and when it stops."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from lamina.sampling.logprobs import MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters.
    A seed makes sampling reproducible per request, independent of batching.
    logprobs: report each sampled token's log-probability and this many alternatives'
    (None: none; see lamina.sampling.logprobs). The penalties, logit_bias and min_tokens
    are lamina.sampling.penalties'; their defaults change nothing. grammar: an llguidance
    grammar (serialized) that every output token must follow (lamina.sampling.grammar);
    EOS then ends the output only where the grammar accepts, so ignore_eos and
    min_tokens, which hold EOS back, cannot be combined with it.
    skip_special_tokens and include_stop_str_in_output (vLLM's) say only how the
    gateway turns the output ids into text (gateway/output.py); the engine's own
    `text` and the control plane's messages do not carry them.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct
    grammar: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.grammar is not None and (self.ignore_eos or self.min_tokens):
            raise ValueError("a grammar cannot be combined with ignore_eos or min_tokens")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def new_seed() -> int:
    """A random 63-bit seed for a request that did not ask for one."""
    return secrets.randbits(63)
