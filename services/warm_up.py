"""A worker's first forward, made before it registers: a short made-up sequence through
its slices, attending over its own keys, its output and KV thrown away.

What a worker's first forward pays once, the first request would otherwise pay: the
compute library's threads started (on the CPU, OpenMP's for the forward's own thread),
the native kernels' first calls, on a GPU the kernels' modules loaded and cuBLAS's
handle made. On two cores the first request after `lamina up` took 313 ms to its first
token against 53-90 ms for the next ones (bench/first_request.py shows the effect).

The warm-up touches nothing a request sees: its attention is plain causal SDPA over its
own K and V (no KV store, no attention worker, no prefix cache), and a prefill worker
does not count it in its forward rate (the scheduler's deadlines read that figure).

On a GPU the warm-up also captures the workers' CUDA graphs (`warm_up_graph_keys`,
`graph_plan`): a model worker's decode slices for each of its micro-batches (or, colocated,
its whole decode steps) and an attention worker's decode attention, for every batch
bucket up to `scheduler.max_batch_size` and every context bucket up to that many keys.
Captured lazily instead, each bucket's first step waits for its captures (every sequence
in flight then takes a late token). Capturing reads made-up rows: a step of one token at
position 0 a row; in the graphs that attend (an attention worker's, a colocated worker's
whole steps) every row is padding, which writes no KV and attends over no key.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lamina.model.attention import causal_attention
from lamina.model.batch import StepBatch
from lamina.model.slice_graphs import buckets_up_to
from lamina.model.step_graphs import context_buckets_up_to
from lamina.planner.measure.kernels import synchronize
from lamina.services.config import StackConfig

# A prefill worker's made-up prompt (tokens); a model worker's step is one token, as a
# decode step's rows are.
PROMPT_TOKENS = 16


def warm_up_inputs(vocab_size: int, tokens: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The slices' inputs of one sequence of `tokens` made-up ids from position 0, its
    last row scored."""
    return StepBatch.build(["warm-up"], [_made_up_ids(vocab_size, tokens)], [0]).model_inputs(device)


def decode_inputs(vocab_size: int, rows: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The slices' inputs of a decode step of `rows` made-up sequences, one token each at
    position 0 (every row scored, as a decode step's)."""
    ids = [[t] for t in _made_up_ids(vocab_size, rows)]
    return StepBatch.build([f"warm-up-{i}" for i in range(rows)], ids, [0] * rows).model_inputs(device)


def _made_up_ids(vocab_size: int, n: int) -> list[int]:
    """n token ids spread over the vocabulary."""
    return [(7 + 31 * i) % vocab_size for i in range(n)]


@dataclass(frozen=True)
class GraphPlan:
    """The CUDA graphs a worker captures at start: these batch buckets, and these context
    buckets for graphs that attend."""

    buckets: tuple[int, ...]
    contexts: tuple[int, ...]


def graph_plan(config: StackConfig, max_context: int) -> GraphPlan | None:
    """What a worker on a GPU captures before it serves (None: nothing, each graph at its
    first step): with warm_up and warm_up_graph_keys, every batch bucket a step of up to
    scheduler.max_batch_size sequences takes, and every context bucket of up to
    warm_up_graph_keys keys (at most the model's `max_context`)."""
    if not config.warm_up or config.warm_up_graph_keys == 0:
        return None
    keys = min(config.warm_up_graph_keys, max_context)
    return GraphPlan(buckets_up_to(config.scheduler.max_batch_size), context_buckets_up_to(keys))


def attend_own(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The made-up sequence's attention over its own keys: q [T, Hq, D], k, v [T, Hkv, D]."""
    return causal_attention(q, k, v)


def finished(device: torch.device, started: float) -> float:
    """Seconds since `started` (perf_counter) once the device's queued work has ended."""
    synchronize(device)
    return time.perf_counter() - started
