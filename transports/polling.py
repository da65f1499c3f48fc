"""When a receiver spins on its socket or ring before parking in the event loop.

A receiver that polls finds a reply microseconds after it lands; one that parks in the
event loop waits for the scheduler to wake its process, which on small virtual machines
costs tens of microseconds per hop, more than the rest of a small frame's path. Spinning
only pays when replies come back quickly (layer-by-layer exchanges between model and
attention workers, ping-pong), and burns a core otherwise, so the policy adapts: after
``MAX_MISSES`` spins in a row that ran out of budget it stops spinning, and it starts
again once a parked wait turns out to have been short.
"""

from __future__ import annotations

import time


class BusyPoll:
    """The spin decision of one receiving connection (pure bookkeeping, no I/O)."""

    __slots__ = ("budget", "_misses")

    MAX_MISSES = 2
    SHORT_PARK = 4  # a parked wait under this many budgets means the peer is quick again

    def __init__(self, budget_us: float) -> None:
        if budget_us < 0:
            raise ValueError(f"busy-poll budget must be >= 0 microseconds, got {budget_us}")
        self.budget = budget_us * 1e-6  # seconds
        self._misses = 0

    @property
    def active(self) -> bool:
        """Spin before parking on the next wait."""
        return self.budget > 0 and self._misses < self.MAX_MISSES

    def deadline(self) -> float:
        return time.perf_counter() + self.budget

    def hit(self) -> None:
        """Data came while spinning."""
        self._misses = 0

    def miss(self) -> None:
        """The budget ran out with nothing to read."""
        self._misses += 1

    def parked(self, waited_s: float) -> None:
        """A wait in the event loop ended after ``waited_s`` seconds."""
        if waited_s < self.SHORT_PARK * self.budget:
            self._misses = 0
