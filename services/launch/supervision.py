"""When to restart a service process that exited: a pure policy, no processes here.

The launcher (`lamina.services.launch.launcher.Stack`) records each exit of a service as a `Run`
(when that process started and when it exited, monotonic seconds) and asks `decide`
what to do. The answer is a `Restart` after a delay that doubles with each exit since
the service last ran stably, or `GiveUp` when it keeps crashing: then restarting again
would only hide the fault, so the launcher stops the stack and shows the log.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    base_delay_s: float = 0.5  # delay of the first restart after a stable run
    max_delay_s: float = 30.0  # the doubling stops here
    max_exits: int = 5  # give up at this many exits within window_s ...
    window_s: float = 120.0  # ... (a crash loop of a slow-starting service still fits in it)
    stable_s: float = 60.0  # a process that ran this long resets the backoff

    def __post_init__(self) -> None:
        if not 0 < self.base_delay_s <= self.max_delay_s:
            raise ValueError("need 0 < base_delay_s <= max_delay_s")
        if self.max_exits < 1 or self.window_s <= 0 or self.stable_s <= 0:
            raise ValueError("max_exits, window_s and stable_s must be positive")


@dataclass(frozen=True)
class Run:
    """One process of a service, from its start to its exit (monotonic seconds)."""

    started_at: float
    exited_at: float

    @property
    def duration_s(self) -> float:
        return self.exited_at - self.started_at


@dataclass(frozen=True)
class Restart:
    delay_s: float


@dataclass(frozen=True)
class GiveUp:
    reason: str


def decide(policy: RestartPolicy, runs: Sequence[Run], now: float) -> Restart | GiveUp:
    """What to do after the last of `runs` (oldest first, at least one) exited."""
    if not runs:
        raise ValueError("decide needs the run that just exited")
    recent = [r for r in runs if r.exited_at > now - policy.window_s]
    if len(recent) >= policy.max_exits:
        return GiveUp(f"{len(recent)} exits within {policy.window_s:.0f} s")
    # Exits since the service last ran stably (that run's exit included): the first
    # exit of a series waits the base delay, each later one twice the one before.
    num_exits = 0
    for r in reversed(runs):
        num_exits += 1
        if r.duration_s >= policy.stable_s:
            break
    return Restart(min(policy.base_delay_s * 2 ** min(num_exits - 1, 30), policy.max_delay_s))


def describe_exit(returncode: int) -> str:
    """A Popen return code in words: 'exit code 1' or 'signal SIGKILL'."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"
