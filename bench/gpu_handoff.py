"""How long one GPU takes to hand work from one process to another, against the same
handoff inside one process, and whether a handoff with no host in the loop works there.

A disaggregated stack with every service on one GPU hands its work from process to
process twice a layer (the model worker's slice, the attention worker's kernel, the model
worker's next slice); lamina's cuda_ipc transport does it through the hosts: the sender
polls its copies' event, then sends a frame through shared memory, and the receiver
launches its work once the frame arrives. Whether that costs microseconds or a GPU's
time slice between two processes' contexts decides what the split can cost on one GPU.
This measures it, each contender over --iters round trips (a round trip: a kernel of one
side, then one of the other, then back), every kernel a small in-place add on one
shared int64 tensor, whose final value checks that the kernels ran in turn:
- one_process_host: one process, two streams; after each kernel the host polls its
  event (as lamina's until_done does) before it launches the next on the other stream;
- one_process_device: one process, two streams, every round trip queued at once, each
  kernel after a wait on the other stream's last event: the GPU alone orders them;
- two_processes_host: the two sides in two processes sharing the tensor by CUDA IPC; each
  polls its kernel's event, then tells the other through a pipe (what cuda_ipc does);
- two_processes_device: the same two processes with no host in the loop: each queues all
  its round trips at once, each kernel after a wait on the stream until a shared 64-bit
  flag says the other side's kernel is done (cuStreamWaitValue64) and followed by a
  write of the flag (cuStreamWriteValue64): the GPU orders the processes. This is the
  path a host-free cuda_ipc would take; it needs the driver's stream memory operations.
- two_processes_event: the same two processes, each kernel after its stream's wait on the
  other process's interprocess CUDA event, each side telling the other through the pipe
  as soon as its kernel and event record are queued (not done): the hosts pass turns,
  the GPU orders the kernels (what cuda_ipc's device-ordered frames do);
- two_processes_cuda_ipc: the same turns through lamina's own cuda_ipc transport: one
  side adds and sends the tensor, the other receives it (its copy out of the sender's
  ring), adds and sends it back: a layer's handoff as the stack makes it, Python, frames
  and the transport's waits included; two_processes_cuda_ipc_device: the same with
  `cuda_ipc_device_order` on both sides;
- exporter_exit: a child process exports a buffer by CUDA IPC, another maps it and reads
  it, the child is killed, and the mapping is read and written again: whether a receiver
  may still touch a vanished sender's ring (what a host-free receiver would do to release
  its own waits), or the driver faults;
- event_exit: a child records an interprocess event behind some five seconds of GPU work
  and hands it over; this process's stream waits on it, the child is killed before its
  work ends, and this process watches whether its waiting stream ever runs (the child's
  death releasing it, or this process recording the imported event itself on another
  stream), and whether its other streams still run: what a device-ordered cuda_ipc
  receiver's streams do when the sender dies between a frame and its copies.
Each contender runs in processes of its own (a stream stuck in a wait, or a fault, cannot
touch the others' figures), stopped after --timeout seconds. Prints the device, the table
(microseconds per round trip and per handoff, each against one_process_host) and a
last-line JSON: {"device": ..., "iters": N, "us_per_round_trip": {name: us},
"correct": {name: bool}, "errors": {name: text}, "exporter_exit": {...}, "event_exit": {...}}.

    python bench/gpu_handoff.py [--iters 500] [--timeout 60]

Without a CUDA device it stops at once and says so (exit status 2).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import queue
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.multiprocessing as mp

CONTENDERS = ("one_process_host", "one_process_device", "two_processes_host", "two_processes_device",
              "two_processes_event", "two_processes_cuda_ipc", "two_processes_cuda_ipc_device")
WARMUP = 20  # round trips run before the timed ones (kernels loaded, contexts made)


def _poll(event: torch.cuda.Event) -> None:
    """The host waits for the event by polling it, as lamina's until_done does (here with
    no other task to run between the queries: a busy loop)."""
    done = event.query()
    while not done:
        done = event.query()


class _MemOps:
    """The driver's stream memory operations: a stream that waits until a 64-bit word of
    device memory is at least a value, and a stream-ordered write of such a word (after
    a memory barrier: the work before it is visible first)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        # CUDA 11.7+ names the supported forms *_v2 (the header maps the plain names to them).
        self._wait = getattr(lib, "cuStreamWaitValue64_v2", None) or lib.cuStreamWaitValue64
        self._write = getattr(lib, "cuStreamWriteValue64_v2", None) or lib.cuStreamWriteValue64
        for fn in (self._wait, self._write):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
            fn.restype = ctypes.c_int

    def wait_at_least(self, stream: torch.cuda.Stream, word: torch.Tensor, value: int) -> None:
        _checked(self._wait(stream.cuda_stream, word.data_ptr(), value, 0), "cuStreamWaitValue64")  # 0: GEQ

    def write(self, stream: torch.cuda.Stream, word: torch.Tensor, value: int) -> None:
        _checked(self._write(stream.cuda_stream, word.data_ptr(), value, 0), "cuStreamWriteValue64")


