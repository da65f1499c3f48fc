"""Rotational staggered pipelining: who runs what. Pure decisions.

Lamina's rotational form: with M model workers and N = M + 1 micro-batches, one
micro-batch is at its attention workers while each of the M model workers computes
another micro-batch's slice; when a micro-batch comes back from attention it goes to
whichever model worker is free, so neither side waits on a fixed partner.

Here one model worker, the coordinator, holds every decoding sequence (its decode
stream), sends every micro-batch's Q, K, V to the attention workers and samples; for
each slice it claims a free executor, itself or a peer model worker, which runs
that slice on the micro-batch's hidden state (lamina.services.model.slice_server).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

LOCAL = -1  # the coordinator itself, as an executor


def pick_executor(free: Sequence[int], last_used: Mapping[int, int]) -> int:
    """The free executor idle longest: the least recently claimed (never claimed
    first; among equals the coordinator, then the lowest index). `free` is not empty."""
    return min(free, key=lambda e: (last_used.get(e, -1), e))


def coordinator(loads: Sequence[int]) -> int:
    """Which live model worker a joining sequence goes to when rotational: the one
    already holding the most sequences (the coordinator; the first among equals), so
    every sequence is stepped by one worker, and a restarted worker does not start a
    second coordinator while the first holds sequences."""
    return max(range(len(loads)), key=lambda i: (loads[i], -i))
