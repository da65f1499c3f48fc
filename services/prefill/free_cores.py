"""How many compute threads a prefill forward takes: the cores other threads leave free.

A prompt's forward is compute-bound: on `lamina up`'s one machine (2 cores), a 128-token
prompt's first token came after 562 ms with one thread and 412 with two when nothing else
ran. But the prefill worker shares the host with the model workers, and a forward on
every core while sequences decode takes the cores their steps need (with two threads
always, 12 requests at once got 0.87x the tokens/s of one thread). So before each forward
the prefill worker counts the threads of other processes runnable on the host
(/proc/loadavg's running count, sampled through the batch window) and takes the cores
they leave, at least one and at most its limit (`prefill.threads`). A colocated model
worker decoding on two threads kept 1-3 others runnable in every sample, on one thread
1; the gateway and scheduler taking in a burst of requests keep some runnable in some
samples only, so the window's fewest counts (the median left 12 requests' forwards on
one thread on an otherwise idle host). Measured with `lamina up --layout colocated
--model-threads 2` on that machine, against one thread always, alternating, 3 passes
(2026-11-29): 1.11x, 1.34x, 1.10x and 1.04x the tokens/s at 1, 4, 12 and 48 requests at
once (first token 516 against 689 ms at one).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

LOADAVG = Path("/proc/loadavg")
# Samples of the runnable count through the batch window (one where there is none).
SAMPLES = 5


def runnable_threads(loadavg: Path = LOADAVG) -> int | None:
    """The host's runnable threads now, the reader included (/proc/loadavg's fourth
    field, "running/total"), or None where the file is not there (not Linux)."""
    try:
        return int(loadavg.read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def forward_threads(limit: int, cores: int, others: float | None) -> int:
    """The threads a forward takes: the host's `cores` less the threads of other processes
    runnable meanwhile (`others`, rounded to the nearest whole one), at least 1 and at most
    `limit`; `limit` where `others` is unknown."""
    if others is None:
        return limit
    return max(1, min(limit, cores - int(others + 0.5)))


async def others_runnable(window_s: float, samples: int = SAMPLES, read=runnable_threads) -> float | None:
    """The fewest other threads runnable on the host in `samples` readings over `window_s`
    seconds (the first at once, the batch window's wait spent between them), this reader
    not counted; None where the count cannot be read."""
    counts = []
    for i in range(samples if window_s > 0 else 1):
        if i:
            await asyncio.sleep(window_s / (samples - 1))
        n = read()
        if n is None:
            return None
        counts.append(max(0, n - 1))  # the reading thread is runnable as it reads
    return min(counts)


def host_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