def _checked(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} returned CUresult {result}")


# -- one process ---------------------------------------------------------------------------------
def one_process(iters: int, device_ordered: bool) -> tuple[float, bool]:
    """Seconds per round trip and whether the shared value came out right."""
    dev = torch.device("cuda")
    data = torch.zeros(1, dtype=torch.int64, device=dev)
    sides = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]

    def run(n: int) -> float:
        start = time.perf_counter()
        last = torch.cuda.Event()
        last.record(torch.cuda.current_stream(dev))
        for _ in range(n):
            for stream in sides:
                stream.wait_event(last)  # the other side's kernel first (a no-op on the host)
                with torch.cuda.stream(stream):
                    data.add_(1)
                last = torch.cuda.Event()
                last.record(stream)
                if not device_ordered:
                    _poll(last)
        _poll(last)
        return time.perf_counter() - start

    run(WARMUP)
    seconds = run(iters)
    return seconds / iters, int(data.item()) == 2 * (WARMUP + iters)


# -- two processes -------------------------------------------------------------------------------
def _turn_through_host(stream: torch.cuda.Stream, data: torch.Tensor) -> None:
    """One side's turn as cuda_ipc takes it: its kernel, then its host polls the kernel's event."""
    with torch.cuda.stream(stream):
        data.add_(1)
    done = torch.cuda.Event()
    done.record(stream)
    _poll(done)


def _turns_on_device(ops: _MemOps, stream: torch.cuda.Stream, data: torch.Tensor, flag: torch.Tensor,
                     turns: range, side: int) -> None:
    """Queues one side's turns (side 0 takes the flag's even values, side 1 the odd): each
    waits until the flag says the other side's last turn is done, adds, then says so."""
    for i in turns:
        ops.wait_at_least(stream, flag, 2 * i + side)
        with torch.cuda.stream(stream):
            data.add_(1)
        ops.write(stream, flag, 2 * i + side + 1)


def _side_b(conn: Any, tensors: queue.Queue, iters: int, device_ordered: bool) -> None:
    """The second process: each round trip's second kernel, after the first side's."""
    dev = torch.device("cuda")
    data, flag = tensors.get()
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))  # where the shared tensors arrived
    ops = _MemOps() if device_ordered else None
    for n, base in ((WARMUP, 0), (iters, WARMUP)):
        conn.recv_bytes()  # the first side is ready for this run
        if ops is not None:
            _turns_on_device(ops, stream, data, flag, range(base, base + n), side=1)
            done = torch.cuda.Event()
            done.record(stream)
            _poll(done)
            conn.send_bytes(b"done")
            continue
        for _ in range(n):
            conn.recv_bytes()
            _turn_through_host(stream, data)
            conn.send_bytes(b"")
    conn.recv_bytes()  # the first side's end: it has read the shared value


def two_processes(iters: int, device_ordered: bool) -> tuple[float, bool]:
    """Seconds per round trip and whether the shared value came out right (this process
    is the first side: it exports the tensors to a spawned second side)."""
    dev = torch.device("cuda")
    ctx = mp.get_context("spawn")
    data = torch.zeros(1, dtype=torch.int64, device=dev)
    flag = torch.zeros(1, dtype=torch.int64, device=dev)
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))  # the zeros first
    ops = _MemOps() if device_ordered else None
    tensors = ctx.Queue()
    here, there = ctx.Pipe()
    with _second_side(_side_b, there, tensors, iters, device_ordered) as child:
        tensors.put((data, flag))
        seconds = 0.0
        for n, base in ((WARMUP, 0), (iters, WARMUP)):
            start = time.perf_counter()
            here.send_bytes(b"go")
            if ops is not None:
                _turns_on_device(ops, stream, data, flag, range(base, base + n), side=0)
                ops.wait_at_least(stream, flag, 2 * (base + n))  # the other side's last turn
                done = torch.cuda.Event()
                done.record(stream)
                _poll(done)
                here.recv_bytes()
            else:
                for _ in range(n):
                    _turn_through_host(stream, data)
                    here.send_bytes(b"")
                    here.recv_bytes()
            seconds = time.perf_counter() - start
        value = _ended(here, child, data)
    return seconds / iters, value == 2 * (WARMUP + iters)


