"""When a prefilled request waits before joining decode. A pure decision.

On a host where the prefill workers and a model worker share the cores, a model worker
that starts decoding the first prompts of a burst takes the cores that the rest of the
burst's prefill needs: a decode step reads every weight whatever its batch, so steps of
a few sequences cost nearly what steps of all of them do, and the prefill they slow
keeps the others out of the batch for longer. (`lamina up` on 2 cores, 48 requests at
once: 163 decode steps of 28 sequences on average where the engine, prefilling all
first, runs 95 of 48.) So a request whose model worker decodes nothing waits while
other requests' prefills are in flight on that host, and they join together; at most
`scheduler.join_hold_ms`, so that a long prefill never holds the first ones for longer.
A worker that already decodes takes every join at once: its steps run anyway.
"""

from __future__ import annotations


def holds_join(worker_sequences: int, prefilling: int, shares_host: bool, hold_s: float) -> bool:
    """Whether a prefilled request waits before it joins a model worker that holds
    `worker_sequences` sequences, while `prefilling` decode slots of other requests are
    prefilling; `shares_host`: a prefill worker runs on the model worker's host."""
    return hold_s > 0 and shares_host and worker_sequences == 0 and prefilling > 0
