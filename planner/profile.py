"""Measure this machine for the planner: what `lamina profile` runs.

The measurements are planner/measure/'s, which the benchmarks in bench/ use too: the copy
bandwidth and packed decoder layers of `kernels`, the transport ping-pong of `pingpong`,
the engine's decode step of `engine_step` and the stack run of `stack_run`.
Measured: the engine's matmul kernel over float32 and packed Q8_0, Q4_0 and Q4_1 weights at
several batch sizes (each layer its own weights, so they are read from memory as in a
decode step), decode attention over float32 and q4 KV at several batch sizes and contexts
with the engine's kernel (lamina.model.kv_attention), the q4 quantization of new KV rows, a
large tensor copy, how many times faster the packed products and attention run on each
thread count `lamina up` ranks (2 up to the host's cores) than on one (wall time, measured
alternately), and every transport's round trip and bandwidth (TCP's feed the models);
then the engine's own decode step at two batch sizes, whose gap to the models' prediction
from those kernels is the overhead of everything else in a layer (a per-layer and a
per-token term). Every time is the fastest of its repeats (planner/measure/kernels.py,
engine_step.py): a neighbour inflates a time, never deflates it. The result is a
catalogue entry for `this-machine` (effective figures, so both efficiencies are 1) and
the raw measurements.

Torch is imported here and in planner/measure/ only, never by the models.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lamina.planner.hardware import Device
    from lamina.planner.shapes import ModelShape


# The rounds the products are measured in (measure_linears: the fastest kept).
LINEAR_ROUNDS = 2
# The packed weight formats of lamina.model.quant that `model.weights` chooses from (q8_0; q4 is
# Q4_1; as_file is the GGUF's own Q4_0, Q4_1 or Q8_0 blocks), measured beside float32.
PACKED_FORMATS = ("q8_0", "q4_0", "q4_1")


def measure_linear(batches: tuple[int, ...], layers: int, repeats: int,
                   fmt: str = "f32") -> dict[int, dict[str, float]]:
    """Per batch size: seconds for `layers` decoder layers of SmolLM2-135M's projections
    with the engine's own kernel over weights packed as `fmt` (bench/packed_matmul.py's
    "native" variant), each layer its own weights; the FLOP/s, weight bytes/s and seconds
    per weight that implies."""
    return measure_linears((fmt,), batches, layers, repeats)[fmt]


def measure_linears(formats: tuple[str, ...], batches: tuple[int, ...], layers: int, repeats: int,
                    rounds: int = 1) -> dict[str, dict[int, dict[str, float]]]:
    """measure_linear's figures for each of `formats`, measured in `rounds` rounds (each
    round every format at every batch size, in turn) and the fastest round's kept: a
    neighbour that slows the machine for a few seconds (these cores, their caches and
    memory are shared) inflates one round's times, never deflates them, and in one
    validation run an inflated profile predicted the engine's batch-1 step 28% slow."""
    import torch

    from lamina.planner.measure.kernels import LAYER, fastest_compute_time, make_layers, native_run

    shapes = LAYER  # (outputs, inputs) of one decoder layer
    gen = torch.Generator().manual_seed(0)
    weights = {fmt: make_layers(fmt, layers, gen) for fmt in formats}
    runs = {fmt: native_run(w) for fmt, w in weights.items()}
    xs = {b: {i: torch.randn(b, i, generator=gen) for _, i in shapes} for b in batches}
    seconds: dict[str, dict[int, float]] = {fmt: {} for fmt in formats}
    for _ in range(rounds):
        for fmt, run in runs.items():
            for b in batches:
                t = fastest_compute_time(functools.partial(run, xs[b]), repeats)
                seconds[fmt][b] = min(t, seconds[fmt].get(b, t))
    params = layers * sum(o * i for o, i in shapes)
    nbytes = {fmt: sum(pw.nbytes for layer in w for pw in layer) for fmt, w in weights.items()}
    return {fmt: {b: {"seconds": t, "flops": 2 * params * b / t, "weight_bytes_s": nbytes[fmt] / t,
                      "s_per_param": t / params} for b, t in by_batch.items()} for fmt, by_batch in seconds.items()}


