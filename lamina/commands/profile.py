"""`lamina profile`: measure this machine for the planner (linear layers, attention, a
large copy, every transport it runs, a small decode through the stack) and write the
profile that `lamina plan` reads as the catalogue's `this-machine` and `lamina up --layout
auto` ranks its layouts on (docs/planner.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lamina.commands.plan import DEFAULT_PROFILE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=DEFAULT_PROFILE, help=f"profile file (default {DEFAULT_PROFILE})")
    # One thread by default: on shared cores, OpenMP workers waiting for a busy core make
    # small matmuls ten times slower, which would measure the neighbours, not the machine.
    p.add_argument("--threads", type=int, default=1, help="torch threads to measure with (default 1)")
    p.add_argument("--usd-per-hour", type=float, default=0.1, help="this machine's price, an assumption (default 0.1)")
    p.add_argument("--quick", action="store_true", help="fewer repeats and layers (seconds instead of a minute)")
    p.add_argument("--no-stack", action="store_true",
                   help="skip the stack run that measures the services' overheads (it starts every service)")


def run(args: argparse.Namespace) -> int:
    from lamina.planner.hardware import device_from_entry
    from lamina.planner.local_layout import machine_fingerprint, suspect
    from lamina.planner.profile import profile

    result = profile(args.threads, args.usd_per_hour, args.quick, stack=not args.no_stack)
    device_from_entry("this-machine", result["device"])  # refuse to write what plan could not read
    # What `lamina up --layout auto` checks before it reuses the profile instead of measuring.
    result["fingerprint"] = machine_fingerprint()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    d = result["device"]
    print(f"wrote {args.out}: memory {d['memory_tb_s']['value'] * 1e3:.1f} GB/s, "
          f"matmul {d['tflops']['fp32']['value'] * 1e3:.1f} GFLOP/s, "
          f"TCP round trip {2 * d['network_latency_us']['value']:.0f} us, "
          f"{2 * d['network_gbit_s']['value']:.2f} Gb/s at 1 MiB")
    why = suspect(result)
    if why is not None:
        print(f"warning: {why}, so these figures may be off; `lamina up --layout auto` measures again at its "
              "next start (run `lamina profile` when the machine is quiet)", file=sys.stderr)
    return 0
