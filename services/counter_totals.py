"""Prometheus counters fed from running totals kept elsewhere (a pool's seconds sending,
a graph cache's replays, the process's device waits): each report adds to each counter
what its total grew since the last report."""

from __future__ import annotations

from collections.abc import Mapping

import prometheus_client


class CounterTotals:
    """`counters` by total's name (None: a total only tracked, its growth returned, not
    counted); `start`: totals already there when counting starts (a process-wide one
    that grew before this service existed), 0 for the others."""

    def __init__(self, counters: Mapping[str, prometheus_client.Counter | None],
                 start: Mapping[str, float] | None = None) -> None:
        self._counters = dict(counters)
        self._last = {name: float((start or {}).get(name, 0.0)) for name in self._counters}

    def report(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Each counter advanced by its total's growth (touched only when it grew: a
        report comes with every frame or step); the growths by name."""
        grew = {name: totals[name] - last for name, last in self._last.items()}
        for name, delta in grew.items():
            counter = self._counters[name]
            if delta and counter is not None:
                counter.inc(delta)
            self._last[name] = totals[name]
        return grew
