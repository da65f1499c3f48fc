"""A prefill forward on the event loop against one on its own thread (forward_thread).

The prefill worker's forward ran on its event loop, awaiting each layer's KV sends in
between; it now runs on a thread of its own while the loop sends each finished layer
(services/prefill/forward_thread.py). This compares the two, alternately, on the real
model (SmolLM2-135M-Instruct, its weights as the GGUF file holds them, on the CPU) and
the prefill worker's own attention (a KV store and its in-process attention):

- `loop`: `SplitModel.run_async`, slices and attention under inference mode on the loop,
  each layer's send awaited after its attention (the worker's code before the thread);
- `thread`: `ForwardThread.run`, each layer's send run on the loop as the next computes.

The send stands for the transport's: each prompt's K and V of the layer copied into
bytes on the loop, as the TCP transport's frame encoder does, then a turn of the loop.
Per prompt length (--lengths, one prompt a forward, --tries tries of each variant in
turn): the forward's wall time, and the loop's longest stall while it ran (the largest
gap between the turns of a task that wakes every TICK_S, less TICK_S: what a health
probe, a new prompt or the registration's refresh waited for). The task is the loop's
only other work, as a prefill worker's loop is mostly idle while a forward computes.

Prints the machine, the workload, each try, and per length the medians and the ratios
thread / loop; the last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
from engine_throughput import cpu_model  # bench/: the CPU's model name, as the other benchmarks print it

from lamina.engine.kv import KVStore
from lamina.engine.step import in_process_attention
from lamina.model.batch import StepBatch
from lamina.model.threads import set_compute_threads
from lamina.services.model.model_service import ModelSlices
from lamina.services.prefill.forward_thread import ForwardThread

VARIANTS = ("loop", "thread")
TICK_S = 0.01


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="16,256,2048", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--tries", type=int, default=3, help="tries of each variant per length, alternated")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="the forward's compute threads (a prefill worker's prefill.threads)")
    return p.parse_args(argv)


async def _forward(slices: ModelSlices, forwards: ForwardThread, variant: str, tokens: list[int]) -> dict[str, float]:
    """One forward of `tokens` as `variant` runs it: its wall time and the loop's longest stall."""
    cfg = slices.cfg
    kv = KVStore(cfg, capacity_bytes=(len(tokens) + 64) * cfg.kv_bytes_per_token(4))
    seq = kv.reserve("s", len(tokens))
    batch = StepBatch.build(["s"], [tokens], [0])
    local = in_process_attention(kv, batch)
    inputs = {**batch.model_inputs(), "logits_index": torch.tensor([len(tokens) - 1])}
    sent = 0

    async def send(i: int) -> None:
        nonlocal sent
        sent += len(seq.buf[i, 0].numpy().tobytes()) + len(seq.buf[i, 1].numpy().tobytes())
        await asyncio.sleep(0)

    async def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out = local.attend(i, q, k, v)
        await send(i)
        return out

    stall = 0.0
    running = True

    async def ticker() -> None:
        nonlocal stall
        last = time.perf_counter()
        while running:
            await asyncio.sleep(TICK_S)
            now = time.perf_counter()
            stall = max(stall, now - last - TICK_S)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    try:
        if variant == "loop":
            await slices.split.run_async(inputs, attend)
        else:
            await forwards.run(slices.split, inputs, local.attend, send)
        wall = time.perf_counter() - start
    finally:
        running = False
        await tick
    assert sent == 2 * cfg.num_layers * seq.buf[0, 0].numel() * 4
    return {"seconds": wall, "stall_s": stall}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    set_compute_threads(args.threads)
    slices = ModelSlices.load(None, "as_file")
    vocab = slices.cfg.vocab_size
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}")
    print(f"workload: SmolLM2-135M-Instruct (as_file weights), one prompt a forward of {lengths} tokens, "
          f"{args.threads} compute threads, {args.tries} tries per variant, alternated; compared: "
          f"{', '.join(VARIANTS)}")
    forwards = ForwardThread(torch.device("cpu"))
    tries: dict[str, dict[str, list[dict[str, float]]]] = {str(n): {v: [] for v in VARIANTS} for n in lengths}
    try:
        for n in lengths:
            tokens = [100 + (i * 7919) % (vocab - 200) for i in range(n)]
            asyncio.run(_forward(slices, forwards, "thread", tokens[:8]))  # warm both paths
            asyncio.run(_forward(slices, forwards, "loop", tokens[:8]))
            for t in range(args.tries):
                order = VARIANTS if t % 2 == 0 else VARIANTS[::-1]
                for v in order:
                    row = asyncio.run(_forward(slices, forwards, v, tokens))
                    tries[str(n)][v].append(row)
                    print(f"  {n:>6} tokens  {v:<6}  forward {row['seconds'] * 1000:9.1f} ms  "
                          f"longest loop stall {row['stall_s'] * 1000:9.1f} ms", flush=True)
    finally:
        forwards.close(wait=True)
    summary: dict[str, Any] = {}
    print(f"\n{'tokens':>6}  {'loop ms':>10}  {'thread ms':>10}  {'time ratio':>10}  "
          f"{'loop stall':>10}  {'thread stall':>12}")
    for n, by in tries.items():
        med = {v: {k: statistics.median(r[k] for r in by[v]) for k in ("seconds", "stall_s")} for v in VARIANTS}
        ratio = med["thread"]["seconds"] / med["loop"]["seconds"]
        summary[n] = {"median": med, "thread_over_loop_seconds": ratio}
        print(f"{n:>6}  {med['loop']['seconds'] * 1000:10.1f}  {med['thread']['seconds'] * 1000:10.1f}  "
              f"{ratio:10.3f}  {med['loop']['stall_s'] * 1000:8.1f} ms  {med['thread']['stall_s'] * 1000:10.1f} ms")
    print(json.dumps({"machine": cpu_model(), "cores": os.cpu_count(), "threads": args.threads, "lengths": lengths,
                      "tries": tries, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