@contextlib.contextmanager
def _second_side(target: Callable[..., None], *args: Any) -> Iterator[Any]:
    """A child process of this contender's (spawned: a forked child could not use CUDA),
    killed at the end if still there."""
    child = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    child.start()
    try:
        yield child
    finally:
        if child.is_alive():
            child.kill()


def _ended(here: Any, child: Any, data: torch.Tensor) -> int:
    """The shared value, read once both sides are done; then the second side may end."""
    value = int(data.item())
    here.send_bytes(b"end")
    child.join(10)
    return value


def _event_side_b(conn: Any, shared: queue.Queue, handles: queue.Queue, iters: int) -> None:
    """The second process of two_processes_event: each turn after the first side's event."""
    dev = torch.device("cuda")
    data = shared.get()
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))  # where the shared tensor arrived
    mine = torch.cuda.Event(interprocess=True)
    handles.put(bytes(mine.ipc_handle()))
    theirs = torch.cuda.Event.from_ipc_handle(dev, conn.recv_bytes())
    for n in (WARMUP, iters):
        for _ in range(n):
            conn.recv_bytes()  # the first side's kernel and record are queued
            _turn_after(stream, theirs, mine, data)
            conn.send_bytes(b"")
    conn.recv_bytes()  # the first side's end: it has read the shared value


def _turn_after(stream: torch.cuda.Stream, theirs: torch.cuda.Event, mine: torch.cuda.Event,
                data: torch.Tensor) -> None:
    """One side's turn ordered on the device: its stream waits for the other side's last
    record, adds, and records its own event (nothing here waits for the GPU)."""
    stream.wait_event(theirs)
    with torch.cuda.stream(stream):
        data.add_(1)
    mine.record(stream)


def two_processes_event(iters: int) -> tuple[float, bool]:
    """Seconds per round trip with the turns passed through the pipe at once and ordered
    by interprocess events on the GPU, and whether the shared value came out right. An
    event is recorded again only after the other side said it queued its wait on it."""
    dev = torch.device("cuda")
    ctx = mp.get_context("spawn")
    data = torch.zeros(1, dtype=torch.int64, device=dev)
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))  # the zeros first
    mine = torch.cuda.Event(interprocess=True)
    shared, handles = ctx.Queue(), ctx.Queue()
    here, there = ctx.Pipe()
    with _second_side(_event_side_b, there, shared, handles, iters) as child:
        shared.put(data)
        theirs = torch.cuda.Event.from_ipc_handle(dev, handles.get(timeout=60))
        here.send_bytes(bytes(mine.ipc_handle()))
        seconds = 0.0
        for n in (WARMUP, iters):
            start = time.perf_counter()
            for _ in range(n):
                # After the second side's last record (before its first, a wait on a
                # never-recorded event: none).
                _turn_after(stream, theirs, mine, data)
                here.send_bytes(b"")
                here.recv_bytes()
            stream.wait_event(theirs)
            done = torch.cuda.Event()
            done.record(stream)
            _poll(done)
            seconds = time.perf_counter() - start
        value = _ended(here, child, data)
    return seconds / iters, value == 2 * (WARMUP + iters)


# -- through the cuda_ipc transport --------------------------------------------------------------
def _adding_echo(address: str, ready: queue.Queue, device_order: bool) -> None:
    """The second side over cuda_ipc: each tensor received is added to and sent back."""
    import asyncio

    from lamina import transports
    from lamina.aio import install_uvloop
    from lamina.planner.measure.pingpong import transport_config

    async def main() -> None:
        done = asyncio.Event()

        async def echo(conn: transports.Connection) -> None:
            try:
                while True:
                    t = (await conn.recv()).tensors[0]
                    assert isinstance(t, torch.Tensor)
                    t.add_(1)  # on the current stream, which recv made wait for the copy out
                    await conn.send(transports.Frame(1, {}, [t]))
            except transports.PeerClosed:
                done.set()

        listener = await transports.listen(address, echo,
                                           transport_config().replace(cuda_ipc_device_order=device_order))
        ready.put(listener.address)
        await done.wait()
        await listener.close()

    torch.cuda.init()
    install_uvloop()
    asyncio.run(main())


