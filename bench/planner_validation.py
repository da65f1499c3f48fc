"""Planner validation: the planner's predicted decode step against the local engine's
measured one, on this machine, from a fresh `lamina profile`.

Cases: SmolLM2-135M-Instruct (float32 weights and KV, the engine's default) at batch
sizes 1 to 32 and prompts of 32 to 512 tokens; each case is the median CPU time of
--steps pure-decode steps after one prefill step (lamina.planner.measure.engine_step's
decode_step_cpu), with one torch thread, against lamina.planner.estimate.decode_step for a
colocated layout on `this-machine` (float32) at the same batch and mean context. The
profile is measured first in this process (planner/profile.py, --quick: fewer repeats);
its overhead terms are calibrated on the engine at other points (planner.profile.
OVERHEAD_POINTS: 16-token prompts), so no case here is one it was fitted to.

--stack adds the stack as `lamina up` starts it (lamina.planner.measure.stack_run's run_stack:
one model worker, TCP, float32 weights) with 1 and 2 attention workers at 1 and 2
micro-batches, decode tokens/s against the planner's disaggregated layout on
`this-machine` with `shared_host` (every service on this host's cores: the profile's
per-slice, per-frame and per-exchange overheads, calibrated on a smaller stack run, and
the host's CPU work over its cores).

Prints the table and, last, one JSON line: {"cases", "median_abs_rel_error",
"max_abs_rel_error", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from lamina.planner.estimate import decode_step
from lamina.planner.hardware import THIS_MACHINE, device_from_entry, load_catalogue
from lamina.planner.layouts import Layout
from lamina.planner.measure.engine_step import decode_step_cpu
from lamina.planner.measure.stack_run import make_prompts, run_stack
from lamina.planner.perf.quantization import FP32
from lamina.planner.profile import profile
from lamina.planner.shapes import BUILTIN

# Batch x prompt stays within one prefill step of the engine, so the timed steps are pure decode.
CASES = ((1, 32), (1, 512), (4, 128), (4, 512), (8, 64), (8, 256), (16, 128), (32, 64))


def stack_cases(loaded, shape, catalogue, steps: int, batch: int = 32, context: int = 256) -> list[dict]:
    prompts = make_prompts(loaded.tokenizer, batch, context)
    kv_bytes = (batch * (context + steps + 64) * loaded.config.kv_bytes_per_token()) // 2 + (256 << 20)
    rows = []
    for attention_workers in (1, 2):
        for micro in (1, 2):
            measured = run_stack(prompts, steps, "tcp", micro, False, 1, kv_bytes, "float32",
                                 attention_workers=attention_workers)["tok_s"]
            # Every service on this host: the layout shares its cores (lamina.planner.perf.pipeline).
            layout = Layout(THIS_MACHINE, 1, 1, THIS_MACHINE, attention_workers, micro, "head", FP32, FP32,
                            shared_host=True)
            step = decode_step(shape, layout, catalogue, batch, context + steps / 2)
            predicted = batch / step.step_s
            err = (predicted - measured) / measured
            rows.append({"stack_micro_batches": micro, "attention_workers": attention_workers, "batch": batch,
                         "prompt": context, "measured_tok_s": round(measured, 1),
                         "predicted_tok_s": round(predicted, 1), "rel_error": round(err, 3),
                         "bottleneck": step.bottleneck})
            print(f"stack, {micro} micro-batch(es), {attention_workers} attention worker(s), batch {batch}, "
                  f"context {context}: measured {measured:.1f} tok/s, predicted {predicted:.1f} tok/s, {err:+.1%}  "
                  f"{step.bottleneck}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps per case (within 10 minutes)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per case (default 12, 5 with --quick)")
    ap.add_argument("--stack", action="store_true",
                    help="also the stack at 1 and 2 micro-batches with 1 and 2 attention workers")
    ap.add_argument("--save-profile", type=Path, default=None, help="write the measured profile here (JSON)")
    args = ap.parse_args()
    steps = args.steps or (5 if args.quick else 12)

    import torch

    from lamina.model.loader import load_model

    prof = profile(threads=1, usd_per_hour=0.1, quick=args.quick, stack=args.stack)
    if args.save_profile:
        args.save_profile.write_text(json.dumps(prof, indent=2) + "\n")
    catalogue = dict(load_catalogue())
    catalogue[THIS_MACHINE] = device_from_entry(THIS_MACHINE, prof["device"])
    torch.set_num_threads(1)
    loaded = load_model()
    shape = BUILTIN["smollm2-135m"]
    layout = Layout(THIS_MACHINE, 1, weights=FP32, kv=FP32)
    rows = []
    print(f"{'batch':>5} {'prompt':>6} {'measured ms':>12} {'predicted ms':>13} {'rel error':>10}  bottleneck")
    for batch, prompt in CASES:
        measured = decode_step_cpu(loaded, batch, prompt, steps, seed=batch * 1000 + prompt)
        # The steps run at contexts prompt + 1 ... prompt + steps: their middle.
        predicted = decode_step(shape, layout, catalogue, batch, prompt + 1 + steps / 2)
        err = (predicted.step_s - measured) / measured
        rows.append({"batch": batch, "prompt": prompt, "measured_ms": round(measured * 1e3, 2),
                     "predicted_ms": round(predicted.step_s * 1e3, 2), "rel_error": round(err, 3),
                     "bottleneck": predicted.bottleneck})
        print(f"{batch:>5} {prompt:>6} {measured * 1e3:>12.2f} {predicted.step_s * 1e3:>13.2f} {err:>+10.1%}  "
              f"{predicted.bottleneck}")
    if args.stack:
        rows += stack_cases(loaded, shape, catalogue, steps=16)
    errors = [abs(r["rel_error"]) for r in rows]
    d = prof["device"]
    print(f"profile: memory {d['memory_tb_s']['value'] * 1e3:.2f} GB/s, "
          f"matmul {d['tflops']['fp32']['value'] * 1e3:.2f} GFLOP/s, "
          f"attention {d['attention_tb_s']['value'] * 1e3:.2f} GB/s of KV (1 thread); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if "slice_overhead_us" in d:
        print(f"stack overheads per layer: slice {d['slice_overhead_us']['value']:.0f} us, frame "
              f"{d['frame_overhead_us']['value']:.0f} us, exchange {d['exchange_overhead_us']['value']:.0f} us "
              f"(TCP round trip {2 * d['network_latency_us']['value']:.0f} us)")
    print(json.dumps({"cases": len(rows), "median_abs_rel_error": round(statistics.median(errors), 3),
                      "max_abs_rel_error": round(max(errors), 3), "rows": rows,
                      "load_avg_1min": round(os.getloadavg()[0], 2),
                      "profile": {"memory_gb_s": d["memory_tb_s"]["value"] * 1e3,
                                  "matmul_gflop_s": d["tflops"]["fp32"]["value"] * 1e3}}))


if __name__ == "__main__":
    main()
