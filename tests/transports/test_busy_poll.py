"""The adaptive busy-poll policy (pure bookkeeping) and its default budget."""

from __future__ import annotations

import os
import time

import pytest

from lamina.transports import TransportConfig
from lamina.transports.polling import DEFAULT_BUDGET_US, BusyPoll, default_budget_us

BUDGET = 50e-6
PROBE = BusyPoll.PROBE_SCALE * BUDGET


def parked(skipped: int = 0) -> BusyPoll:
    """A policy that has stopped spinning, ``skipped`` waits into its probe period."""
    poll = BusyPoll(50.0)
    poll.miss()
    poll.miss()
    for _ in range(skipped):
        assert poll.spin_for() == 0.0
    return poll


def test_spins_until_misses_in_a_row():
    poll = BusyPoll(50.0)
    assert poll.spin_for() == pytest.approx(BUDGET)
    poll.miss()
    assert poll.spinning  # one slow reply is not a pattern
    poll.hit()
    poll.miss()
    assert poll.spinning  # a hit in between resets the count
    poll.miss()
    assert not poll.spinning


def test_probes_one_wait_in_probe_every_and_longer_than_the_budget():
    poll = parked()
    spins = [poll.spin_for() for _ in range(3 * BusyPoll.PROBE_EVERY)]
    assert [i for i, s in enumerate(spins) if s] == [BusyPoll.PROBE_EVERY * k - 1 for k in (1, 2, 3)]
    assert all(s == pytest.approx(PROBE) for s in spins if s)
    poll.miss()  # the last probe found the peer still slow
    assert not poll.spinning


def test_a_probe_hit_holds_spinning_for_a_grace_of_probe_every_waits():
    poll = parked(BusyPoll.PROBE_EVERY - 1)
    assert poll.spin_for() == pytest.approx(PROBE)
    poll.hit()
    for _ in range(BusyPoll.PROBE_EVERY + BusyPoll.MAX_MISSES - 1):
        assert poll.spin_for() == pytest.approx(BUDGET)  # back to the budget
        poll.miss()  # misses in the grace do not count, then MAX_MISSES - 1 that do
    assert poll.spinning
    poll.spin_for()
    poll.miss()
    assert not poll.spinning


def probe_hit(poll: BusyPoll) -> None:
    """Park until the next probe, which gets its frame."""
    while not poll.spin_for():
        pass
    poll.hit()


def test_unanswered_graces_make_the_next_ones_rarer_until_a_quick_reply():
    poll = parked()
    for every in (2, 4, 8, 8):
        probe_hit(poll)
        assert poll.spinning
        for _ in range(BusyPoll.PROBE_EVERY + BusyPoll.MAX_MISSES):
            poll.spin_for()
            poll.miss()  # the whole grace unanswered: a slow peer
        assert not poll.spinning
        for _ in range(every - 1):
            probe_hit(poll)  # no grace: parked again after MAX_MISSES misses
            for _ in range(BusyPoll.MAX_MISSES):
                poll.spin_for()
                poll.miss()
            assert not poll.spinning
    probe_hit(poll)  # the eighth probe hit starts a grace
    poll.spin_for()
    poll.hit()  # answered within the budget: every probe hit starts a grace again
    for _ in range(BusyPoll.MAX_MISSES):
        poll.spin_for()
        poll.miss()
    probe_hit(poll)
    for _ in range(BusyPoll.PROBE_EVERY):
        poll.spin_for()
        poll.miss()
    assert poll.spinning


def test_an_ordinary_hit_ends_the_grace():
    poll = parked(BusyPoll.PROBE_EVERY - 1)
    poll.spin_for()
    poll.hit()  # the probe's
    poll.spin_for()
    poll.hit()  # the peer answers within the budget: misses count again
    for _ in range(BusyPoll.MAX_MISSES):
        poll.spin_for()
        poll.miss()
    assert not poll.spinning


def test_zero_budget_never_spins():
    poll = BusyPoll(0.0)
    assert not any(poll.spin_for() for _ in range(100))
    with pytest.raises(ValueError, match="budget"):
        BusyPoll(-1.0)


def test_keep_spinning_starts_a_spin_then_parks_with_a_miss_when_it_runs_out():
    slow = BusyPoll(1e6)  # a 1 s budget: the next look is surely within it
    deadline = slow.keep_spinning(0.0)
    assert deadline > 0 and slow.keep_spinning(deadline) == deadline
    poll = BusyPoll(50.0)
    deadline = poll.keep_spinning(0.0)  # first empty look: a spin starts
    assert deadline > 0
    time.sleep(100e-6)
    assert poll.keep_spinning(deadline) == 0.0  # ran out: park, and count a miss
    assert poll.keep_spinning(poll.keep_spinning(0.0) - 1.0) == 0.0  # second miss in a row
    assert not poll.spinning and poll.keep_spinning(0.0) == 0.0  # parks without spinning now
    assert BusyPoll(0.0).keep_spinning(0.0) == 0.0


# ---------------------------------------------------------------- two ends of a ping-pong
WAKE = 200e-6  # a parked process's wake-up (between the budget and a probe)
WORK = 10e-6  # one end's turnaround, and the wire


def wait(poll: BusyPoll, start: float, arrival: float, cost: list[float]) -> float:
    """When a receiver whose wait began at ``start`` has a frame landing at ``arrival``."""
    if arrival <= start:
        return start  # already there: not a wait
    spin = poll.spin_for()
    if spin and arrival <= start + spin:
        poll.hit()
        cost[0] += arrival - start
        return arrival
    if spin:
        poll.miss()
        cost[0] += spin
    return arrival + WAKE


