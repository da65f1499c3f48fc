"""The restart policy of supervised services (services/launch/supervision.py): pure decisions."""

from __future__ import annotations

import signal

import pytest

from lamina.services.launch.supervision import GiveUp, Restart, RestartPolicy, Run, decide, describe_exit

POLICY = RestartPolicy(base_delay_s=0.5, max_delay_s=4.0, max_exits=4, window_s=100.0, stable_s=30.0)


def crashes(*times: float, ran_s: float = 1.0) -> list[Run]:
    """Processes that each ran `ran_s` and exited at `times`."""
    return [Run(t - ran_s, t) for t in times]


def test_first_exit_waits_the_base_delay():
    assert decide(POLICY, crashes(1000.0), now=1000.0) == Restart(0.5)


def test_delay_doubles_with_each_unstable_exit_up_to_the_cap():
    # Spread out so the window never fills: only the backoff is at work.
    runs = crashes(*(1000.0 + 60 * i for i in range(6)))
    delays = [decide(POLICY, runs[:n], now=runs[n - 1].exited_at) for n in range(1, 7)]
    assert delays == [Restart(0.5), Restart(1.0), Restart(2.0), Restart(4.0), Restart(4.0), Restart(4.0)]


def test_a_stable_run_resets_the_backoff():
    runs = crashes(1000.0, 1060.0, 1120.0) + [Run(1130.0, 1300.0)]  # the last one ran 170 s
    assert decide(POLICY, runs, now=1300.0) == Restart(0.5)
    # ... and a quick crash after it is the second exit of the new series.
    assert decide(POLICY, [*runs, Run(1301.0, 1302.0)], now=1302.0) == Restart(1.0)


def test_gives_up_at_max_exits_within_the_window():
    runs = crashes(1000.0, 1010.0, 1020.0, 1030.0)
    decision = decide(POLICY, runs, now=1030.0)
    assert isinstance(decision, GiveUp)
    assert decision.reason == "4 exits within 100 s"
    # Three in the window and one older: restart (the fourth exit's delay).
    assert decide(POLICY, crashes(900.0, 1010.0, 1020.0, 1030.0), now=1030.0) == Restart(4.0)


def test_stable_runs_in_the_window_still_count_towards_giving_up():
    # Four exits within the window give up even if the service ran stably in between:
    # it exits too often to be worth hiding.
    runs = [Run(900.0, 940.0), Run(941.0, 980.0), Run(981.0, 1020.0), Run(1021.0, 1030.0)]
    assert isinstance(decide(POLICY, runs, now=1030.0), GiveUp)


def test_many_exits_do_not_overflow_the_delay():
    runs = crashes(*(1000.0 + 200 * i for i in range(2000)))
    assert decide(POLICY, runs, now=runs[-1].exited_at) == Restart(4.0)


def test_needs_the_run_that_exited():
    with pytest.raises(ValueError):
        decide(POLICY, [], now=0.0)


@pytest.mark.parametrize("kwargs", [{"base_delay_s": 0}, {"base_delay_s": 5, "max_delay_s": 1}, {"max_exits": 0},
                                    {"window_s": 0}, {"stable_s": -1}])
def test_invalid_policies_are_refused(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)


def test_describe_exit():
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"
    assert describe_exit(-200) == "signal 200"
