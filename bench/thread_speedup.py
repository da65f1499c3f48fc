"""The compute threads' speedup as `lamina profile` measures it, with and without a neighbour.

`lamina up --layout auto` ranks a colocated model worker's thread counts by the speedup
the profile measures (planner/profile.py's measure_thread_speedup: the packed Q4_1
products at batch 1, 4, 16 and 64 and the attention kernel, on one compute thread and
on T). A neighbour on one core during that measurement makes T threads look no faster
than one, and every later `lamina up` on the machine then starts the slower layout.

Compared, alternately, in --tries tries each:
- `three rounds`: the measurement stopped after its first SPEEDUP_ROUNDS rounds (how
  profiles of format 3 measured it);
- `settled`: the measurement as the profile runs it (rounds until the figures settle,
  at most SPEEDUP_MAX_ROUNDS);
each with a busy loop pinned to the last core for its first --busy seconds (a
neighbour that comes and goes) and, as the control, without one (`settled, idle`).

Prints the machine, the workload, each try (rounds, seconds, the products' ratios by
batch size, attention's), per variant each try's lowest product ratio, and the median of
those lowest figures settled against three rounds (both with the busy loop); the last
line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from engine_throughput import cpu_model  # bench/: the CPU's model name, as the other benchmarks print it

from lamina.planner.profile import SPEEDUP_MAX_ROUNDS, SPEEDUP_ROUNDS, measure_thread_speedup

# A process that spins on one core until its deadline.
_BUSY = "import os, sys, time\nos.sched_setaffinity(0, {int(sys.argv[1])})\nend = time.time() + float(sys.argv[2])\n" \
        "while time.time() < end: pass\n"


def measure(busy_s: float, max_rounds: int, threads: int, layers: int, repeats: int) -> dict[str, Any]:
    """One measurement of the speedup on `threads`, a busy loop on the last core for its
    first `busy_s` seconds (none at 0)."""
    core = max(os.sched_getaffinity(0))
    loop = subprocess.Popen([sys.executable, "-c", _BUSY, str(core), str(busy_s)]) if busy_s > 0 else None
    try:
        time.sleep(0.1 if loop else 0)  # the loop is on its core when the first round starts
        start = time.perf_counter()
        figures = measure_thread_speedup((1, threads), layers, repeats, max_rounds=max_rounds)[threads]
        seconds = time.perf_counter() - start
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
    return {"seconds": seconds, "rounds": figures["rounds"], "attention": figures["attention"],
            "linear": {str(b): x for b, x in figures["linear"].items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=4)
    ap.add_argument("--busy", type=float, default=4.5, help="seconds the busy loop runs from each start")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of products (8: lamina profile --quick)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per figure (3: lamina profile --quick)")
    args = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) < args.threads:
        ap.error(f"--threads {args.threads} needs that many cores; this process may use "
                 f"{len(os.sched_getaffinity(0))}")
    variants = {"three rounds": (args.busy, SPEEDUP_ROUNDS), "settled": (args.busy, SPEEDUP_MAX_ROUNDS),
                "settled, idle": (0.0, SPEEDUP_MAX_ROUNDS)}
    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} cores usable")
    print(f"workload: lamina profile's thread speedup (--layers {args.layers}, --repeats {args.repeats}) on "
          f"{args.threads} threads against one; a busy loop on the last core for the first {args.busy} s "
          f"except `settled, idle`; {args.tries} tries, variants alternating")
    tries: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for t in range(args.tries):
        for name, (busy, rounds) in variants.items():
            row = measure(busy, rounds, args.threads, args.layers, args.repeats)
            tries[name].append(row)
            ratios = " ".join(f"{b}:{x:.2f}" for b, x in row["linear"].items())
            print(f"try {t + 1} {name:14s} {row['rounds']:2d} rounds {row['seconds']:5.1f} s  "
                  f"products by batch {ratios}  attention {row['attention']:.2f}", flush=True)
    summary = {name: {"lowest_linear": [min(r["linear"].values()) for r in rows],
                      "rounds": [r["rounds"] for r in rows]} for name, rows in tries.items()}
    for name, s in summary.items():
        lowest = ", ".join(f"{x:.2f}" for x in s["lowest_linear"])
        print(f"{name:14s}: each try's lowest product speedup {lowest}; rounds {s['rounds']}")
    settled, three = (statistics.median(summary[name]["lowest_linear"]) for name in ("settled", "three rounds"))
    print(f"with the busy loop, the median of each try's lowest: settled {settled:.2f}x, three rounds {three:.2f}x "
          f"(ratio {settled / three:.2f})")
    print(json.dumps({"machine": cpu_model(), "threads": args.threads, "busy_s": args.busy, "tries": tries,
                      "summary": summary, "settled_over_three_rounds": settled / three}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
