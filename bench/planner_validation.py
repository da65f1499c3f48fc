"""Planner validation: the planner's predicted decode step against the local engine's
measured one, on this machine, from a fresh `lamina profile`.

Cases: SmolLM2-135M-Instruct (float32 weights and KV, the engine's default) at batch
sizes 1 to 32 and prompts of 32 to 512 tokens; each case is the median CPU time of
--steps pure-decode steps after one prefill step (bench/engine_throughput.py's
decode_step_cpu), with one torch thread, against planner.estimate.decode_step for a
colocated layout on `this-machine` (float32) at the same batch and mean context. The
profile is measured first in this process (planner/profile.py, --quick: fewer repeats);
its overhead terms are calibrated on the engine at other points (planner.profile.
OVERHEAD_POINTS: 16-token prompts), so no case here is one it was fitted to.

--stack adds the stack as `lamina up` starts it (bench/decode_pipeline.py's run_stack:
one model worker, 2 attention workers, TCP, float32 weights) at 1 and 2 micro-batches,
decode tokens/s against the planner's disaggregated layout on `this-machine`. On these
2 cores the model worker takes one and the 2 attention workers share the other, so the
prediction gives the attention pool one device's figures (n = 1). Not covered: 1
attention worker (run_stack always starts 2).

Prints the table and, last, one JSON line: {"cases", "median_abs_rel_error",
"max_abs_rel_error", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_throughput import decode_step_cpu  # noqa: E402
from planner.estimate import decode_step  # noqa: E402
from planner.hardware import THIS_MACHINE, device_from_entry, load_catalogue  # noqa: E402
from planner.layouts import Layout  # noqa: E402
from planner.perf.quantization import FP32  # noqa: E402
from planner.profile import profile  # noqa: E402
from planner.shapes import BUILTIN  # noqa: E402

# Batch x prompt stays within one prefill step of the engine, so the timed steps are pure decode.
CASES = ((1, 32), (1, 512), (4, 128), (4, 512), (8, 64), (8, 256), (16, 128), (32, 64))


def stack_cases(loaded, shape, catalogue, steps: int, batch: int = 32, context: int = 256) -> list[dict]:
    from bench.decode_pipeline import make_prompts, run_stack

    prompts = make_prompts(loaded.tokenizer, batch, context)
    kv_bytes = (batch * (context + steps + 64) * loaded.config.kv_bytes_per_token()) // 2 + (256 << 20)
    rows = []
    for micro in (1, 2):
        measured = run_stack(prompts, steps, "tcp", micro, False, 1, kv_bytes, "float32")["tok_s"]
        layout = Layout(THIS_MACHINE, 1, 1, THIS_MACHINE, 1, micro, "head", FP32, FP32)
        step = decode_step(shape, layout, catalogue, batch, context + steps / 2)
        predicted = batch / step.step_s
        err = (predicted - measured) / measured
        rows.append({"stack_micro_batches": micro, "batch": batch, "prompt": context,
                     "measured_tok_s": round(measured, 1), "predicted_tok_s": round(predicted, 1),
                     "rel_error": round(err, 3), "bottleneck": step.bottleneck})
        print(f"stack, {micro} micro-batch(es), batch {batch}, context {context}: measured {measured:.1f} tok/s, "
              f"predicted {predicted:.1f} tok/s, {err:+.1%}  {step.bottleneck}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps per case (within 10 minutes)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per case (default 12, 5 with --quick)")
    ap.add_argument("--stack", action="store_true", help="also the stack at 1 and 2 micro-batches")
    args = ap.parse_args()
    steps = args.steps or (5 if args.quick else 12)

    import torch

    from model.loader import load_model

    prof = profile(threads=1, usd_per_hour=0.1, quick=args.quick)
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
    print(f"profile: memory {d['memory_tb_s']['value'] * 1e3:.2f} GB/s, matmul {d['tflops']['fp32']['value'] * 1e3:.2f} "
          f"GFLOP/s, attention {d['attention_tb_s']['value'] * 1e3:.2f} GB/s of KV (1 thread); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(json.dumps({"cases": len(rows), "median_abs_rel_error": round(statistics.median(errors), 3),
                      "max_abs_rel_error": round(max(errors), 3), "rows": rows,
                      "load_avg_1min": round(os.getloadavg()[0], 2),
                      "profile": {"memory_gb_s": d["memory_tb_s"]["value"] * 1e3,
                                  "matmul_gflop_s": d["tflops"]["fp32"]["value"] * 1e3}}))


if __name__ == "__main__":
    main()
