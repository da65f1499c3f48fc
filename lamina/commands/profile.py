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
    p.add_argument("--out", type=Path, default=None,
                   help=f"profile file (default {DEFAULT_PROFILE}; with --device, profile-DEVICE.json beside it)")
    p.add_argument("--device", default=None,
                   help="measure this torch device instead of the CPU's kernels (cuda, cuda:N): its copies, "
                        "products, the attention worker's kernel, host copies and the engine's decode step there")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                   help="with --device: the dtype measured (default bfloat16)")
    p.add_argument("--model", default="random:llama-3.2-1b",
                   help="with --device: whose layer shapes and engine are measured (default random:llama-3.2-1b)")
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

    if args.device is not None:
        return _run_device(args)
    args.out = args.out or DEFAULT_PROFILE
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


def _run_device(args: argparse.Namespace) -> int:
    """`lamina profile --device D`: the device's profile, in the catalogue's form, for
    `lamina plan --profile FILE` and bench/planner_validation.py --gpu."""
    import torch

    from lamina.planner.hardware import device_from_entry
    from lamina.planner.measure.device_profile import profile_device
    from lamina.services.config import ConfigError
    from lamina.services.devices import open_device

    try:
        device = open_device("--device", args.device)
    except (ConfigError, RuntimeError) as exc:  # RuntimeError: a device name torch does not know
        print(f"lamina profile: {exc}", file=sys.stderr)
        return 2
    out = args.out or DEFAULT_PROFILE.with_name(f"profile-{str(device).replace(':', '')}.json")
    print(f"lamina profile: measuring {device} in {args.dtype} ({args.model}'s shapes)...", file=sys.stderr,
          flush=True)
    result = profile_device(str(device), args.dtype, args.usd_per_hour, args.quick, args.model)
    device_from_entry("this-machine", result["device"])  # refuse to write what plan could not read
    result["torch"] = torch.__version__
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    d, m = result["device"], result["measurements"]
    print(f"wrote {out}: {m['device']}: memory {d['memory_tb_s']['value'] * 1e3:.0f} GB/s, "
          f"matmul {m['matmul_flops'] / 1e12:.1f} TFLOP/s ({args.dtype}), "
          f"attention {d['attention_tb_s']['value'] * 1e3:.0f} GB/s of KV, "
          f"host copies {d['scaleup_gb_s']['value']:.1f} GB/s, "
          f"overhead {d['layer_overhead_us']['value']:.0f} us a layer "
          f"+ {d['token_overhead_us']['value']:.1f} us a token")
    return 0
