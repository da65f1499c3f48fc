"""Round-trip time and bandwidth of every available transport between two processes.

Compared in the same run with three references: a raw blocking-socket ping-pong
(``raw_socket``), torch.distributed Gloo send/recv (``gloo``) and a plain memory copy
(``memcpy``, bandwidth of one copy of the payload).

Method (lamina.planner.measure.pingpong, which `lamina profile` measures with): the client
sends a payload of S bytes, the server echoes it, both sides receive into preallocated
buffers, taken from the heap in every process (glibc's mmap threshold fixed above the
largest size: see its heap_buffers). ``rtt_us`` is the median round trip; ``gbps`` is
2 * S * 8 / median round trip (bytes moved both ways), in Gbit/s. The whole set
(transports and references) is measured ``--repeat`` times in turn, so that a noisy
phase of a shared machine hits every contender alike, and the median of the runs' medians
is reported with the spread (min and max over the runs). Our transports run with their
default configuration (busy polling derived from the host: on while the two processes
fit its cores). The targets are checked in every run and on the medians, each printed
as MET or MISS. The last line printed is one JSON object:
{"transports": {name: {"rtt_us": {size: x}, "gbps": {size: y},
                       "rtt_us_spread": {size: [min, max]}, "gbps_spread": {...}}},
 "targets_per_run": [{"held": [...], "missed": [...]}, ...]}.

    python bench/transport_pingpong.py [--transports tcp,shm,ucx,rdma,fhbn] [--quick] [--repeat 3]

Transports this machine cannot run are skipped with the reason (rdma and fhbn here).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import sys
from typing import TYPE_CHECKING

# Our transports' ping-pong is `lamina profile`'s (lamina.planner.measure.pingpong); the
# references below are timed with its rounds and buffers.
from lamina.planner.measure.pingpong import (
    figures,
    heap_buffers,
    iterations,
    measure,
    one_thread,
    pingpong,
    transport_config,
    warmup_rounds,
)
from lamina.ports import free_port

if TYPE_CHECKING:  # torch is imported after heap_buffers(), in every process
    import torch

SIZES = [8, 64, 1024, 16384, 262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _combine(runs: list[dict]) -> dict:
    """Median over repeated runs of each figure, and the spread: ``<figure>_spread``
    holds [min, max] over the runs."""
    out: dict = {}
    for key in ("rtt_us", "gbps"):
        sizes = runs[0][key].keys()
        out[key] = {s: round(statistics.median(r[key][s] for r in runs), 3) for s in sizes}
        out[key + "_spread"] = {s: [min(r[key][s] for r in runs), max(r[key][s] for r in runs)]
                                for s in sizes}
    return out


# ---------------------------------------------------------------- raw blocking socket
def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        n = sock.recv_into(view[pos:])
        if n == 0:
            raise ConnectionError("closed")
        pos += n


def _serve_raw(ready: mp.Queue) -> None:
    heap_buffers()
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    ready.put(lsock.getsockname()[1])
    while True:
        sock, _ = lsock.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = bytearray(8)
        _recv_exact(sock, memoryview(head))
        (size,) = struct.unpack("<Q", head)
        if size == 0:
            return
        buf = memoryview(bytearray(size))
        try:
            while True:
                _recv_exact(sock, buf)
                sock.sendall(buf)
        except ConnectionError:
            sock.close()


def _raw_socket_rtt(port: int, size: int, quick: bool) -> float:
    """Median round trip of `size` bytes over a fresh connection to the echo server."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(struct.pack("<Q", size))
    payload = memoryview(os.urandom(size))
    buf = memoryview(bytearray(size))

    def one_round() -> None:
        sock.sendall(payload)
        _recv_exact(sock, buf)

    rtt = measure(one_round, size, quick)
    sock.close()
    return rtt


def bench_raw_socket(sizes: list[int], quick: bool) -> dict:
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    server = ctx.Process(target=_serve_raw, args=(ready,), daemon=True)
    server.start()
    port = ready.get(timeout=60)
    rtts = {size: _raw_socket_rtt(port, size, quick) for size in sizes}
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(struct.pack("<Q", 0))
    sock.close()
    server.join(30)
    return figures(rtts)


