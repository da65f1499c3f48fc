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

Both ends parked is a stable state of two such policies: each reply waits for the
peer's wake-up, so each end sees a slow peer. Two things get them out of it:

- A probe spins ``PROBE_SCALE`` times the budget, long enough to catch the reply behind
  the peer's wake-up (a probe as short as the budget never saw one arrive).
- A probe that gets its frame keeps the connection spinning for the next ``PROBE_EVERY``
  waits whatever their outcome (the grace). The peer, parked and probing on one wait in
  ``PROBE_EVERY`` too, probes within the grace: its probe catches this end's next frame,
  it spins again and answers at once, and this end, spinning, catches the answer within
  the budget: both spin again. Without the
  grace this end fell back to parking after ``MAX_MISSES`` waits, and since both ends
  count one wait per exchange their probes keep a fixed phase: unless they happened to
  fall within ``MAX_MISSES`` waits of each other, the two ends stayed parked for good
  (measured: TCP 8-byte round trips of 500 us instead of 21 us, run to run).

So two parked ends recover within about ``2 * PROBE_EVERY`` exchanges. The price is
paid against a peer that takes longer than the budget but less than a probe to answer:
there a grace spins the budget out in vain on ``PROBE_EVERY`` waits. So a grace that
nobody answered within the budget (a slow peer, not a parked one) makes the next ones
rarer: one probe hit in 2, then 4, up to ``MAX_GRACE_EVERY`` starts a grace, until a
reply within the budget resets that. Two ends that both learnt their peer was slow
still spin again within ``(MAX_GRACE_EVERY + 1) * PROBE_EVERY`` exchanges once it is
quick: either end's next grace covers the other's probe. Against a peer slower than a
probe, probes miss and cost ``PROBE_SCALE`` budgets in ``PROBE_EVERY`` waits.
"""

from __future__ import annotations

import os
import time

DEFAULT_BUDGET_US = 50.0


def default_budget_us(busy_processes: int, num_cores: int | None = None) -> float:
    """The spin budget where none is configured: ``DEFAULT_BUDGET_US`` while every busy
    process on the host can have a core to itself, else 0 (never spin).

    ``busy_processes``: the processes on this host that exchange frames and compute
    between them (a launcher passes the number it starts); ``num_cores``: the cores this
    process may run on, by default its CPU affinity. A spinning receiver on an
    oversubscribed host takes the core its peer needs to compute the reply it waits for.
    """
    if busy_processes < 1:
        raise ValueError(f"busy_processes must be at least 1, got {busy_processes}")
    if num_cores is None:
        num_cores = len(os.sched_getaffinity(0))
    return DEFAULT_BUDGET_US if busy_processes <= num_cores else 0.0


class BusyPoll:
    """The spin decision of one receiving connection (pure bookkeeping, no I/O).

    A wait is a receive that found no whole frame on its first look. For each wait the
    transport asks ``spin_for()``, spins that long, then reports ``hit()`` (the frame
    came while spinning) or ``miss()`` (the spin ran out); a wait that does not spin
    reports nothing.
    """

    __slots__ = (
        "_grace",
        "_grace_every",
        "_hits_to_grace",
        "_misses",
        "_probing",
        "_skipped",
        "budget",
    )

    MAX_MISSES = 2
    PROBE_EVERY = 32
    PROBE_SCALE = 8
    MAX_GRACE_EVERY = 8

    def __init__(self, budget_us: float) -> None:
        if budget_us < 0:
            raise ValueError(f"busy-poll budget must be >= 0 microseconds, got {budget_us}")
        self.budget = budget_us * 1e-6  # seconds
        self._misses = 0  # spins in a row that ran out (grace aside)
        self._skipped = 0  # waits parked since the last probe
        self._probing = False  # the current wait is a probe
        self._grace = 0  # waits left whose misses do not count
        self._grace_every = 1  # one probe hit in this many starts a grace
        self._hits_to_grace = 1  # probe hits until the next grace

    @property
    def spinning(self) -> bool:
        """Whether waits spin (probes aside)."""
        return self.budget > 0 and self._misses < self.MAX_MISSES

    def spin_for(self) -> float:
        """Asked once per wait: seconds to spin before parking (0.0: park at once)."""
        if self.budget <= 0:
            return 0.0
        self._probing = False
        if self._misses < self.MAX_MISSES:
            return self.budget
        self._skipped += 1
        if self._skipped < self.PROBE_EVERY:
            return 0.0
        self._skipped = 0
        self._probing = True
        return self.budget * self.PROBE_SCALE

    def hit(self) -> None:
        """Data came while spinning.

        A probe's hit may start a grace. Any other hit came within the budget: the peer
        is quick, so misses count again (the grace ends) and graces are granted on
        every probe hit again."""
        if self._probing:
            self._hits_to_grace -= 1
            if self._hits_to_grace <= 0:
                self._grace = self.PROBE_EVERY
                self._hits_to_grace = self._grace_every
        else:
            self._grace = 0
            self._grace_every = self._hits_to_grace = 1
        self._misses = 0
        self._skipped = 0

    def miss(self) -> None:
        """The spin ran out with nothing to read."""
        if self._grace > 0:
            self._grace -= 1
            if self._grace == 0:  # a whole grace unanswered: a slow peer, not a parked one
                self._grace_every = min(2 * self._grace_every, self.MAX_GRACE_EVERY)
                self._hits_to_grace = self._grace_every
            return
        self._misses += 1

    def keep_spinning(self, deadline: float) -> float:
        """One look of a wait that found nothing: the deadline to spin until (``deadline``
        is 0.0 on the first look, which starts a spin if this wait spins at all), or
        0.0 when the receiver should park now (no spin this time, or it ran out: a miss)."""
        if not deadline:
            spin = self.spin_for()
            return time.perf_counter() + spin if spin else 0.0
        if time.perf_counter() >= deadline:
            self.miss()
            return 0.0
        return deadline