# The batch sizes and attention cases the compute threads' speedup is measured at, and
# the packed format it is measured over (the default GGUF's Q4_1 blocks).
SPEEDUP_BATCHES = (1, 4, 16, 64)
SPEEDUP_ATTENTION = ((4, 256), (16, 512))
SPEEDUP_FORMAT = "q4_1"
# The rounds the speedup is measured in, and at most how many until its figures settle
# (speedup_settled): one round takes about 0.7 s with --quick on 2 cores.
SPEEDUP_ROUNDS = 3
SPEEDUP_MAX_ROUNDS = 12
# Below this, T threads measured barely faster than one: on the 2-core VM the idle
# machine measured 1.24-2.45x (per product batch size) and a disturbed profile 0.82-1.36x.
SPEEDUP_SUSPECT_BELOW = 1.25

# One round: per case (("linear", batch) or ("attention", index)), the seconds on one
# compute thread and on T, measured one right after the other.
SpeedupRound = dict[tuple[str, int], tuple[float, float]]


def fastest_ratios(rounds: list[SpeedupRound]) -> dict[tuple[str, int], float]:
    """Per case: its fastest one-thread time over its fastest T-thread time, over `rounds`
    (a neighbour inflates a round's times, never deflates them)."""
    cases = rounds[0].keys()
    return {case: min(r[case][0] for r in rounds) / min(r[case][1] for r in rounds) for case in cases}


def speedup_suspect(ratios: dict[tuple[str, int], float]) -> bool:
    """Whether the ratios look disturbed rather than measured: T threads barely faster
    than one at some case (a neighbour on one core stalls every thread of a product, which
    waits for its slowest)."""
    return any(x < SPEEDUP_SUSPECT_BELOW for x in ratios.values())


# A round that moves a ratio by more than this fraction was not the last one needed.
SPEEDUP_SETTLED = 0.1


def speedup_settled(rounds: list[SpeedupRound]) -> bool:
    """Whether the speedup measured over `rounds` needs no more: not suspect, and the last
    round moved no ratio by more than SPEEDUP_SETTLED (a neighbour that slowed the earlier
    rounds and has gone moves them)."""
    now = fastest_ratios(rounds)
    if speedup_suspect(now) or len(rounds) < 2:
        return False
    before = fastest_ratios(rounds[:-1])
    return all(abs(now[c] / before[c] - 1) <= SPEEDUP_SETTLED for c in now)