# ---------------------------------------------------------------- gloo
def _gloo_rank(rank: int, port: int, sizes: list[int], quick: bool, results) -> None:
    heap_buffers()
    import torch
    one_thread()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rtts = {}
    for size in sizes:
        buf = torch.randint(0, 255, (size,), dtype=torch.uint8)
        if rank == 0:
            rtts[size] = _gloo_rtt(buf, size, quick)
        else:
            for _ in range(warmup_rounds(size) + iterations(size, quick)):
                dist.recv(buf, 0)
                dist.send(buf, 0)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put(rtts)


def _gloo_rtt(buf: torch.Tensor, size: int, quick: bool) -> float:
    """Rank 0's median round trip of `buf` to rank 1 and back."""
    import torch.distributed as dist

    def one_round() -> None:
        dist.send(buf, 1)
        dist.recv(buf, 1)

    return measure(one_round, size, quick)


def bench_gloo(sizes: list[int], quick: bool) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, sizes, quick, results), daemon=True)
             for r in (0, 1)]
    for p in procs:
        p.start()
    rtts = results.get(timeout=600)
    for p in procs:
        p.join(30)
    return figures(rtts)


# ---------------------------------------------------------------- memcpy
def bench_memcpy(sizes: list[int], quick: bool) -> dict:
    import torch
    torch.set_num_threads(1)  # one copy on one core, like one side of a transport
    out: dict[str, dict[str, float]] = {"rtt_us": {}, "gbps": {}}
    for size in sizes:
        t = _copy_seconds(size, quick)
        out["gbps"][str(size)] = round(size * 8 / t / 1e9, 3)
    return out


