"""The adaptive busy-poll policy (pure bookkeeping)."""

from __future__ import annotations

import pytest

from transports import TransportConfig
from transports.polling import BusyPoll


def test_spins_until_misses_in_a_row():
    poll = BusyPoll(50.0)
    assert poll.active and poll.budget == pytest.approx(50e-6)
    poll.miss()
    assert poll.active  # one slow reply is not a pattern
    poll.hit()
    poll.miss()
    assert poll.active  # a hit in between resets the count
    poll.miss()
    assert not poll.active


def test_short_parked_wait_turns_spinning_back_on():
    poll = BusyPoll(50.0)
    poll.miss()
    poll.miss()
    poll.parked(0.05)  # a 50 ms wait: the peer is still slow
    assert not poll.active
    poll.parked(100e-6)  # answered within a few budgets: spin again
    assert poll.active


def test_zero_budget_never_spins():
    poll = BusyPoll(0.0)
    poll.parked(0.0)
    assert not poll.active


def test_config_validation():
    with pytest.raises(ValueError, match="busy_poll_us"):
        TransportConfig(busy_poll_us=-1)
    with pytest.raises(ValueError, match="ucx_progress_mode"):
        TransportConfig(ucx_progress_mode="fast")
    assert TransportConfig(busy_poll_us=0).busy_poll_us == 0