def measure_thread_speedup(thread_counts: tuple[int, ...], layers: int, repeats: int,
                           max_rounds: int = SPEEDUP_MAX_ROUNDS) -> dict[int, dict[str, Any]]:
    """Per thread count T above 1: how many times faster the packed products (by batch
    size) and the attention kernel (the median over SPEEDUP_ATTENTION's cases) run on T
    compute threads than on one, in wall time (`rounds`: how many rounds that took;
    `settled`: whether the figures settled in them).

    Each round measures every case on one thread and right after on T, and each side keeps
    its fastest round (fastest_ratios). After SPEEDUP_ROUNDS rounds it goes on, up to
    `max_rounds`, until the figures settle (speedup_settled). Three rounds alone were not
    robust on the 2-core VM: a profile there had 0.82-1.36x for the products (2026-11-29,
    other processes 0.003 cores), where the same measurement minutes later gave
    1.24-2.45x, and `lamina up --layout auto` ranked the disaggregated layout first with
    it, where colocated on two threads measured faster (bench/thread_speedup.py reproduces
    it with a busy loop on one core)."""
    import torch

    from lamina.model.kv_attention import buffer_attention
    from lamina.model.quant import kernel_threads, set_kernel_threads
    from lamina.planner.measure.kernels import LAYER, fastest_wall_time, make_layers, native_run

    gen = torch.Generator().manual_seed(0)
    run_native = native_run(make_layers(SPEEDUP_FORMAT, layers, gen))
    calls: dict[tuple[str, int], Any] = {}
    for b in SPEEDUP_BATCHES:
        calls["linear", b] = functools.partial(run_native, {i: torch.randn(b, i, generator=gen) for _, i in LAYER})
    for i, (batch, context) in enumerate(SPEEDUP_ATTENTION):
        q, keys, values = _attention_inputs(batch, context, gen)
        calls["attention", i] = functools.partial(buffer_attention, q, [1] * batch, keys, values, need_lse=False)

    def timed(threads: int, call: Any) -> float:
        set_kernel_threads(threads)
        return fastest_wall_time(call, repeats)

    before = kernel_threads()
    out: dict[int, dict[str, Any]] = {}
    try:
        for threads in (t for t in thread_counts if t > 1):
            rounds: list[SpeedupRound] = []
            while len(rounds) < SPEEDUP_ROUNDS or (len(rounds) < max_rounds and not speedup_settled(rounds)):
                rounds.append({case: (timed(1, call), timed(threads, call)) for case, call in calls.items()})
            ratios = fastest_ratios(rounds)
            out[threads] = {"linear": {b: ratios["linear", b] for b in SPEEDUP_BATCHES},
                            "attention": statistics.median(ratios["attention", i]
                                                           for i in range(len(SPEEDUP_ATTENTION))),
                            "rounds": len(rounds), "settled": speedup_settled(rounds)}
    finally:
        set_kernel_threads(before)
    return out


# SmolLM2-135M's attention: 9 query heads, 3 KV heads of 64.
_HEADS, _KV_HEADS, _HEAD_DIM = 9, 3, 64


def _attention_inputs(batch: int, context: int, generator=None):
    """One decode step's attention inputs for `batch` sequences of `context` tokens:
    Q [batch, heads, d], and each sequence's K and V [context, kv_heads, d]."""
    import torch

    keys = [torch.randn(context, _KV_HEADS, _HEAD_DIM, generator=generator) for _ in range(batch)]
    values = [torch.randn(context, _KV_HEADS, _HEAD_DIM, generator=generator) for _ in range(batch)]
    return torch.randn(batch, _HEADS, _HEAD_DIM, generator=generator), keys, values


def measure_attention(cases: tuple[tuple[int, int], ...], repeats: int) -> dict[str, dict[str, float]]:
    """Per (batch, context): one layer of decode attention with the engine's kernel over
    float32 KV (the local engine's buffers) and over q4 KV (an attention worker's packed
    slab pool, lamina.model.kv_quant), the float32 KV bytes/s and both times per KV element."""
    import torch

    from lamina.model.kv_attention import SlotBatch, buffer_attention, slot_attention
    from lamina.model.kv_quant import Q4Rows
    from lamina.planner.measure.kernels import fastest_compute_time

    kv_heads, d = _KV_HEADS, _HEAD_DIM
    rows = Q4Rows(d)
    out: dict[str, dict[str, float]] = {}
    for batch, context in cases:
        q, keys, values = _attention_inputs(batch, context)
        lens = [1] * batch
        t = fastest_compute_time(functools.partial(buffer_attention, q, lens, keys, values, need_lse=False), repeats)
        k_pool, v_pool = rows.quantize(torch.cat(keys)), rows.quantize(torch.cat(values))  # [S, Hkv, row_bytes]
        slots = SlotBatch.build([range(i * context, (i + 1) * context) for i in range(batch)], batch * context)
        q4_attention = functools.partial(slot_attention, q, lens, k_pool, v_pool, slots, need_lse=False, packed=rows)
        t_q4 = fastest_compute_time(q4_attention, repeats)
        elements = 2 * batch * context * kv_heads * d
        out[f"{batch}x{context}"] = {"seconds": t, "kv_bytes_s": elements * 4 / t, "s_per_element": t / elements,
                                     "q4_seconds": t_q4, "q4_s_per_element": t_q4 / elements}
    return out


