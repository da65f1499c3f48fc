"""The local engine's pure-decode step, timed: what `lamina profile` compares with the
models' prediction to find the rest of a layer's cost (planner/profile.py), and what
bench/engine_throughput.py and bench/planner_validation.py time at fixed batch sizes."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from lamina.model.loader import LoadedModel


def decode_step_cpu(loaded: LoadedModel, batch: int, prompt_len: int, steps: int, seed: int) -> float:
    """Median CPU seconds of a pure-decode step at a fixed batch size (after one prefill step)."""
    return decode_step_timed(loaded, batch, prompt_len, steps, seed, time.process_time)


def decode_step_wall(loaded: LoadedModel, batch: int, prompt_len: int, steps: int, seed: int) -> float:
    """The same step's median wall seconds: with more than one thread its CPU time counts
    each thread's."""
    return decode_step_timed(loaded, batch, prompt_len, steps, seed, time.perf_counter)


def decode_step_timed(loaded: LoadedModel, batch: int, prompt_len: int, steps: int, seed: int,
                      clock: Callable[[], float]) -> float:
    """Median `clock` seconds of a pure-decode step: every prompt is prefilled in one step
    first (the step's limits and the KV sized for it), then `steps` steps are timed."""
    from lamina.engine import Engine, SamplingParams
    from lamina.engine.engine import EngineConfig
    from lamina.engine.scheduler import SchedulerLimits

    kv_bytes = 2 * batch * (prompt_len + steps + 2) * loaded.config.kv_bytes_per_token()
    engine = Engine(loaded, EngineConfig(kv_capacity_bytes=max(2 << 30, kv_bytes), limits=SchedulerLimits(
        max_batch_size=max(64, batch), max_step_tokens=max(2048, batch * prompt_len))))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(batch):
        ids = torch.randint(100, loaded.config.vocab_size, (prompt_len,), generator=gen).tolist()
        engine.add_request(ids, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 2))
    engine.step()  # every prompt in one prefill step
    times = []
    for _ in range(steps):
        c = clock()
        engine.step()
        times.append(clock() - c)
    return statistics.median(times)
