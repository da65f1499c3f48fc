"""How a model worker spreads its sequences over micro-batches. Pure decisions.

Staggered pipelining keeps several micro-batches in flight: while the attention
workers compute one micro-batch's layer, the model worker computes another's slice.
Splitting has a price: every micro-batch's step reads all the weights again, so a
step of two half batches costs the model worker more than one whole batch (on a
2-core CPU, a slice pass costs about 65 ms plus 3.3 ms per sequence: docs/services.md).
So a worker keeps only as many micro-batches active as give each at least
`min_size` sequences, up to its configured number.

Sequences join the smallest active micro-batch; a micro-batch that has grown past
its share (after others lost sequences, or after it stopped being active) gives the
excess away at the start of its own step, the one moment its sequences are certainly
in no step in flight.
"""

from __future__ import annotations

from collections.abc import Sequence


def num_active(num_sequences: int, max_micro_batches: int, min_size: int) -> int:
    """Micro-batches worth running for this many sequences: 1 .. max_micro_batches."""
    return max(1, min(max_micro_batches, num_sequences // max(1, min_size)))


def join_target(sizes: Sequence[int], active: int | None = None) -> int:
    """The micro-batch a joining sequence goes to: the smallest active one (the first
    of equals)."""
    active = len(sizes) if active is None else active
    return min(range(active), key=lambda i: sizes[i])


def rebalance(own: int, sizes: Sequence[int], active: int | None = None) -> list[int]:
    """At micro-batch `own`'s step start: where to move its excess sequences.

    Returns one target micro-batch per sequence to move (possibly empty). An inactive
    micro-batch gives away everything; an active one moves only while a move narrows
    the gap, so the active sizes end within one of each other.
    """
    active = len(sizes) if active is None else active
    sizes = list(sizes)
    moves: list[int] = []
    while sizes[own]:
        target = join_target(sizes, active)
        if own < active and sizes[own] - sizes[target] <= 1:
            break
        sizes[own] -= 1
        sizes[target] += 1
        moves.append(target)
    return moves