def ping_pong(a: BusyPoll, b: BusyPoll, exchanges: int, peer_work: float = WORK):
    """Round trips of ``a`` sending and ``b`` echoing after ``peer_work``, and ``a``'s
    spin time per exchange."""
    t = b_free = 0.0
    cost = [0.0]
    rtts = []
    for _ in range(exchanges):
        b_got = wait(b, b_free, t + WORK, [0.0])
        b_free = b_got + peer_work  # b sends the reply and starts its next wait
        a_got = wait(a, t, b_free + WORK, cost)
        rtts.append(a_got - t)
        t = a_got + WORK
    return rtts, cost[0] / exchanges


FAST = 3 * WORK + 1e-9  # the wire twice and the echo: both ends spinning


def recovers_within(a: BusyPoll, b: BusyPoll, exchanges: int) -> bool:
    """Whether the ping-pong of ``a`` and ``b`` is fast, and stays fast, within ``exchanges``."""
    rtts, _ = ping_pong(a, b, exchanges + 2 * BusyPoll.PROBE_EVERY)
    first = next((i for i, r in enumerate(rtts) if r <= FAST), len(rtts))
    return first <= exchanges and all(r <= FAST for r in rtts[first:]) and a.spinning and b.spinning


def test_two_parked_ends_spin_again_whatever_the_phase_of_their_probes():
    # Before the grace, ends whose probes were more than MAX_MISSES waits apart stayed
    # parked for good: each saw only slow replies, each behind the other's wake-up.
    for phase_a in range(BusyPoll.PROBE_EVERY):
        for phase_b in range(BusyPoll.PROBE_EVERY):
            assert recovers_within(parked(phase_a), parked(phase_b), 2 * BusyPoll.PROBE_EVERY), \
                (phase_a, phase_b)


def test_ends_that_learnt_their_peer_was_slow_still_spin_again_once_it_is_quick():
    bound = (BusyPoll.MAX_GRACE_EVERY + 1) * BusyPoll.PROBE_EVERY
    a, b = parked(), parked(9)
    ping_pong(a, b, 100 * BusyPoll.PROBE_EVERY, peer_work=100e-6)  # b answers in 100 us
    assert a._grace_every == BusyPoll.MAX_GRACE_EVERY and not a.spinning
    assert recovers_within(a, b, bound)
    for phase_a in range(0, BusyPoll.PROBE_EVERY, 3):
        for phase_b in range(0, BusyPoll.PROBE_EVERY, 5):
            for hits_a, hits_b in ((1, BusyPoll.MAX_GRACE_EVERY), (BusyPoll.MAX_GRACE_EVERY, 3),
                                   (BusyPoll.MAX_GRACE_EVERY, BusyPoll.MAX_GRACE_EVERY)):
                a, b = parked(phase_a), parked(phase_b)  # both backed off as far as they go
                a._grace_every = b._grace_every = BusyPoll.MAX_GRACE_EVERY
                a._hits_to_grace, b._hits_to_grace = hits_a, hits_b
                assert recovers_within(a, b, bound), (phase_a, phase_b, hits_a, hits_b)


def test_what_spinning_costs_against_slow_peers():
    exchanges = 64 * BusyPoll.PROBE_EVERY
    # Slower than a probe: only the probes spin.
    _, cost = ping_pong(parked(), parked(7), exchanges, peer_work=1e-3)
    assert cost == pytest.approx(PROBE / BusyPoll.PROBE_EVERY, rel=0.05)
    # Between the budget and a probe: probes hit, and graces spin the budget out in vain,
    # rarer as they go unanswered (one probe hit in MAX_GRACE_EVERY at most).
    _, cost = ping_pong(parked(), parked(7), exchanges, peer_work=100e-6)
    assert cost < 1.5 * PROBE / BusyPoll.PROBE_EVERY


# ---------------------------------------------------------------- the default budget
def test_default_budget_spins_only_while_busy_processes_fit_the_cores():
    assert default_budget_us(2, num_cores=2) == DEFAULT_BUDGET_US == 50.0
    assert default_budget_us(3, num_cores=2) == 0.0
    assert default_budget_us(4, num_cores=2) == 0.0
    assert default_budget_us(5, num_cores=16) == 50.0
    assert default_budget_us(1, num_cores=1) == 50.0
    cores = len(os.sched_getaffinity(0))
    assert default_budget_us(cores) == 50.0 and default_budget_us(cores + 1) == 0.0
    with pytest.raises(ValueError, match="busy_processes"):
        default_budget_us(0)


def test_config_derives_the_budget_unless_one_is_set():
    cores = len(os.sched_getaffinity(0))
    assert TransportConfig().busy_poll_us is None
    assert TransportConfig().busy_poll_budget_us == default_budget_us(2)
    assert TransportConfig(busy_processes=cores + 1).busy_poll_budget_us == 0.0
    assert TransportConfig(busy_processes=cores).busy_poll_budget_us == 50.0
    assert TransportConfig(busy_poll_us=20.0, busy_processes=cores + 1).busy_poll_budget_us == 20.0
    assert TransportConfig(busy_poll_us=0).busy_poll_budget_us == 0


def test_config_validation():
    with pytest.raises(ValueError, match="busy_poll_us"):
        TransportConfig(busy_poll_us=-1)
    with pytest.raises(ValueError, match="busy_processes"):
        TransportConfig(busy_processes=0)
    with pytest.raises(ValueError, match="ucx_progress_mode"):
        TransportConfig(ucx_progress_mode="fast")
