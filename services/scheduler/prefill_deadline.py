"""How long the scheduler waits for a prefill call before it takes the worker for lost.

A prefill call lasts as long as the forwards of the prompt tokens queued at the worker
ahead of it and its own, which on a CPU is seconds per thousand tokens: a fixed deadline
(`deadlines.rpc_s`) failed every prompt of a few thousand tokens on two cores as a lost
worker, rebuilt it onto the same busy worker and failed the requests queued behind it.
The deadline is `rpc_s` plus those tokens at the slowest rate the worker is expected to
keep: its own published forward rate (a running figure over its recent forwards,
lamina.services.prefill.prefill_service) slowed SLOWDOWN times, since that figure comes
mostly from short prompts while a long prompt's attention grows with its length, and
other processes may take the cores meanwhile; before it published one, the configured
`deadlines.prefill_tokens_per_s`. A worker that hangs is still found: later, by as much
as its queue takes at that rate.
"""

from __future__ import annotations

# A prompt of 8,192 tokens forwards at about a third of the rate of short ones on a CPU (its
# attention's products outgrow the linears'), and a shared host's other processes can
# halve what remains.
SLOWDOWN = 8.0


def prefill_deadline_s(rpc_s: float, queued_tokens: int, measured_tokens_per_s: float | None,
                       prior_tokens_per_s: float) -> float:
    """Seconds to wait for a prefill call with `queued_tokens` uncached prompt tokens at the
    worker (this call's among them)."""
    rate = measured_tokens_per_s / SLOWDOWN if measured_tokens_per_s else prior_tokens_per_s
    return rpc_s + max(queued_tokens, 0) / rate
