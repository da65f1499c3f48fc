"""LM-Offload's thread-count choice for CPU operators: with C cores, run k operators at
once (inter-op parallelism), each with C // k threads (intra-op parallelism).

An operator with single-thread compute time w and serial fraction s takes
w * (s + (1 - s) / p) on p threads (Amdahl), but never less than its memory traffic at
the bandwidth share it gets while k operators run (memory_s * k). Operators are placed
longest first on the k lanes; the choice is the (k, p) with the smallest makespan, the
smallest k on a tie (fewer operators in flight hold less memory at once).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuOp:
    compute_s: float  # on one thread
    memory_s: float  # at the whole machine's bandwidth
    serial_fraction: float = 0.05


@dataclass(frozen=True)
class ThreadChoice:
    inter_op: int
    intra_op: int
    makespan_s: float
    efficiency: float  # ideal makespan (perfect scaling on every core) / makespan, in (0, 1]


def op_time(op: CpuOp, threads: int, concurrent: int) -> float:
    amdahl = op.compute_s * (op.serial_fraction + (1 - op.serial_fraction) / threads)
    return max(amdahl, op.memory_s * concurrent)


def makespan(ops: list[CpuOp], inter_op: int, intra_op: int) -> float:
    lanes = [0.0] * inter_op
    concurrent = min(inter_op, len(ops))
    for t in sorted((op_time(op, intra_op, concurrent) for op in ops), reverse=True):
        heapq.heapreplace(lanes, lanes[0] + t)  # the least loaded lane takes the next op
    return max(lanes)


def choose_threads(ops: list[CpuOp], cores: int) -> ThreadChoice:
    if cores < 1 or not ops:
        raise ValueError("need at least one core and one operator")
    best: ThreadChoice | None = None
    ideal = max(sum(op.compute_s for op in ops) / cores, sum(op.memory_s for op in ops))
    for inter in range(1, min(cores, len(ops)) + 1):
        intra = cores // inter
        span = makespan(ops, inter, intra)
        if best is None or span < best.makespan_s * (1 - 1e-9):
            best = ThreadChoice(inter, intra, span, min(1.0, ideal / span) if span > 0 else 1.0)
    assert best is not None
    return best
