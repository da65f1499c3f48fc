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

A probe spins ``PROBE_SCALE`` times the budget: when both ends of an exchange have
stopped spinning, each reply waits for the peer's own wake-up, and a probe as short as
the budget would never see a reply arrive, leaving both ends parked for good (measured:
8-byte shm round trips of 160-190 us instead of 14 us). A long probe catches the reply
behind that wake-up; that end spins again, answers quickly, and the other end's next
probe hits in turn.
"""

from __future__ import annotations

import os
import time

DEFAULT_BUDGET_US = 50.0


def default_budget_us(busy_processes: int, num_cores: int | None = None) -> float:
    """The spin budget where none is configured: spin only while every busy process on
    the host can have a core to itself. A spinning receiver on an oversubscribed host
    takes the core its peer needs to compute the reply it waits for."""
    cores = num_cores or len(os.sched_getaffinity(0))
    return DEFAULT_BUDGET_US if busy_processes <= cores else 0.0


class BusyPoll:
    """The spin decision of one receiving connection (pure bookkeeping, no I/O)."""

    __slots__ = ("budget", "_misses", "_skipped", "_probing")

    MAX_MISSES = 2
    PROBE_EVERY = 32
    PROBE_SCALE = 8

    def __init__(self, budget_us: float) -> None:
        if budget_us < 0:
            raise ValueError(f"busy-poll budget must be >= 0 microseconds, got {budget_us}")
        self.budget = budget_us * 1e-6  # seconds
        self._misses = 0
        self._skipped = 0
        self._probing = False

    @property
    def spinning(self) -> bool:
        """Whether waits spin (probes aside)."""
        return self.budget > 0 and self._misses < self.MAX_MISSES

    def should_spin(self) -> bool:
        """Asked once per wait: spin before parking this time?"""
        if self.budget <= 0:
            return False
        if self._misses < self.MAX_MISSES:
            self._probing = False
            return True
        self._skipped += 1
        if self._skipped >= self.PROBE_EVERY:
            self._skipped = 0
            self._probing = True
            return True
        return False

    def deadline(self) -> float:
        """When the spin that ``should_spin`` allowed ends (a probe spins longer)."""
        return time.perf_counter() + (self.budget * self.PROBE_SCALE if self._probing else self.budget)

    def keep_spinning(self, deadline: float) -> float:
        """One look of a wait that found nothing: the deadline to spin until (``deadline``
        is 0.0 on the first look, which starts a spin if this wait spins at all), or
        0.0 when the receiver should park now (no spin this time, or it ran out: a miss)."""
        if not deadline:
            return self.deadline() if self.should_spin() else 0.0
        if time.perf_counter() >= deadline:
            self.miss()
            return 0.0
        return deadline

    def hit(self) -> None:
        """Data came while spinning."""
        self._misses = 0

    def miss(self) -> None:
        """The budget ran out with nothing to read."""
        self._misses += 1
