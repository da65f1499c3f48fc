"""The adaptive busy-poll policy (pure bookkeeping)."""

from __future__ import annotations

import time

import pytest

from transports import TransportConfig
from transports.polling import BusyPoll


def spins_for(poll: BusyPoll, seconds: float) -> bool:
    """Whether ``poll.deadline()`` allows a spin of ``seconds`` (exact despite preemption:
    the deadline lies between the clock reads around it plus the spin)."""
    t0 = time.perf_counter()
    deadline = poll.deadline()
    t1 = time.perf_counter()
    return t0 + seconds - 1e-9 <= deadline <= t1 + seconds + 1e-9


def test_spins_until_misses_in_a_row():
    poll = BusyPoll(50.0)
    assert poll.should_spin() and poll.budget == pytest.approx(50e-6)
    poll.miss()
    assert poll.spinning  # one slow reply is not a pattern
    poll.hit()
    poll.miss()
    assert poll.spinning  # a hit in between resets the count
    poll.miss()
    assert not poll.spinning


def test_probes_now_and_then_and_a_hit_turns_spinning_back_on():
    poll = BusyPoll(50.0)
    poll.miss()
    poll.miss()
    decisions = [poll.should_spin() for _ in range(3 * BusyPoll.PROBE_EVERY)]
    assert sum(decisions) == 3 and decisions[BusyPoll.PROBE_EVERY - 1]  # one wait in PROBE_EVERY
    poll.miss()  # the probe found the peer still slow
    assert not poll.spinning
    for _ in range(BusyPoll.PROBE_EVERY - 1):
        assert not poll.should_spin()
    assert poll.should_spin()  # a probe spins longer than an ordinary spin
    assert spins_for(poll, BusyPoll.PROBE_SCALE * 50e-6)
    poll.hit()  # a probe that got its frame
    assert poll.spinning and all(poll.should_spin() for _ in range(5))
    assert spins_for(poll, 50e-6)  # back to the budget


def test_zero_budget_never_spins():
    poll = BusyPoll(0.0)
    assert not any(poll.should_spin() for _ in range(100))


def test_config_validation():
    with pytest.raises(ValueError, match="busy_poll_us"):
        TransportConfig(busy_poll_us=-1)
    with pytest.raises(ValueError, match="ucx_progress_mode"):
        TransportConfig(ucx_progress_mode="fast")
    assert TransportConfig(busy_poll_us=0).busy_poll_us == 0


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
