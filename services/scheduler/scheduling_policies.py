"""Prefix-aware scheduling policies: pure functions that order a waiting queue.

- FCFS: arrival order.
- Fastest-Prefix-First (FPF): smallest tier distance first (0 device, 1 host, 2 disk,
  3 not cached), arrival order among equals. Starves requests with no cached prefix.
- Relaxed-FPF: priority = waiting time x (4 - distance), highest first: a cached
  prefix counts, but every request's priority grows while it waits.

A request's tier distance is the nearest tier any prefill worker's prefix cache holds
its prompt's prefix in (PrefixCache.tier_distance, asked of every live prefill worker:
services/scheduler/prefill_clients.py); the scheduler takes as many requests from the front of
the returned order as fit its budgets (services/scheduler/scheduler_admission.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MAX_DISTANCE = 3


@dataclass(frozen=True)
class QueuedRequest:
    request_id: str
    arrival_time: float
    tier_distance: int  # 0 device, 1 host, 2 disk, 3 not cached

    def __post_init__(self) -> None:
        if not 0 <= self.tier_distance <= MAX_DISTANCE:
            raise ValueError(f"tier_distance must be in 0..3, got {self.tier_distance}")


def fcfs(queue: Sequence[QueuedRequest], now: float) -> list[QueuedRequest]:
    return sorted(queue, key=lambda r: (r.arrival_time, r.request_id))


def fastest_prefix_first(queue: Sequence[QueuedRequest], now: float) -> list[QueuedRequest]:
    return sorted(queue, key=lambda r: (r.tier_distance, r.arrival_time, r.request_id))


def relaxed_priority(request: QueuedRequest, now: float) -> float:
    return max(0.0, now - request.arrival_time) * (MAX_DISTANCE + 1 - request.tier_distance)


def relaxed_fpf(queue: Sequence[QueuedRequest], now: float) -> list[QueuedRequest]:
    return sorted(queue, key=lambda r: (-relaxed_priority(r, now), r.arrival_time,
                                        r.request_id))


SchedulingPolicy = Callable[[Sequence[QueuedRequest], float], list[QueuedRequest]]

SCHEDULING_POLICIES: dict[str, SchedulingPolicy] = {
    "fcfs": fcfs,
    "fpf": fastest_prefix_first,
    "relaxed_fpf": relaxed_fpf,
}
