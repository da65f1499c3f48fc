"""The local engine's pure-decode step, timed: what `lamina profile` compares with the
models' prediction to find the rest of a layer's cost (planner/profile.py), and what
bench/engine_throughput.py and bench/planner_validation.py time at fixed batch sizes."""

from __future__ import annotations

import statistics
import time

import torch

from lamina.model.loader import LoadedModel


def decode_step_cpu(loaded: LoadedModel, batch: int, prompt_len: int, steps: int, seed: int) -> float:
    """Median CPU seconds of a pure-decode step at a fixed batch size (after one prefill step)."""
    from lamina.engine import Engine, SamplingParams

    engine = Engine(loaded)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(batch):
        ids = torch.randint(100, loaded.config.vocab_size, (prompt_len,), generator=gen).tolist()
        engine.add_request(ids, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 2))
    engine.step()  # every prompt in one prefill step
    times = []
    for _ in range(steps):
        c = time.process_time()
        engine.step()
        times.append(time.process_time() - c)
    return statistics.median(times)
