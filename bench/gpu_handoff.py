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
- two_processes_cuda_ipc: the same turns through lamina's own cuda_ipc transport: one
  side adds and sends the tensor, the other receives it (its copy out of the sender's
  ring), adds and sends it back: a layer's handoff as the stack makes it, Python, frames
  and the transport's waits included;
- exporter_exit: a child process exports a buffer by CUDA IPC, another maps it and reads
  it, the child is killed, and the mapping is read and written again: whether a receiver
  may still touch a vanished sender's ring (what a host-free receiver would do to release
  its own waits), or the driver faults.
Each contender runs in processes of its own (a stream stuck in a wait, or a fault, cannot
touch the others' figures), stopped after --timeout seconds. Prints the device, the table
(microseconds per round trip and per handoff, each against one_process_host) and a
last-line JSON: {"device": ..., "iters": N, "us_per_round_trip": {name: us},
"correct": {name: bool}, "errors": {name: text}, "exporter_exit": {...}}.

    python bench/gpu_handoff.py [--iters 500] [--timeout 60]

Without a CUDA device it stops at once and says so (exit status 2).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import queue
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

CONTENDERS = ("one_process_host", "one_process_device", "two_processes_host", "two_processes_device",
              "two_processes_cuda_ipc")
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
    ops = _MemOps() if device_ordered else None
    tensors = ctx.Queue()
    here, there = ctx.Pipe()
    child = ctx.Process(target=_side_b, args=(there, tensors, iters, device_ordered), daemon=True)
    child.start()
    try:
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
        value = int(data.item())
        here.send_bytes(b"end")
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
    return seconds / iters, value == 2 * (WARMUP + iters)


# -- through the cuda_ipc transport --------------------------------------------------------------
def _adding_echo(address: str, ready: queue.Queue) -> None:
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

        listener = await transports.listen(address, echo, transport_config())
        ready.put(listener.address)
        await done.wait()
        await listener.close()

    torch.cuda.init()
    install_uvloop()
    asyncio.run(main())


def cuda_ipc_round_trips(iters: int) -> tuple[float, bool]:
    """Seconds per round trip through lamina's cuda_ipc transport, and whether the value
    came out right."""
    import asyncio

    from lamina import transports
    from lamina.aio import install_uvloop
    from lamina.planner.measure.pingpong import transport_config

    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    child = ctx.Process(target=_adding_echo, args=(f"cuda_ipc://handoff-{os.getpid()}", ready), daemon=True)
    child.start()

    async def main() -> tuple[float, int]:
        conn = await transports.connect(ready.get(timeout=60), transport_config())
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

    try:
        install_uvloop()
        seconds, value = asyncio.run(main())
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
    return seconds / iters, value == 2 * (WARMUP + iters)


# -- a vanished exporter -------------------------------------------------------------------------
def _exporter(tensors: queue.Queue) -> None:
    tensors.put(torch.full((1 << 20,), 7, dtype=torch.int64, device="cuda"))
    time.sleep(3600)  # killed by the other side


def exporter_exit() -> dict[str, Any]:
    """Map a child's buffer, read it, kill the child, then read and write the mapping."""
    ctx = mp.get_context("spawn")
    tensors = ctx.Queue()
    child = ctx.Process(target=_exporter, args=(tensors,), daemon=True)
    child.start()
    out: dict[str, Any] = {}
    try:
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
    finally:
        if child.is_alive():
            child.kill()
    return out


# -- each contender in processes of its own ------------------------------------------------------
RUNS: dict[str, Callable[[int], tuple[float, bool]]] = {
    "one_process_host": lambda n: one_process(n, device_ordered=False),
    "one_process_device": lambda n: one_process(n, device_ordered=True),
    "two_processes_host": lambda n: two_processes(n, device_ordered=False),
    "two_processes_device": lambda n: two_processes(n, device_ordered=True),
    "two_processes_cuda_ipc": cuda_ipc_round_trips,
}
def _run(name: str, iters: int, results: queue.Queue) -> None:
    try:
        if name == "exporter_exit":
            results.put(("ok", exporter_exit()))
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
    status, exporter = isolated("exporter_exit", args.iters, args.timeout)
    base = us.get("one_process_host")
    print(f"{'contender':<22} {'us/round trip':>14} {'us/handoff':>11} {'vs one_process_host':>20}  value right")
    for name in CONTENDERS:
        if name in errors:
            print(f"{name:<22} failed: {errors[name]}")
            continue
        ratio = f"{us[name] / base:.2f}x" if base else "-"
        print(f"{name:<22} {us[name]:>14.1f} {us[name] / 2:>11.1f} {ratio:>20}  {correct[name]}")
    print(f"exporter_exit: {exporter if status == 'ok' else 'failed: ' + str(exporter)}")
    print(json.dumps({"device": device, "iters": args.iters, "us_per_round_trip": us, "correct": correct,
                      "errors": errors, "exporter_exit": exporter if status == "ok" else {"error": exporter}}))


if __name__ == "__main__":
    main()
