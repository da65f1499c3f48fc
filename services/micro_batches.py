"""How a model worker spreads its sequences over micro-batches. Pure decisions.

Staggered pipelining keeps N micro-batches in flight: while the attention workers
compute one micro-batch's layer, the model worker computes another's slice. That pays
only while the micro-batches are about equal in size, so sequences join the smallest
one, and a micro-batch that has grown past its share (after others lost sequences)
gives the excess away at the start of its own step, the one moment its sequences are
certainly in no step in flight.
"""

from __future__ import annotations

from collections.abc import Sequence


def join_target(sizes: Sequence[int]) -> int:
    """The micro-batch a joining sequence goes to: the smallest (the first of equals)."""
    return min(range(len(sizes)), key=lambda i: sizes[i])


def rebalance(own: int, sizes: Sequence[int]) -> list[int]:
    """At micro-batch `own`'s step start: where to move its excess sequences.

    Returns one target micro-batch per sequence to move (possibly empty). A move is
    made only while it narrows the gap, so sizes end within one of each other.
    """
    sizes = list(sizes)
    moves: list[int] = []
    while True:
        target = join_target(sizes)
        if sizes[own] - sizes[target] <= 1:
            return moves
        sizes[own] -= 1
        sizes[target] += 1
        moves.append(target)