def cuda_ipc_round_trips(iters: int, device_order: bool) -> tuple[float, bool]:
    """Seconds per round trip through lamina's cuda_ipc transport (both ends host- or
    device-ordered), and whether the value came out right."""
    import asyncio

    from lamina import transports
    from lamina.aio import install_uvloop
    from lamina.planner.measure.pingpong import transport_config

    ready = mp.get_context("spawn").Queue()

    async def main() -> tuple[float, int]:
        conn = await transports.connect(ready.get(timeout=60),
                                        transport_config().replace(cuda_ipc_device_order=device_order))
        data = torch.zeros(1, dtype=torch.int64, device="cuda")
        seconds = 0.0
        for n in (WARMUP, iters):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(n):
                data.add_(1)
                await conn.send(transports.Frame(1, {}, [data]))
                got = (await conn.recv()).tensors[0]
                assert isinstance(got, torch.Tensor)
                data = got
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        value = int(data.item())
        await conn.close()
        return seconds, value

    with _second_side(_adding_echo, f"cuda_ipc://handoff-{os.getpid()}", ready, device_order) as child:
        install_uvloop()
        seconds, value = asyncio.run(main())
        child.join(10)
    return seconds / iters, value == 2 * (WARMUP + iters)


# -- a vanished exporter -------------------------------------------------------------------------
def _exporter(tensors: queue.Queue) -> None:
    tensors.put(torch.full((1 << 20,), 7, dtype=torch.int64, device="cuda"))
    _until_orphaned()  # killed by the other side


