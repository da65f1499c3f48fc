"""The native attention kernel on one thread and on the products' worker pool, in a decode step.

A decode step of SmolLM2-135M's shape (30 layers; 9 query and 3 KV heads of 64) is run
as the engine and a colocated model worker run it: each layer's packed products
(lamina.planner.measure.kernels' q4_1 layers, LAYER's four matrices, each layer its own
weights, so they stream from memory and the pool's workers are busy just before) and
then that layer's attention over every sequence's KV by the native kernel
(csrc/kv_attention.c), through

- `buffers`: the engine's layout (lamina.model.kv_attention.BufferBatch, a buffer per
  sequence), and
- `slots`: the attention core's (lamina.model.kv_attention.SlotStep over one slab pool
  per layer, every sequence's slots scattered in 64-token runs).

Only the attention calls are timed (wall time: with several threads CPU time counts
every thread), with the kernel on one thread and on --threads (the pool the products
use), the settings alternating step by step so that both see the same machine. Every
output of the threaded kernel is checked equal to the one-thread output, bit for bit.
Workloads: --shapes, batch x context. The last line printed is one JSON object.

    python bench/attention_kernel.py [--shapes 1x128,1x512,1x2048,4x512,16x512,64x512 --threads 2 --steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from lamina.model import kv_attention, quant
from lamina.model.kv_attention import BufferBatch, SlotBatch, SlotPools, SlotStep
from lamina.planner.measure.kernels import make_layers

LAYERS, HQ, HKV, D = 30, 9, 3, 64
RUN = 64  # tokens a slab run holds: a sequence's slots are runs of this many, scattered


def _buffers(batch: int, context: int, gen: torch.Generator):
    """Each sequence's [layers, 2, context + 1, Hkv, D] buffer holding `context` tokens."""
    bufs = [torch.randn(LAYERS, 2, context + 1, HKV, D, generator=gen) for _ in range(batch)]
    return BufferBatch(bufs, [context] * batch, [1] * batch)


def _slots(batch: int, context: int, gen: torch.Generator):
    """One pool per layer; sequence b's context + 1 slots in runs of RUN, runs shuffled."""
    per_seq_runs = -(-(context + 1) // RUN)
    num_slots = batch * per_seq_runs * RUN
    k_pools = [torch.randn(num_slots, HKV, D, generator=gen) for _ in range(LAYERS)]
    v_pools = [torch.randn(num_slots, HKV, D, generator=gen) for _ in range(LAYERS)]
    runs = torch.randperm(batch * per_seq_runs, generator=gen).view(batch, per_seq_runs)
    per_seq = [[int(r) * RUN + i for r in runs[b] for i in range(RUN)][: context + 1] for b in range(batch)]
    slot_batch = SlotBatch.build(per_seq, num_slots)
    new = torch.tensor([s[-1] for s in per_seq], dtype=torch.int64)
    return SlotStep(SlotPools(k_pools, v_pools), slot_batch, [1] * batch, new)


def _step(x: dict[int, torch.Tensor], attend, q: torch.Tensor, layers: list) -> float:
    """One decode step: each layer's products, then its attention (timed). Seconds of attention."""
    spent = 0.0
    for layer in range(LAYERS):
        for pw in layers[layer]:
            quant.packed_matmul(x[pw.k], pw)
        t = time.perf_counter()
        attend(layer, q)
        spent += time.perf_counter() - t
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1x128,1x512,1x2048,4x512,16x512,64x512",
                    help="batch x context, comma-separated")
    ap.add_argument("--threads", type=int, default=2, help="the products' threads, and the kernel's when threaded")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per setting and layout")
    args = ap.parse_args()
    if kv_attention.NATIVE is None or quant.NATIVE is None:
        raise SystemExit("the native kernels are not built (model/_kv_attention, model/_qmatmul): run `make native`")
    torch.set_num_threads(1)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"compared: the attention kernel on 1 thread vs on {args.threads} (the products' pool), in a decode step "
          f"of {LAYERS} layers ({HQ} query, {HKV} KV heads of {D}) with q4_1 products on {args.threads} threads "
          f"between layers; {args.steps} steps per setting, alternating; wall ms of the step's attention, medians")
    gen = torch.Generator().manual_seed(0)
    layers = make_layers("q4_1", LAYERS, gen)
    rows = []
    for shape in args.shapes.split(","):
        batch, context = (int(v) for v in shape.split("x"))
        x = {k: torch.randn(batch, k, generator=gen) for k in (576, 1536)}
        q = torch.randn(batch, HQ, D, generator=gen)
        for layout, build in (("buffers", _buffers), ("slots", _slots)):
            kv = build(batch, context, gen)

            def attend(layer, q, kv=kv):
                return kv.attend(layer, q)[0] if isinstance(kv, BufferBatch) else kv.attend(layer, q)

            times: dict[int, list[float]] = {1: [], args.threads: []}
            outs: dict[int, torch.Tensor] = {}
            for step in range(args.steps + 1):
                for kernel_threads in (1, args.threads) if step % 2 else (args.threads, 1):
                    # The products keep --threads; only the attention calls change.
                    def timed(layer, q, n=kernel_threads):
                        quant.set_kernel_threads(n)
                        try:
                            return attend(layer, q)
                        finally:
                            quant.set_kernel_threads(args.threads)

                    quant.set_kernel_threads(args.threads)
                    spent = _step(x, timed, q, layers)
                    if step:  # the first is a warm-up
                        times[kernel_threads].append(spent)
                    outs[kernel_threads] = timed(LAYERS - 1, q)
            same = torch.equal(outs[1], outs[args.threads])
            one, many = (statistics.median(times[n]) * 1e3 for n in (1, args.threads))
            rows.append({"batch": batch, "context": context, "layout": layout, "ms_1_thread": round(one, 3),
                         f"ms_{args.threads}_threads": round(many, 3), "speedup": round(one / many, 2),
                         "bit_equal": same})
            print(f"  {batch:3d} x {context:5d} {layout:8s} 1 thread {one:7.2f} ms   {args.threads} threads "
                  f"{many:7.2f} ms   {one / many:4.2f}x   outputs bit-equal: {same}", flush=True)
            if not same:
                raise SystemExit("the threaded kernel's output differs from one thread's")
    print(json.dumps({"threads": args.threads, "steps": args.steps, "rows": rows}))


if __name__ == "__main__":
    main()
