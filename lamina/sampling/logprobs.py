"""Log-probabilities of sampled tokens, for requests that ask for them (OpenAI's `logprobs`).

They are taken from the same logits that pick the token, before anything sampling does
to them (penalties, logit_bias, temperature, top-k, top-p): a log-softmax in float32 of
the model's raw logits, which is what vLLM returns by default (its `raw_logprobs` mode).
The numbers then describe the model, not the request's sampling settings, and greedy and
sampled requests on the same prompt report the same values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The most alternatives a request may ask for (OpenAI's top_logprobs bound; vLLM's default max_logprobs).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the `k` most likely tokens' (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability)


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int],
                   num_top: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """logits: [B, V] on any device, the raw logits of the step; tokens: the B sampled ids;
    num_top: per row, how many alternatives to report (None: that row wants no logprobs).
    Only the rows that want logprobs are read, and only their figures reach the host."""
    import torch  # here: the gateway reads this module's types and never imports torch

    wanted = [(b, k) for b, k in enumerate(num_top) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    if not wanted:
        return out
    rows = [b for b, _ in wanted]
    lp = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)].float(), dim=-1)  # [R, V]
    picked = lp.gather(1, torch.tensor([[tokens[b]] for b in rows], device=lp.device)).squeeze(1).tolist()
    k_max = max(k for _, k in wanted)
    top_vals, top_ids = (lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long()))  # [R, k_max] each
    vals, ids = top_vals.tolist(), top_ids.tolist()
    for i, (b, k) in enumerate(wanted):
        out[b] = TokenLogprobs(tokens[b], picked[i], tuple(zip(ids[i][:k], vals[i][:k])))
    return out