def _copy_seconds(size: int, quick: bool) -> float:
    """Median seconds of one copy of `size` bytes between two tensors."""
    import torch
    src = torch.randint(0, 255, (size,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return measure(lambda: dst.copy_(src), size, quick)


# ---------------------------------------------------------------- report
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def _load() -> str:
    """The 1, 5 and 15 minute load averages (other work on a shared machine shows here)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _fmt_size(s: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if s >= div:
            return f"{s // div} {unit}"
    return f"{s} B"


def _num(v: float) -> str:
    return f"{v:.0f}" if v >= 1000 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _cell(results: dict, name: str, key: str, size: int) -> str:
    """``median [min-max]`` over the runs, or ``-``."""
    med = results[name][key].get(str(size))
    if med is None:
        return "-"
    spread = results[name].get(key + "_spread", {}).get(str(size))
    if spread is None or spread[0] == spread[1]:
        return _num(med)
    return f"{_num(med)} [{_num(spread[0])}-{_num(spread[1])}]"


def print_table(results: dict, sizes: list[int], repeat: int) -> None:
    for key, title in (("rtt_us", "round trip, microseconds"),
                       ("gbps", "bandwidth, Gbit/s (2 x size x 8 / round trip; memcpy: size x 8 / copy time)")):
        cols = [n for n in results if results[n][key]]
        cells = [[_cell(results, n, key, s) for n in cols] for s in sizes]
        width = max([len(n) for n in cols] + [len(c) for row in cells for c in row]) + 1
        print(f"\n{title}: median [min-max] of {repeat} runs")
        print(f"{'size':>8} " + " ".join(f"{n:>{width}}" for n in cols))
        for s, row in zip(sizes, cells):
            print(f"{_fmt_size(s):>8} " + " ".join(f"{c:>{width}}" for c in row))


def check_targets(results: dict) -> list[tuple[bool, str]]:
    """The targets that ``results`` (one run's, or the medians) can be checked against:
    (held, description) each."""
    checks = []
    def rtt(n, s="8"):
        return results.get(n, {}).get("rtt_us", {}).get(s)
    def bw(n, s=str(16 << 20)):
        return results.get(n, {}).get("gbps", {}).get(s)
    for name in ("tcp", "ucx", "shm", "rdma", "fhbn"):
        if rtt(name) is not None and rtt("gloo") is not None:
            checks.append((rtt(name) < rtt("gloo"),
                           f"{name} 8 B rtt {rtt(name):.1f} us < gloo {rtt('gloo'):.1f} us"))
    if rtt("tcp") is not None and rtt("raw_socket") is not None:
        r = rtt("tcp") / rtt("raw_socket")
        checks.append((r <= 1.5, f"tcp 8 B rtt {r:.2f}x raw socket ({rtt('tcp'):.1f} against "
                                 f"{rtt('raw_socket'):.1f} us; target <= 1.5x)"))
    if bw("tcp") is not None and bw("raw_socket") is not None:
        r = bw("tcp") / bw("raw_socket")
        checks.append((r >= 0.7, f"tcp 16 MiB bandwidth {r:.0%} of raw socket (target >= 70%)"))
    if bw("shm") is not None and bw("memcpy") is not None:
        r = bw("shm") / bw("memcpy")
        checks.append((r >= 0.5, f"shm 16 MiB bandwidth {r:.0%} of memcpy (target >= 50%)"))
    return checks


def _print_checks(title: str, checks: list[tuple[bool, str]]) -> None:
    print(f"{title}: {sum(ok for ok, _ in checks)} of {len(checks)} targets held")
    for ok, text in checks:
        print(f"  {'MET ' if ok else 'MISS'} {text}")


def report_targets(runs: dict[str, list[dict]], results: dict) -> list[dict]:
    """Print the targets checked in every run and on the medians; return them per run."""
    per_run = []
    for i in range(max(len(r) for r in runs.values())):
        checks = check_targets({n: r[i] for n, r in runs.items() if i < len(r)})
        _print_checks(f"run {i + 1}", checks)
        per_run.append({"held": [t for ok, t in checks if ok], "missed": [t for ok, t in checks if not ok]})
    _print_checks("medians of the runs", check_targets(results))
    print(f"every target held in {sum(not r['missed'] for r in per_run)} of {len(per_run)} runs")
    return per_run


def main() -> None:
    from lamina import transports
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transports", default="tcp,tcp+py,ucx,shm,rdma,fhbn",
                        help="comma-separated transports to measure (unavailable ones are "
                             "skipped); <scheme>+py: that transport with the Python frame codec")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--quick", action="store_true", help="fewer round trips per size")
    parser.add_argument("--repeat", type=int, default=3, help="runs of the whole set, in turn")
    parser.add_argument("--no-references", action="store_true")
    args = parser.parse_args()
    heap_buffers()
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: dict[str, list[dict]] = {}
    cfg = transport_config()
    derived = (f" (derived: {cfg.busy_processes} busy processes, "
               f"{len(os.sched_getaffinity(0))} cores)" if cfg.busy_poll_us is None else "")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus ({_cpu_model()}), "
          f"python {sys.version.split()[0]}; load average {_load()}", flush=True)
    print(f"workload: echo ping-pong between two processes, sizes {sizes}, "
          f"{args.repeat} runs in turn; busy_poll_us={cfg.busy_poll_budget_us}{derived}, "
          f"ucx_progress_mode={cfg.ucx_progress_mode}", flush=True)
    from lamina.transports.frame import NATIVE
    print(f"frame codec: {'native (transports/_wire)' if NATIVE else 'Python (native codec not built)'}"
          "; <scheme>+py rows use the Python codec", flush=True)
    schemes = []
    for scheme in args.transports.split(","):
        reason = transports.availability(scheme.partition("+")[0])
        if reason is None and scheme.endswith("+py") and NATIVE is None:
            reason = "the native codec is not built: the plain row already uses the Python codec"
        if reason is not None:
            print(f"skipping {scheme}: {reason}", flush=True)
        else:
            schemes.append(scheme)
    for run in range(args.repeat):
        for scheme in schemes:
            print(f"run {run + 1}/{args.repeat}: {scheme} ...", flush=True)
            runs.setdefault(scheme, []).append(pingpong(scheme, sizes, args.quick))
        if not args.no_references:
            for name, fn in (("raw_socket", bench_raw_socket), ("gloo", bench_gloo), ("memcpy", bench_memcpy)):
                print(f"run {run + 1}/{args.repeat}: {name} ...", flush=True)
                runs.setdefault(name, []).append(fn(sizes, args.quick))
    results = {name: _combine(r) for name, r in runs.items()}
    print_table(results, sizes, args.repeat)
    print()
    per_run = report_targets(runs, results)
    print(f"load average at the end: {_load()}")
    print(json.dumps({"transports": results, "targets_per_run": per_run}))


if __name__ == "__main__":
    main()