def exporter_exit() -> dict[str, Any]:
    """Map a child's buffer, read it, kill the child, then read and write the mapping."""
    tensors = mp.get_context("spawn").Queue()
    out: dict[str, Any] = {}
    with _second_side(_exporter, tensors) as child:
        mapped = tensors.get(timeout=60)
        out["read_before"] = int(mapped[0].item())
        child.kill()
        child.join(10)
        time.sleep(0.5)
        for what, act in (("read_after", lambda: int(mapped.sum().item()) // mapped.numel()),
                          ("write_after", lambda: (mapped.fill_(3), torch.cuda.synchronize(), "ok")[-1])):
            try:
                out[what] = act()
            except Exception as exc:  # noqa: BLE001 (the driver's answer is the result)
                out[what] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def _event_recorder(handles: queue.Queue, cycles: int) -> None:
    event = torch.cuda.Event(interprocess=True)
    torch.cuda._sleep(cycles)  # the GPU busy: the record below waits behind it
    event.record()
    handles.put(bytes(event.ipc_handle()))
    _until_orphaned()  # killed by the other side


def _until_orphaned() -> None:
    """Sleeps until this process's parent is gone (a probe killed at its timeout takes
    no daemon child with it: this one then ends too)."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)


def _watch(event: torch.cuda.Event, seconds: float, since: float | None = None) -> float | None:
    """Seconds from `since` (default now) until the event is done, None if it is not
    within `seconds` from now."""
    start = time.perf_counter()
    since = start if since is None else since
    while time.perf_counter() - start < seconds:
        if event.query():
            return time.perf_counter() - since
        time.sleep(0.001)
    return None


def event_exit(work_s: float = 5.0, kill_after_s: float = 0.3, watch_s: float = 8.0) -> dict[str, Any]:
    """A stream waiting on a killed child's interprocess event, recorded behind `work_s`
    of the child's GPU work, killed `kill_after_s` after the record was queued: does the
    wait end by itself, or once this process records the imported event, and do this
    process's other streams run meanwhile? A stuck stream is left behind (this runs in a
    process of its own)."""
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)  # this process's context made first, not while the child's work runs
    torch.cuda.synchronize(dev)
    rate_khz = getattr(torch.cuda.get_device_properties(dev), "clock_rate", 0) or 1_800_000
    handles = mp.get_context("spawn").Queue()
    out: dict[str, Any] = {"work_s": work_s, "kill_after_s": kill_after_s}
    with _second_side(_event_recorder, handles, int(work_s * rate_khz * 1000)) as child:
        theirs = torch.cuda.Event.from_ipc_handle(dev, handles.get(timeout=60))
        waiting = torch.cuda.Stream(dev)
        waiting.wait_event(theirs)
        after = torch.cuda.Event()
        after.record(waiting)  # done once the wait ended
        out["pending_before_kill"] = not after.query()
        time.sleep(kill_after_s)
        killed = time.perf_counter()
        child.kill()
        child.join(10)
        out["released_after_kill_s"] = _watch(after, watch_s, since=killed)
        other = torch.cuda.Stream(dev)
        with torch.cuda.stream(other):
            probe = torch.ones(1, device=dev) + 1
        ran = torch.cuda.Event()
        ran.record(other)
        out["other_stream_runs"] = _watch(ran, 5.0) is not None and float(probe.item()) == 2.0
        if out["released_after_kill_s"] is None:
            try:
                theirs.record(other)  # the importer records the event itself
                out["released_by_own_record_s"] = _watch(after, 5.0)
            except Exception as exc:  # noqa: BLE001 (the driver's answer is the result)
                out["released_by_own_record_s"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


# -- each contender in processes of its own ------------------------------------------------------
RUNS: dict[str, Callable[[int], tuple[float, bool]]] = {
    "one_process_host": lambda n: one_process(n, device_ordered=False),
    "one_process_device": lambda n: one_process(n, device_ordered=True),
    "two_processes_host": lambda n: two_processes(n, device_ordered=False),
    "two_processes_device": lambda n: two_processes(n, device_ordered=True),
    "two_processes_event": two_processes_event,
    "two_processes_cuda_ipc": lambda n: cuda_ipc_round_trips(n, device_order=False),
    "two_processes_cuda_ipc_device": lambda n: cuda_ipc_round_trips(n, device_order=True),
}
PROBE_RUNS: dict[str, Callable[[], dict[str, Any]]] = {"exporter_exit": exporter_exit, "event_exit": event_exit}
PROBES = tuple(PROBE_RUNS)

def _run(name: str, iters: int, results: queue.Queue) -> None:
    try:
        if name in PROBE_RUNS:
            results.put(("ok", PROBE_RUNS[name]()))
            return
        seconds, correct = RUNS[name](iters)
        results.put(("ok", {"us": 1e6 * seconds, "correct": correct}))
    except Exception as exc:  # noqa: BLE001 (reported as the contender's result)
        results.put(("error", f"{type(exc).__name__}: {exc}"[:500]))


def isolated(name: str, iters: int, timeout_s: float) -> tuple[str, Any]:
    """A contender's result, from a process of its own (and its child), stopped after
    timeout_s: a stream stuck in a wait never holds up this one."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_run, args=(name, iters, results))
    proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                return results.get(timeout=0.5)
            except queue.Empty:
                if not proc.is_alive():  # ended without a result: one more look, then its exit status
                    try:
                        return results.get(timeout=1.0)
                    except queue.Empty:
                        return "error", f"its process ended with status {proc.exitcode} and no result"
        return "error", f"no result within {timeout_s:g} s (a wait that never ended?)"
    finally:
        proc.join(5)
        if proc.is_alive():
            # Its children are daemons: they end with it.
            proc.kill()
            proc.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=500, help="timed round trips per contender")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a contender may take")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"gpu_handoff needs a CUDA device; torch {torch.__version__} finds none here", file=sys.stderr)
        sys.exit(2)
    device = torch.cuda.get_device_name(0)
    print(f"device: {device}; torch {torch.__version__}, CUDA {torch.version.cuda}; {platform.node()}, "
          f"{os.cpu_count()} cores")
    print(f"workload: {args.iters} round trips (after {WARMUP}) of two in-place adds on one int64, "
          "alternating between the two sides")
    us: dict[str, float] = {}
    correct: dict[str, bool] = {}
    errors: dict[str, str] = {}
    for name in CONTENDERS:
        status, got = isolated(name, args.iters, args.timeout)
        if status == "ok":
            us[name], correct[name] = got["us"], got["correct"]
        else:
            errors[name] = got
    probes = {name: isolated(name, args.iters, args.timeout) for name in PROBES}
    base = us.get("one_process_host")
    print(f"{'contender':<30} {'us/round trip':>14} {'us/handoff':>11} {'vs one_process_host':>20}  value right")
    for name in CONTENDERS:
        if name in errors:
            print(f"{name:<30} failed: {errors[name]}")
            continue
        ratio = f"{us[name] / base:.2f}x" if base else "-"
        print(f"{name:<30} {us[name]:>14.1f} {us[name] / 2:>11.1f} {ratio:>20}  {correct[name]}")
    for name, (status, got) in probes.items():
        print(f"{name}: {got if status == 'ok' else 'failed: ' + str(got)}")
    print(json.dumps({"device": device, "iters": args.iters, "us_per_round_trip": us, "correct": correct,
                      "errors": errors} | {name: got if status == "ok" else {"error": got}
                                           for name, (status, got) in probes.items()}))


if __name__ == "__main__":
    main()
