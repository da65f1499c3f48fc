"""The local engine's pure-decode step, timed: what `lamina profile` compares with the
models' prediction to find the rest of a layer's cost (planner/profile.py), and what
bench/engine_throughput.py and bench/planner_validation.py time at fixed batch sizes.

A step counts its fastest repeat by default, as the profile's kernels do
(planner/measure/kernels.py): a neighbour inflates a step's time, never deflates it, and
the profile's overhead terms are the gap between this step and the kernels' prediction,
so the two must be the same kind of figure; `pick=statistics.median` gives the typical
step instead."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lamina.model.loader import LoadedModel

# Which of the timed steps' seconds a measurement reports.
Pick = Callable[[list[float]], float]


def decode_step_cpu(loaded: LoadedModel, batch: int, prompt_len: int, steps: int, seed: int,
                    pick: Pick = min) -> float:
    """CPU seconds of a pure-decode step at a fixed batch size (after one prefill step):
    the fastest of `steps`, or `pick` of them."""
    return decode_step_timed(loaded, batch, prompt_len, steps, seed, time.process_time, pick)


def decode_step_wall(loaded: LoadedModel, batch: int, prompt_len: int, steps: int, seed: int,
                     pick: Pick = min, device: str = "cpu", dtype: str = "float32") -> float:
    """The same step's wall seconds: with more than one thread its CPU time counts each
    thread's, and on another device (an engine there: `device`, `dtype`) the device works
    while the CPU waits (a step ends when its tokens reach the host)."""
    return decode_step_timed(loaded, batch, prompt_len, steps, seed, time.perf_counter, pick, device, dtype)


def decode_step_timed(loaded: LoadedModel, batch: int, prompt_len: int, steps: int, seed: int,
                      clock: Callable[[], float], pick: Pick = min, device: str = "cpu",
                      dtype: str = "float32") -> float:
    """`pick` of the `clock` seconds of `steps` pure-decode steps: every prompt is prefilled
    in one step first (the step's limits and the KV sized for it), then the steps are timed."""
    from lamina.engine import Engine, SamplingParams
    from lamina.engine.engine import EngineConfig
    from lamina.engine.scheduler import SchedulerLimits

    kv_bytes = 2 * batch * (prompt_len + steps + 2) * loaded.config.kv_bytes_per_token()
    engine = Engine(loaded, EngineConfig(kv_capacity_bytes=max(2 << 30, kv_bytes), device=device, dtype=dtype,
                                         limits=SchedulerLimits(max_batch_size=max(64, batch),
                                                                max_step_tokens=max(2048, batch * prompt_len))))
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
    return pick(times)