def measure_kv_quantize(tokens: int, repeats: int) -> float:
    """Seconds per KV element to quantize new rows to q4 (an attention worker does it once
    per new token, layer and KV head, for K and V): `tokens` tokens' K of one layer at a time."""
    import torch

    from lamina.model.kv_quant import Q4Rows
    from lamina.planner.measure.kernels import fastest_compute_time

    rows = Q4Rows(_HEAD_DIM)
    x = torch.randn(tokens, _KV_HEADS, _HEAD_DIM)
    return fastest_compute_time(lambda: rows.quantize(x), repeats) / x.numel()


TRANSPORTS = ("tcp", "shm", "ucx", "rdma", "fhbn", "cuda_ipc")
# How a scheme's frames travel, where that is not what its name suggests.
TRANSPORT_PATHS = {"fhbn": "host-driven RDMA: frames go from host memory as rdma:// sends them; the GPU-initiated "
                           "send (csrc/fhbn.cu) is not wired to connections yet",
                   "cuda_ipc": "frames of host memory through its shm:// connection (these figures); device tensors "
                               "through its rings of device memory (cuda_ipc_device)"}


def measure_transport(quick: bool = True, scheme: str = "tcp") -> dict[str, Any]:
    """One transport's round trip (64 B) and bandwidth (1 MiB) on loopback."""
    from lamina.planner.measure.pingpong import pingpong

    res = pingpong(scheme, [64, 1 << 20], quick)
    return {"rtt_us_64B": res["rtt_us"]["64"], "gbit_s_1MiB": res["gbps"][str(1 << 20)]}


def measure_transports(quick: bool = True) -> dict[str, dict[str, Any]]:
    """Every transport's figures where this machine runs it, else {"unavailable": why}."""
    from lamina import transports

    out: dict[str, dict[str, Any]] = {}
    for scheme in TRANSPORTS:
        why = transports.availability(scheme)
        out[scheme] = {"unavailable": why} if why is not None else measure_transport(quick, scheme)
        if scheme in TRANSPORT_PATHS:
            out[scheme]["path"] = TRANSPORT_PATHS[scheme]
    return out


# (batch, prompt) of the two engine steps that calibrate the overhead; the validation's
# cases (bench/planner_validation.py) are other points.
OVERHEAD_POINTS = ((1, 16), (16, 16))


def measure_engine_overhead(entry: dict[str, Any], steps: int, threads: int = 1, loaded: Any = None,
                            device: str = "cpu", dtype: str = "float32") -> dict[str, Any]:
    """The rest of a decode layer: the engine's pure-decode step (planner/measure/engine_step.py's
    decode_step_cpu, default model, the fastest of `steps`, as the kernels in `entry` are
    each their fastest; with several threads, or on another `device` (`loaded` there, in
    `dtype`), decode_step_wall, since their CPU time adds up or the device works while the
    CPU waits) at two batch sizes, less what the models predict from those kernels; the
    two gaps give a per-layer and a per-token term."""
    from lamina.model.loader import load_model
    from lamina.planner.estimate import decode_step
    from lamina.planner.hardware import THIS_MACHINE, device_from_entry
    from lamina.planner.layouts import Layout
    from lamina.planner.measure.engine_step import decode_step_cpu, decode_step_wall
    from lamina.planner.perf.quantization import FP16, FP32
    from lamina.planner.shapes import ModelShape

    loaded = loaded if loaded is not None else load_model()
    cfg = loaded.config
    shape = ModelShape.of(cfg, "engine")
    catalogue = {THIS_MACHINE: device_from_entry(THIS_MACHINE, entry)}
    precision = FP32 if dtype == "float32" else FP16
    layout = Layout(THIS_MACHINE, 1, weights=precision, kv=precision)
    gaps = []
    for batch, prompt in OVERHEAD_POINTS:
        if threads > 1 or device != "cpu":
            measured = decode_step_wall(loaded, batch, prompt, steps, seed=batch, device=device, dtype=dtype)
        else:
            measured = decode_step_cpu(loaded, batch, prompt, steps, seed=batch)
        predicted = decode_step(shape, layout, catalogue, batch, prompt + 1 + steps / 2).step_s
        gaps.append((batch, measured, predicted))
    layer_s, token_s = overhead_terms(gaps, shape.num_layers)
    return {"layer_s": layer_s, "token_s": token_s,
            "points": [{"batch": b, "measured_s": m, "predicted_s": p} for b, m, p in gaps]}


