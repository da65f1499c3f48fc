"""A torch device measured for the planner, in the catalogue entry's form: what `lamina
profile --device D` runs (a GPU; on the CPU it measures torch's own operators, which is
how the tests check it).

Measured on the device, in the dtype the services compute in there: a large copy
(device memory's bandwidth); the largest matrix product's rate; the decode products
(torch's linear over a model's layer shapes, each layer its own weights, so they are
read from memory as in a decode step) per weight at several batch sizes; the attention
worker's decode attention (its core on the device: the paged Triton kernel on a GPU) in
KV bytes per second over (batch, context) cases; copies between pinned host memory and
the device; every transport's ping-pong (planner/profile.py's, cuda_ipc's with CPU
tensors between processes, and on a GPU its round trip of CUDA tensors in one process);
and the engine's decode
step on the device at two batch sizes, whose gap to the models' prediction from those
figures is the overhead of everything else in a layer (a per-layer and a per-token
term: kernel launches, Python), as on the CPU. Every time is the fastest of its repeats,
each ended by a device synchronisation.

The entry has no `cores`: the planner treats it as an accelerator, not a CPU node.
"""

from __future__ import annotations

import datetime as dt
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lamina.planner.measure.kernels import copy_bandwidth, fastest_on
from lamina.planner.profile import OVERHEAD_POINTS

# Decode batches the products are measured at, and the attention cases (batch, context).
BATCHES = (1, 4, 16, 64, 256)
ATTENTION_CASES = ((1, 2048), (16, 1024), (64, 2048))


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / fastest_on(device, lambda: a @ b, repeats)


def linear_s_per_param(device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int]], layers: int,
                       batches: tuple[int, ...], repeats: int) -> dict[int, float]:
    """Seconds per weight of torch's linear over `layers` layers of `shapes` ((outputs,
    inputs) each), every layer its own weights, by batch size."""
    weights = [[torch.randn(o, i, device=device).to(dtype) * 0.02 for o, i in shapes] for _ in range(layers)]
    params = layers * sum(o * i for o, i in shapes)
    out: dict[int, float] = {}
    for batch in batches:
        xs = {i: torch.randn(batch, i, device=device).to(dtype) for _, i in shapes}
        out[batch] = fastest_on(device, _products(weights, xs), repeats) / params
    return out


