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
Graphs are not captured here: a GPU's CUDA graphs are captured at the first step of
each batch bucket, as before.
"""

from __future__ import annotations

import time

import torch

from lamina.model.attention import causal_attention
from lamina.model.batch import StepBatch
from lamina.planner.measure.kernels import synchronize

# A prefill worker's made-up prompt (tokens); a model worker's step is one token, as a
# decode step's rows are.
PROMPT_TOKENS = 16


def warm_up_inputs(vocab_size: int, tokens: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The slices' inputs of one sequence of `tokens` made-up ids from position 0, its
    last row scored."""
    ids = [(7 + 31 * i) % vocab_size for i in range(tokens)]
    return StepBatch.build(["warm-up"], [ids], [0]).model_inputs(device)


def attend_own(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The made-up sequence's attention over its own keys: q [T, Hq, D], k, v [T, Hkv, D]."""
    return causal_attention(q, k, v)


def finished(device: torch.device, started: float) -> float:
    """Seconds since `started` (perf_counter) once the device's queued work has ended."""
    synchronize(device)
    return time.perf_counter() - started