def overhead_terms(points: list[tuple[int, float, float]], num_layers: int) -> tuple[float, float]:
    """From two (batch, measured s, predicted s) steps: the per-layer and per-token
    overhead that make the prediction meet both (never negative)."""
    (b0, m0, p0), (b1, m1, p1) = points
    g0, g1 = (m0 - p0) / num_layers, (m1 - p1) / num_layers
    per_token = max(0.0, (g1 - g0) / (b1 - b0))
    return max(0.0, g0 - b0 * per_token), per_token


# (batch, context, steps) of the stack run that calibrates the services' overheads: one
# model worker, one attention worker, one micro-batch; the validation's stack cases
# (bench/planner_validation.py: batch 32, context 256) are other points.
STACK_POINT = (8, 64, 12)


def measure_stack_overhead(entry: dict[str, Any]) -> dict[str, Any]:
    """The services' own costs: a small decode through the stack as `lamina up` starts it
    (planner/measure/stack_run.py's run_stack, TCP, float32 weights), whose model and attention
    workers' process CPU and wall step time, less what the models predict from the kernel
    measurements in `entry`, give the per-slice, per-frame and per-exchange terms."""
    from lamina.model.loader import load_model
    from lamina.planner.hardware import THIS_MACHINE, device_from_entry
    from lamina.planner.measure.stack_run import make_prompts, run_stack
    from lamina.planner.shapes import ModelShape

    batch, context, steps = STACK_POINT
    loaded = load_model(weights="float32")
    cfg = loaded.config
    shape = ModelShape.of(cfg, "engine")
    prompts = make_prompts(loaded.tokenizer, batch, context)
    kv_bytes = batch * (context + steps + 64) * cfg.kv_bytes_per_token() + (64 << 20)
    run = run_stack(prompts, steps, "tcp", 1, False, 1, kv_bytes, "float32", attention_workers=1)
    steps_timed = run["tokens"] / batch
    # The processes' whole CPU (process_cpu_seconds_total): the model worker's sends, event
    # loop and sampling occupy its core as its slices do, and likewise an attention worker's.
    model_cpu = sum(v["cpu"] for k, v in run["shares"].items() if k.startswith("model")) * run["seconds"]
    attention_cpu = sum(v["cpu"] for k, v in run["shares"].items() if k.startswith("attention")) * run["seconds"]
    measured = StackRun(batch, context + steps / 2, run["seconds"] / steps_timed, model_cpu / steps_timed,
                        attention_cpu / steps_timed)
    terms = stack_overhead_terms(shape, device_from_entry(THIS_MACHINE, entry), measured)
    return {**terms, "run": {"batch": batch, "context": context, "steps": steps, "tok_s": run["tok_s"],
                             "step_s": measured.step_s, "model_cpu_s": measured.model_cpu_s,
                             "attention_cpu_s": measured.attention_cpu_s}}


@dataclass(frozen=True)
class StackRun:
    """Per decode step of a stack with one model worker, one attention worker and one
    micro-batch: wall seconds, and the CPU seconds of each worker's process."""

    batch: int
    context: float
    step_s: float
    model_cpu_s: float
    attention_cpu_s: float


