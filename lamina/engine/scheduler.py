"""Continuous batching: which sequences run in the next step. A pure policy.

Running sequences always decode (one token each) while their KV fits; waiting
sequences join, in queue order, while the step's token budget, the batch size
limit and the KV capacity allow. The policy decides; the engine acts.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from lamina.engine.sequence import Sequence


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_size: int = 64  # sequences in one step
    max_step_tokens: int = 2048  # new tokens in one step (prompt tokens count in full)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_step_tokens < 1:
            raise ValueError("max_batch_size and max_step_tokens must be positive")


@dataclass(frozen=True)
class Schedule:
    running: list[Sequence]  # sequences in this step, decoding ones first
    admitted: list[Sequence]  # waiting sequences that join in this step (a subset of running)
    preempted: list[Sequence]  # running sequences that lost their KV room

    @property
    def is_empty(self) -> bool:
        return not self.running


def schedule(
    running: Seq[Sequence],
    waiting: Seq[Sequence],
    limits: SchedulerLimits,
    fits: Callable[[Sequence, int], bool],
) -> Schedule:
    """`fits(seq, total_tokens)` says whether seq's KV can grow to total_tokens tokens.

    A long prompt that exceeds the token budget alone still runs when nothing
    else is in the step, so no request waits forever.
    """
    chosen: list[Sequence] = []
    preempted: list[Sequence] = []
    tokens = 0
    for seq in running:
        if len(chosen) >= limits.max_batch_size or not fits(seq, seq.num_tokens):
            preempted.append(seq)
            continue
        chosen.append(seq)
        tokens += len(seq.next_input())
    admitted: list[Sequence] = []
    for seq in waiting:
        n = len(seq.next_input())
        if len(chosen) >= limits.max_batch_size:
            break
        if chosen and tokens + n > limits.max_step_tokens:
            break
        if not fits(seq, seq.num_tokens):
            break  # queue order is kept: later requests do not overtake this one
        chosen.append(seq)
        admitted.append(seq)
        tokens += n
    return Schedule(chosen, admitted, preempted)
