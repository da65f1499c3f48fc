"""A stack's start and a service's restart: services forked from the forker
(`fork_services: true`, the default; services/launch/forker.py) against each started in a
fresh interpreter (`fork_services: false`).

Each try starts one stack (`Stack`, the class `lamina up` runs: embedded Redis, two
attention workers, a model worker, a prefill worker, the scheduler and the gateway, the
disaggregated layout over TCP, SmolLM2-135M-Instruct as its file holds it) and times its
start (the call to the gateway's first healthy answer), with the CPU seconds every
process of it spent by then (the launcher's own, read in this process, and each child's
and the forker's from /proc) and their memory (the sum of their proportional set sizes,
PSS: each page shared by N processes counted 1/N in each, so shared pages are counted
once; Redis not included); then kills attention worker 0 and starts it again
(`Stack.restart`, what the supervisor does) and times that restart (the call to the new
process's "serving" log line). The variants alternate, the order reversed every try; the
table gives medians over the tries, and every stack is stopped on the way out (also on
Ctrl-C or SIGTERM).

Prints the machine, the workload, each try, the medians and the ratios (forked / fresh);
the last line is one JSON object.

    python bench/stack_start.py [--tries 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cpu_anchor import raise_on_sigterm  # bench/: SIGTERM unwinds like Ctrl-C
from engine_throughput import cpu_model

from lamina.ports import free_port
from lamina.services.config import AttentionSection, GatewaySection, StackConfig
from lamina.services.launch.launcher import Stack

VARIANTS = {"forked": True, "fresh": False}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def pss_mib(pid: int) -> float:
    """Proportional set size of process `pid` in MiB: its private memory plus its share of
    what it shares (0 if it is gone)."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0.0
    return next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:")) / 1024


def _serving_lines(log: Path) -> int:
    return log.read_text(errors="replace").count(" serving on ") if log.is_file() else 0


def one_try(fork: bool, log_dir: Path) -> dict[str, float]:
    config = StackConfig(layout="disaggregated", fork_services=fork, gateway=GatewaySection(port=free_port()),
                         attention=AttentionSection(workers=2, kv_capacity_bytes=256 << 20))
    stack = Stack(config, log_dir=log_dir)
    cpu0, t0 = time.process_time(), time.perf_counter()
    try:
        stack.start(timeout_s=300)
        start_s = time.perf_counter() - t0
        launcher_cpu = time.process_time() - cpu0
        children = [sp.proc.pid for sp in stack.processes if sp.proc is not None]
        forker = stack.forker_pid
        assert (forker is not None) == fork, f"fork_services {fork} but forker pid {forker}"
        ours = children + ([forker] if forker else [])
        services_cpu = sum(cpu_s(pid) for pid in ours)
        memory = sum(pss_mib(pid) for pid in ours)
        (victim,) = [sp for sp in stack.processes if sp.name == "attention-0"]
        assert victim.proc is not None
        log = log_dir / "attention-0.log"
        before = _serving_lines(log)
        victim.proc.kill()
        victim.proc.wait(timeout=30)
        t1 = time.perf_counter()
        stack.restart("attention-0")
        while _serving_lines(log) == before:
            if time.perf_counter() - t1 > 120:
                raise TimeoutError(f"attention-0 not serving 120 s after its restart; log {log}")
            time.sleep(0.01)
        restart_s = time.perf_counter() - t1
    finally:
        stack.stop()
    return {"start_s": start_s, "cpu_s": launcher_cpu + services_cpu, "launcher_cpu_s": launcher_cpu,
            "pss_mib": memory, "restart_s": restart_s}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=3, help="stacks per variant, alternating; medians reported")
    args = ap.parse_args(argv)
    if args.tries < 1:
        ap.error("--tries must be at least 1")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, {sys.platform}")
    print("workload: one stack start (Redis, 2 attention workers, model, prefill, scheduler, gateway; "
          "SmolLM2-135M-Instruct, disaggregated, tcp) and one restart of attention-0 per try; "
          f"variants {', '.join(VARIANTS)} alternating, {args.tries} tries each")
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="lamina-stack-start-") as tmp:
        for t in range(args.tries):
            order = list(VARIANTS) if t % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                row = one_try(VARIANTS[name], Path(tmp) / f"{name}-{t}")
                rows[name].append(row)
                print(f"  try {t + 1} {name:6s}: start {row['start_s']:.2f} s, CPU {row['cpu_s']:.2f} s "
                      f"(launcher {row['launcher_cpu_s']:.2f} s), memory {row['pss_mib']:.0f} MiB, "
                      f"restart {row['restart_s']:.2f} s", flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    print(f"\n{'variant':8s} {'start s':>8s} {'CPU s':>7s} {'PSS MiB':>8s} {'restart s':>10s}")
    for name, m in med.items():
        print(f"{name:8s} {m['start_s']:8.2f} {m['cpu_s']:7.2f} {m['pss_mib']:8.0f} {m['restart_s']:10.2f}")
    ratio = {k: med["forked"][k] / med["fresh"][k] for k in ("start_s", "cpu_s", "pss_mib", "restart_s")}
    print(f"forked / fresh: start {ratio['start_s']:.2f}x, CPU {ratio['cpu_s']:.2f}x, memory {ratio['pss_mib']:.2f}x, "
          f"restart {ratio['restart_s']:.2f}x")
    report = {"machine": cpu_model(), "cores": os.cpu_count(), "tries": args.tries, "median": med,
              "forked_over_fresh": ratio}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    raise_on_sigterm()
    main()
