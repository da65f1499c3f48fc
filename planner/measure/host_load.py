"""How much of the host other processes took while something was measured.

These machines are shared: a measurement taken while a neighbour (or a compiler, or
another server) keeps the cores busy measures the neighbour. `ForeignCpu` counts the CPU
time the whole host spent busy (steal included) less what this process and the processes
under it spent, over an interval, as cores on average: what `lamina profile` records with
its figures, and the benchmarks print beside theirs.
"""

from __future__ import annotations

import contextlib
import time

import psutil


def cpu_seconds() -> tuple[float, float]:
    """(the host's busy CPU seconds, steal included; CPU seconds of this process and every
    process under it, those already ended and waited for included)."""
    host = psutil.cpu_times()
    busy = sum(host) - host.idle - getattr(host, "iowait", 0.0)
    me = psutil.Process()
    t = me.cpu_times()
    ours = t.user + t.system + t.children_user + t.children_system
    for p in me.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            c = p.cpu_times()
            ours += c.user + c.system
    return busy, ours


class ForeignCpu:
    """Started at construction; `cores()` is the CPU other processes took since, in cores
    on average (never below 0: the two counters are read a moment apart)."""

    def __init__(self) -> None:
        self._busy, self._ours = cpu_seconds()
        self._t = time.perf_counter()

    def cores(self) -> float:
        busy, ours = cpu_seconds()
        seconds = time.perf_counter() - self._t
        if seconds <= 0:
            return 0.0
        return max(0.0, ((busy - self._busy) - (ours - self._ours)) / seconds)
