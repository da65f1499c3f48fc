"""When a receiver spins on its socket or ring before parking in the event loop.

A receiver that polls finds a reply microseconds after it lands; one that parks in the
event loop waits for the scheduler to wake its process, which on small virtual machines
costs tens to hundreds of microseconds per hop, more than the rest of a small frame's
path. Spinning only pays when replies come back quickly (layer-by-layer exchanges,
ping-pong) and burns a core otherwise, so the policy adapts: after ``MAX_MISSES`` spins
in a row ran out of budget it stops spinning, and then spins on one wait in
``PROBE_EVERY`` to find out whether the peer has become quick again. (Timing the parked
waits would not tell: on these machines the wake-up alone can exceed any sensible
threshold, so one unlucky pair of misses would switch spinning off for good.)
"""

from __future__ import annotations

import time


class BusyPoll:
    """The spin decision of one receiving connection (pure bookkeeping, no I/O)."""

    __slots__ = ("budget", "_misses", "_skipped")

    MAX_MISSES = 2
    PROBE_EVERY = 16

    def __init__(self, budget_us: float) -> None:
        if budget_us < 0:
            raise ValueError(f"busy-poll budget must be >= 0 microseconds, got {budget_us}")
        self.budget = budget_us * 1e-6  # seconds
        self._misses = 0
        self._skipped = 0

    @property
    def spinning(self) -> bool:
        """Whether waits spin (probes aside)."""
        return self.budget > 0 and self._misses < self.MAX_MISSES

    def should_spin(self) -> bool:
        """Asked once per wait: spin before parking this time?"""
        if self.budget <= 0:
            return False
        if self._misses < self.MAX_MISSES:
            return True
        self._skipped += 1
        if self._skipped >= self.PROBE_EVERY:
            self._skipped = 0
            return True
        return False

    def deadline(self) -> float:
        return time.perf_counter() + self.budget

    def hit(self) -> None:
        """Data came while spinning."""
        self._misses = 0

    def miss(self) -> None:
        """The budget ran out with nothing to read."""
        self._misses += 1