def stack_overhead_terms(shape: ModelShape, device: Device, run: StackRun) -> dict[str, float]:
    """Per layer: the model worker's CPU beyond the slices' predicted time, the attention
    worker's beyond its kernel's, and the rest of the wall step beyond both and the
    transport's round trip for the frames' bytes (never negative)."""
    from lamina.planner.perf.attention import attention_layer_time
    from lamina.planner.perf.quantization import FP32
    from lamina.planner.perf.slices import slice_time
    from lamina.planner.perf.transfer import layer_traffic, layer_transfer_s

    num_layers = shape.num_layers
    sl = slice_time(shape, device, run.batch, 1, FP32)
    att = attention_layer_time(shape, device, run.batch, run.context, 1, FP32).seconds
    slice_s = max(0.0, (run.model_cpu_s - sl.step_s(num_layers)) / num_layers)
    frame_s = max(0.0, run.attention_cpu_s / num_layers - att)
    transfer = layer_transfer_s(layer_traffic(shape, run.batch), device.network_bw, device.network_latency)
    chain = sl.layer_s() + slice_s + att + frame_s + transfer
    exchange_s = max(0.0, (run.step_s - sl.head.seconds) / num_layers - chain)
    return {"slice_s": slice_s, "frame_s": frame_s, "exchange_s": exchange_s}