def _products(weights: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for layer in weights:
            for w in layer:
                torch.nn.functional.linear(xs[w.shape[1]], w)

    return run


def attention_bytes_s(cfg: Any, device: torch.device, dtype: torch.dtype, cases: tuple[tuple[int, int], ...],
                      repeats: int) -> dict[str, tuple[float, float]]:
    """The KV bytes and the seconds of one layer of the attention worker's decode
    attention (its core on the device) per (batch, context) case."""
    from lamina.services.attention.attention_core import AttentionCore
    from lamina.services.wire import StoreKV

    hkv, hq, d = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    elem = torch.empty((), dtype=dtype).element_size()
    out: dict[str, tuple[float, float]] = {}
    for batch, context in cases:
        need = batch * (context + repeats + 70) * 2 * hkv * d * elem * cfg.num_layers
        # As the attention service makes it: on a GPU its decode frames replay CUDA graphs.
        core = AttentionCore(cfg, need + (64 << 20), hkv, device=device, dtype=dtype, cuda_graphs=True)
        kv = torch.randn(context, hkv, d).to(dtype)
        ids = [f"s{i}" for i in range(batch)]
        for s in ids:
            for layer in range(cfg.num_layers):
                core.store(StoreKV(s, layer, cfg.num_layers, kv, kv))
        seqs = [(s, 1) for s in ids]
        q = torch.randn(batch, hq, d, device=device).to(dtype)
        k = torch.randn(batch, hkv, d, device=device).to(dtype)
        core.attend(0, seqs, q, k, k)  # extends the sequences; later layers read context + 1 keys
        warm = _later_layers(core, seqs, q, k, cfg.num_layers)
        for _ in range(1, cfg.num_layers):  # each layer's graph captured (and kernels compiled) before timing
            warm()
        seconds = fastest_on(device, _later_layers(core, seqs, q, k, cfg.num_layers), min(repeats, cfg.num_layers - 2))
        out[f"{batch}x{context}"] = (2 * batch * (context + 1) * hkv * d * elem, seconds)
    return out


def marginal_bytes_s(cases: Sequence[tuple[float, float]], ceiling: float) -> float:
    """Bytes per second of each byte more: the slope of a least-squares line through
    (bytes, seconds), whose intercept is the fixed cost of a call. On a GPU that cost is
    most of a small case's time (a layer of attention over 4 MB of KV took 313 us on an
    H200, over 269 MB 377 us), so bytes over seconds would put the kernel's rate at a
    tenth of what it streams; the fixed cost is in the engine's layer overhead, measured
    apart. Where the cases give no positive slope (one size, or noise), the median of
    their bytes over seconds. At most `ceiling` (the device's copy rate: three cases' noise
    can tilt the line past what the memory streams)."""
    sizes = [b for b, _ in cases]
    if len(set(sizes)) >= 2:
        mean_b = statistics.fmean(sizes)
        mean_s = statistics.fmean(s for _, s in cases)
        cov = sum((b - mean_b) * (s - mean_s) for b, s in cases)
        var = sum((b - mean_b) ** 2 for b in sizes)
        if cov > 0:
            return min(var / cov, ceiling)
    return min(statistics.median(b / s for b, s in cases), ceiling)


def _later_layers(core: Any, seqs: list[tuple[str, int]], q: torch.Tensor, k: torch.Tensor,
                  num_layers: int) -> Callable[[], object]:
    """Each call attends the next layer after 0 (writing its K, V into the step's slots of
    that layer again: the same rows each time)."""
    layers = iter(range(1, num_layers))
    return lambda: core.attend(next(layers), seqs, q, k, k)


def host_copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes per second of a copy from pinned host memory to the device (one way)."""
    pinned = device.type == "cuda"
    host = torch.ones(nbytes // 4, pin_memory=pinned)
    dst = torch.empty(nbytes // 4, device=device)
    return nbytes / fastest_on(device, lambda: dst.copy_(host, non_blocking=pinned), repeats)


def device_round_trips(device: torch.device) -> dict[str, Any]:
    """cuda_ipc's round trip of a 64 B and a 1 MiB CUDA tensor (echoed), both ends in this
    process: the ring copies and their waits, the shm frames and the space-free frame, but no
    process boundary (the ring is shared, not opened by IPC handle)."""
    import asyncio
    import os

    from lamina import transports
    from lamina.planner.measure.pingpong import ameasure
    from lamina.transports import Frame

    async def echo(conn: Any) -> None:
        while True:
            await conn.send(await conn.recv())

    async def run() -> dict[int, float]:
        listener = await transports.listen(f"cuda_ipc://profile-{os.getpid()}", echo)
        conn = await transports.connect(listener.address)
        seconds: dict[int, float] = {}
        async with listener, conn:
            for size in (64, 1 << 20):
                payload = torch.zeros(size, dtype=torch.uint8, device=device)

                async def one(payload: torch.Tensor = payload) -> None:
                    await conn.send(Frame(1, {}, [payload]))
                    await conn.recv()

                seconds[size] = await ameasure(one, size, quick=True)
        return seconds

    seconds = asyncio.run(run())
    return {"rtt_us_64B": seconds[64] * 1e6, "gbit_s_1MiB": 2 * (1 << 20) * 8 / seconds[1 << 20] / 1e9,
            "path": "one process: the ring shared, no IPC handle opened"}


def profile_device(device_name: str, dtype_name: str, usd_per_hour: float, quick: bool = False,
                   model: str = "random:llama-3.2-1b") -> dict[str, Any]:
    """Measure `device_name` in `dtype_name`; {"device": catalogue entry, "measurements": raw}.
    `model`: whose layer shapes the products and attention take, and whose engine the
    overhead terms are measured with."""
    from lamina.model.loader import load_model
    from lamina.planner.profile import measure_engine_overhead, measure_transports

    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    repeats = 3 if quick else 10
    loaded = load_model(model, packed=False)
    cfg = loaded.config
    d, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = [(qkv, d), (d, cfg.num_heads * cfg.head_dim), (2 * inter, d), (d, inter)]
    big = device.type == "cuda"
    copy_bw = copy_bandwidth((1 << 30) if big else (32 << 20), repeats, device)
    flops = matmul_flops(device, dtype, 8192 if big else 512, repeats)
    linear = linear_s_per_param(device, dtype, shapes, 4 if quick else 8,
                                BATCHES if big else (1, 16), repeats)
    attention = attention_bytes_s(cfg, device, dtype, ATTENTION_CASES if big else ((1, 128), (4, 256)), repeats)
    h2d = host_copy_bandwidth(device, (256 << 20) if big else (16 << 20), repeats)
    by_transport = measure_transports(quick=True)
    transport = by_transport["tcp"]
    if device.type == "cuda" and by_transport.get("cuda_ipc", {}).get("unavailable") is None:
        by_transport["cuda_ipc_device"] = device_round_trips(device)
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (torch's operators)"
    src = f"measured by lamina profile --device {device_name} --dtype {dtype_name}, {when}"
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else _host_memory()
    # The weight stream of the smallest batch's products: the memory figure a decode step gets.
    stream_bw = torch.empty((), dtype=dtype).element_size() / linear[min(linear)]
    precision = "bf16" if dtype_name in ("bfloat16", "float16") else "fp32"
    entry: dict[str, Any] = {
        "description": f"this machine's {name} ({dtype_name})",
        "memory_gb": {"value": memory / 1e9, "source": "the device's total memory (torch)"},
        "memory_tb_s": {"value": max(copy_bw, stream_bw) / 1e12,
                        "source": f"{src}: max of a device copy (read + write) and the smallest batch's "
                                  "products' weight stream"},
        "tflops": {precision: {"value": flops / 1e12,
                               "source": f"{src}: a square matrix product in {dtype_name}"}},
        "scaleup_gb_s": {"value": h2d / 1e9, "source": f"{src}: pinned host memory to the device, one way"},
        "network_gbit_s": {"value": transport["gbit_s_1MiB"] / 2, "source": f"{src}: TCP transport 1 MiB ping-pong"},
        "network_latency_us": {"value": transport["rtt_us_64B"] / 2,
                               "source": f"{src}: half the TCP transport's 64 B round trip"},
        "scaleup_latency_us": {"value": 10.0, "assumption": True, "source": "assumption: one kernel launch and sync"},
        "compute_efficiency": {"value": 1.0, "source": "measured figures are effective, not peak"},
        "memory_efficiency": {"value": 1.0, "source": "measured figures are effective, not peak"},
        "usd_per_hour": {"value": usd_per_hour, "assumption": True,
                         "source": "given to lamina profile (--usd-per-hour)"},
        "linear_s_per_param": {"value": {str(b): s for b, s in linear.items()},
                               "source": f"{src}: torch's linear per weight over {model}'s layer shapes, by batch"},
        "attention_tb_s": {"value": marginal_bytes_s(list(attention.values()), copy_bw) / 1e12,
                           "source": f"{src}: the attention worker's core, KV bytes/s of each byte more between "
                                     "(batch, context) cases (its fixed cost a call: in the layer overhead)"},
    }
    if precision != "bf16":  # the planner needs a bf16 rate: the measured one stands in
        entry["tflops"]["bf16"] = {"value": flops / 1e12, "source": f"{src}: the {dtype_name} product (no bf16 here)"}
    overhead = measure_engine_overhead(entry, steps=4 if quick else 8, loaded=loaded, device=device_name,
                                       dtype=dtype_name)
    where = ", ".join(f"batch {b} x prompt {p}" for b, p in OVERHEAD_POINTS)
    entry["layer_overhead_us"] = {"value": overhead["layer_s"] * 1e6,
                                  "source": f"{src}: the engine's decode step at {where}, less the predicted kernels"}
    entry["token_overhead_us"] = {"value": overhead["token_s"] * 1e6, "source": entry["layer_overhead_us"]["source"]}
    return {"device": entry, "measurements": {
        "device": name, "dtype": dtype_name, "model": model, "copy_bytes_s": copy_bw, "matmul_flops": flops,
        "linear_s_per_param": linear, "attention_bytes_s": {k: b / s for k, (b, s) in attention.items()},
        "attention_seconds": {k: s for k, (_, s) in attention.items()}, "h2d_bytes_s": h2d, "transports": by_transport,
        "engine_overhead": overhead}}


def _host_memory() -> float:
    from lamina.planner.profile import memory_bytes

    return memory_bytes()
