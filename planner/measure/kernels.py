"""The engine's kernels and this machine's memory, timed.

A large tensor copy's bandwidth; SmolLM2-135M's decoder layers with each layer's own
weights packed as the engine holds them (so that a step reads them from memory, not from
cache) and the engine's matmul kernel over them; and the fastest CPU or wall time of a call.
`lamina profile` (planner/profile.py), bench/packed_matmul.py and bench/engine_throughput.py
measure with these.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lamina.model import quant

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (outputs, inputs) of one decoder layer


def fastest_cpu_time(fn: Callable[[], object], repeats: int) -> float:
    """The fastest CPU seconds of this process over `repeats` calls of `fn`, after one
    warm-up: on shared cores wall time counts the neighbours' turns too, and with one
    thread CPU time is the compute. The fastest, not the median: a neighbour's memory
    traffic and cache use inflate a call's time, never deflate it, and on the 2-core VM
    the median of three made two quick profiles a minute apart predict the same decode
    step 9-41% apart, the fastest 2-13%."""
    return _fastest_time(fn, repeats, time.process_time)


def fastest_wall_time(fn: Callable[[], object], repeats: int) -> float:
    """The fastest wall seconds over `repeats` calls of `fn`, after one warm-up: what a call
    on several threads takes (their CPU time adds up)."""
    return _fastest_time(fn, repeats, time.perf_counter)


def fastest_compute_time(fn: Callable[[], object], repeats: int) -> float:
    """The fastest seconds of `fn` as the profile counts a kernel: CPU seconds where it computes
    on one thread (on shared cores wall time also counts the neighbours' turns), wall
    seconds on more (their CPU seconds add up: on two threads a kernel's CPU time was about
    twice its wall time, and a two-thread profile predicted the engine 33-45% slow)."""
    from lamina.model.quant import kernel_threads

    one = kernel_threads() <= 1 and torch.get_num_threads() <= 1
    return (fastest_cpu_time if one else fastest_wall_time)(fn, repeats)


def _fastest_time(fn: Callable[[], object], repeats: int, clock: Callable[[], float]) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = clock()
        fn()
        times.append(clock() - t)
    return min(times)


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Bytes per second moved by a large tensor copy on `device` (each byte read once,
    written once): the fastest of `repeats` copies after a warm-up, each ended by the
    device's synchronisation. The one estimator of the profiles (CPU and GPU) and the
    benchmarks' bandwidth bounds: the fastest copy is the memory's speed undisturbed."""
    device = torch.device(device)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / fastest_on(device, lambda: dst.copy_(src), repeats)


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (a CUDA device's; the CPU's is done on return)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest_on(device: torch.device, fn: Callable[[], object], repeats: int) -> float:
    """fastest_wall_time of `fn` on `device`, each call ended by the device's synchronisation."""
    def synced() -> None:
        fn()
        synchronize(device)

    return fastest_wall_time(synced, repeats)


def make_layers(fmt: str, num_layers: int, gen: torch.Generator) -> list[list[quant.PackedWeight]]:
    """`num_layers` decoder layers of LAYER's matrices in `fmt` (f32, q8_0, q4_0, q4_1), each
    layer its own random weights (so that a step reads them from memory, not from cache)."""
    layers = []
    for _ in range(num_layers):
        ws = [torch.randn(n, k, generator=gen) * 0.05 for n, k in LAYER]
        if fmt == "f32":
            layers.append([quant.pack_float(w) for w in ws])
        elif fmt == "q4_0":  # no float quantizer of ours for q4_0: gguf's
            import gguf

            layers.append([quant.pack_gguf("q4_0", gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0),
                                           *w.shape) for w in ws])
        else:
            layers.append([quant.quantize(w, fmt) for w in ws])
    return layers


def native_run(layers: list[list[quant.PackedWeight]]) -> Callable[[dict[int, torch.Tensor]], list[torch.Tensor]]:
    """The native kernel over every layer's weights: x maps an input width to its [m, K] rows."""
    return lambda x: [quant.packed_matmul(x[pw.k], pw) for layer in layers for pw in layer]