def memory_bytes() -> float:
    """This machine's memory (Linux: MemTotal of /proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return float(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def profile(threads: int, usd_per_hour: float, quick: bool = False, stack: bool = True) -> dict[str, Any]:
    """Measure and return {"device": catalogue entry, "measurements": raw figures}."""
    import torch

    from lamina.model.quant import set_kernel_threads
    from lamina.planner.local_layout import thread_choices
    from lamina.planner.measure.host_load import ForeignCpu
    from lamina.planner.measure.kernels import copy_bandwidth

    others = ForeignCpu()  # what the neighbours take meanwhile, recorded with the figures
    torch.set_num_threads(threads)
    set_kernel_threads(threads)
    repeats = 3 if quick else 7
    copy_bw = copy_bandwidth(64 << 20 if quick else 256 << 20, repeats)
    batches = (1, 2, 4, 8, 16, 32, 64)
    layers = 8 if quick else 30
    tables = measure_linears(("f32", *PACKED_FORMATS), batches, layers, repeats, rounds=LINEAR_ROUNDS)
    linear = tables.pop("f32")
    packed = tables
    attention = measure_attention(((1, 256), (16, 256), (16, 1024), (64, 512)), repeats)
    kv_quantize = measure_kv_quantize(64, repeats * 10)
    by_transport = measure_transports(quick=True)
    transport = by_transport["tcp"]  # the default transport: the network figures the models use
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    src = f"measured by lamina profile, {when}, {threads} torch threads"
    # The memory figure the models use is what a decode step gets: the best of a plain
    # copy and batch-1 linear layers (weights streamed once), which is the closer to it.
    stream_bw = max(copy_bw, linear[1]["weight_bytes_s"])
    flops = max(v["flops"] for v in linear.values())
    rtt = transport["rtt_us_64B"]
    attention_bw = statistics.median(v["kv_bytes_s"] for v in attention.values())
    entry: dict[str, Any] = {
        "description": f"this machine ({os.cpu_count()} CPUs seen, {threads} threads measured)",
        "memory_gb": {"value": round(memory_bytes() / 1e9, 3), "source": "MemTotal in /proc/meminfo"},
        "memory_tb_s": {"value": stream_bw / 1e12,
                        "source": f"{src}: max of a tensor copy (read + write) and the batch-1 matmul kernel's "
                                  "weight stream"},
        "tflops": {
            "bf16": {"value": flops / 1e12,
                     "source": f"{src}: best FLOP/s of the engine's float32 matmul kernel "
                               "(it computes in float32 here)"},
            "fp32": {"value": flops / 1e12, "source": f"{src}: best FLOP/s of the engine's float32 matmul kernel"},
        },
        "scaleup_gb_s": {"value": copy_bw / 2 / 1e9, "source": f"{src}: tensor copy, one way"},
        "network_gbit_s": {"value": transport["gbit_s_1MiB"] / 2,
                           "source": f"{src}: TCP transport 1 MiB ping-pong, one way"},
        "network_latency_us": {"value": rtt / 2, "source": f"{src}: half the TCP transport's 64 B round trip"},
        "scaleup_latency_us": {"value": 1.0, "assumption": True, "source": "assumption: one core synchronisation"},
        "compute_efficiency": {"value": 1.0, "source": "measured figures are effective, not peak"},
        "memory_efficiency": {"value": 1.0, "source": "measured figures are effective, not peak"},
        "usd_per_hour": {"value": usd_per_hour, "assumption": True,
                         "source": "given to lamina profile (--usd-per-hour)"},
        "cores": {"value": threads, "source": "the torch threads the measurements ran with"},
        "linear_s_per_param": {"value": {str(b): v["s_per_param"] for b, v in linear.items()},
                               "source": f"{src}: the engine's float32 matmul kernel per weight, by batch size"},
        "attention_tb_s": {"value": attention_bw / 1e12,
                           "source": f"{src}: median KV bytes/s of the engine's attention kernel over "
                                     "(batch, context) cases"},
        "packed_linear_s_per_param": {
            "value": {fmt: {str(b): v["s_per_param"] for b, v in table.items()} for fmt, table in packed.items()},
            "source": f"{src}: the engine's packed-weight matmul kernel per weight, by format and batch size"},
        "attention_q4_ns_per_element": {
            "value": statistics.median(v["q4_s_per_element"] for v in attention.values()) * 1e9,
            "source": f"{src}: median time per KV element of the engine's attention kernel over q4 KV, same cases"},
        "kv_q4_quantize_ns_per_element": {
            "value": kv_quantize * 1e9, "source": f"{src}: lamina.model.kv_quant's quantization of new K or V rows"},
    }
    overhead = measure_engine_overhead(entry, steps=6 if quick else 8, threads=threads)
    where = ", ".join(f"batch {b} x prompt {p}" for b, p in OVERHEAD_POINTS)
    entry["layer_overhead_us"] = {"value": overhead["layer_s"] * 1e6,
                                  "source": f"{src}: the engine's decode step at {where}, "
                                            "less the kernels' predicted time"}
    entry["token_overhead_us"] = {"value": overhead["token_s"] * 1e6, "source": entry["layer_overhead_us"]["source"]}
    cores = len(os.sched_getaffinity(0))
    entry["host_cores"] = {"value": cores, "source": "the CPUs this process may run on (sched_getaffinity)"}
    speedup = measure_thread_speedup(thread_choices(cores), layers, repeats)
    if speedup:
        entry["thread_speedup"] = {
            "value": {str(t): {"linear": {str(b): x for b, x in v["linear"].items()}, "attention": v["attention"]}
                      for t, v in speedup.items()},
            "source": f"measured by lamina profile, {when}: wall time of the packed ({SPEEDUP_FORMAT}) products "
                      f"by batch size and of the attention kernel on one compute thread over that on T, "
                      "measured alternately, each side's fastest of "
                      + ", ".join(f"{v['rounds']} rounds (T = {t})" for t, v in speedup.items())}
    services = None
    if stack:  # last: it starts the stack's processes
        services = measure_stack_overhead(entry)
        b, c, n = STACK_POINT
        where = (f"{src}: the stack (1 model worker, 1 attention worker, 1 micro-batch, TCP) decoding {b} x {c} "
                 f"tokens for {n} steps, less the kernels' predicted time")
        for key in ("slice", "frame", "exchange"):
            entry[f"{key}_overhead_us"] = {"value": services[f"{key}_s"] * 1e6, "source": where}
    return {"device": entry, "measurements": {
        "copy_bytes_s": copy_bw, "services": services, "linear": {str(k): v for k, v in linear.items()},
        "packed_linear": {fmt: {str(k): v for k, v in table.items()} for fmt, table in packed.items()},
        "kv_q4_quantize_s_per_element": kv_quantize, "thread_speedup": {str(t): v for t, v in speedup.items()},
        "attention": attention, "transport": transport, "transports": by_transport, "overhead": overhead,
        "foreign_cores": others.cores()}}
