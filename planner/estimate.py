"""One layout's predicted performance on a workload: the batch it can run (KV capacity,
time-between-tokens target), its decode step (pipeline model), prefill sharing the model
workers, replicas for the demand (within hardware limits and budget), and the cost.

Assumptions (docs/planner.md): prefill runs on the model workers, between decode steps;
a decoding request holds on average its prompt and half its output in KV; replicas are
added until the demand is at most TARGET_UTILIZATION of the capacity; time to first
token is prefill plus one step plus an M/D/1 queue wait.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from lamina.planner.hardware import Device
from lamina.planner.layouts import Layout
from lamina.planner.perf.attention import attention_layer_time
from lamina.planner.perf.memory import kv_bytes_per_token, kv_token_capacity, usable_bytes, weight_bytes
from lamina.planner.perf.pipeline import StageTimes, colocated_step, pipeline_step
from lamina.planner.perf.prefill import prefill_time
from lamina.planner.perf.quantization import Precision
from lamina.planner.perf.roofline import Roofline
from lamina.planner.perf.slices import slice_time
from lamina.planner.perf.threads import CpuOp, ThreadChoice, choose_threads
from lamina.planner.perf.transfer import layer_traffic, layer_transfer_s
from lamina.planner.shapes import ModelShape
from lamina.planner.workload import WorkloadStats

TARGET_UTILIZATION = 0.8


@dataclass(frozen=True)
class Targets:
    tbt_s: float | None = None
    ttft_s: float | None = None
    budget_usd_h: float | None = None


@dataclass(frozen=True)
class Step:
    """One decode step of a unit running `batch` requests in all."""

    batch: int
    step_s: float
    bottleneck: str
    threads: ThreadChoice | None = None


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    replicas: int
    batch: int  # requests decoding at once in one unit (all micro-batches)
    unit_tok_s: float  # output tokens/s of one unit at full load
    throughput_tok_s: float  # of all replicas
    demand_tok_s: float
    tbt_s: float
    ttft_s: float
    prefill_s: float
    usd_per_hour: float  # all replicas
    usd_per_mtok: float  # at full load
    bottleneck: str
    network_gbit_s: float  # through one model worker's NICs (0 colocated)
    threads: ThreadChoice | None = None
    shortfalls: tuple[str, ...] = field(default=())  # targets not met
    # Where each quantized part's cost came from: "measured" (this machine's profiled
    # kernel) or "dequant model" (bytes and dequantization FLOPs); empty when nothing is.
    quant_sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return not self.shortfalls


def quant_sources(layout: Layout, catalogue: Mapping[str, Device]) -> dict[str, str]:
    """For each quantized part of `layout` ("weights", "kv"), whether its time is the
    device's measured kernel or the generic dequantization model (what slices and
    attention use, by the same conditions)."""
    out = {}
    if layout.weights.is_quantized:
        md = catalogue[layout.model_device]
        measured = layout.weights.weight_kernel in md.packed_linear_s_per_param
        out["weights"] = "measured" if measured else "dequant model"
    if layout.kv.is_quantized:
        ad = catalogue[layout.attention_device or layout.model_device]
        out["kv"] = "measured" if ad.attention_q4_s_per_element is not None else "dequant model"
    return out


def cpu_attention_ops(shape: ModelShape, device: Device, batch: int, context: float, workers: int,
                      kv: Precision) -> list[CpuOp]:
    """One layer of a CPU attention worker's attention as operators, one per KV head it
    holds, with single-thread compute time, for LM-Offload's thread model."""
    heads = max(1, shape.num_kv_heads // workers)
    one = attention_layer_time(shape, device, batch, context, workers * heads, kv)
    return [CpuOp(compute_s=one.compute_s * device.cpu_cores, memory_s=one.memory_s)] * heads


def _cpu_attention(shape: ModelShape, device: Device, batch: int, context: float, workers: int,
                   kv: Precision, base: Roofline) -> tuple[float, ThreadChoice]:
    """The thread choice for a CPU attention worker; its efficiency stretches the roofline."""
    choice = choose_threads(cpu_attention_ops(shape, device, batch, context, workers, kv), device.cpu_cores)
    return base.seconds / choice.efficiency, choice


def decode_step(shape: ModelShape, layout: Layout, catalogue: Mapping[str, Device], batch: int,
                context: float) -> Step:
    md = catalogue[layout.model_device]
    num_layers = shape.num_layers
    if layout.attention_device is None:  # colocated
        sl = slice_time(shape, md, batch, layout.tp, layout.weights)
        att = attention_layer_time(shape, md, batch, context, layout.tp, layout.kv)
        att_s, threads = att.seconds, None
        if md.is_cpu:
            att_s, threads = _cpu_attention(shape, md, batch, context, layout.tp, layout.kv, att)
        if layout.threads > 1:
            # The products and attention split over the threads by their measured speedup;
            # the rest of a layer (the overhead terms: Python, small operators) runs on one.
            speedup = md.linear_speedup(layout.threads, batch)
            sl = replace(sl, layer=sl.layer.scaled(1 / speedup), head=sl.head.scaled(1 / speedup))
            att_s /= md.attention_speedup(layout.threads)
        step = colocated_step(sl.layer_s(), att_s, sl.head.seconds, num_layers)
        if sl.layer_s() >= att_s:
            neck = "model " + ("memory" if sl.layer.is_memory_bound else "compute")
        else:
            neck = "attention " + ("memory" if att.is_memory_bound else "compute")
        return Step(batch, step, neck, threads)
    ad = catalogue[layout.attention_device]
    n_attn, m, n_micro = layout.attention_workers, layout.model_workers, layout.micro_batches
    b = math.ceil(batch / n_micro)
    sl = slice_time(shape, md, b, layout.tp, layout.weights)
    att = attention_layer_time(shape, ad, b, context, n_attn, layout.kv)
    att_s, threads = att.seconds, None
    if ad.is_cpu:
        att_s, threads = _cpu_attention(shape, ad, b, context, n_attn, layout.kv, att)
    traffic = layer_traffic(shape, b)
    link = min(layout.tp * md.network_bw, n_attn * ad.network_bw)
    shared_link = min(m * layout.tp * md.network_bw, n_attn * ad.network_bw)
    latency = max(md.network_latency, ad.network_latency)
    # The services' own costs (profiled machines only; 0 in the catalogue): per slice on the
    # model worker, per frame on each attention worker, per exchange beyond the ping-pong.
    model_s = sl.layer_s() + md.slice_overhead_s
    # On one shared device the attention workers divide its memory: together they take what
    # one worker alone would, in each micro-batch's chain as in the pool's share.
    attention_s = (n_attn * att_s if layout.shared_device else att_s) + ad.frame_overhead_s
    exchange_s = layer_transfer_s(traffic, link, latency) + md.exchange_overhead_s
    host_cpu = model_s + n_attn * attention_s + md.exchange_overhead_s
    stages = StageTimes(model_s=model_s, attention_s=attention_s, transfer_s=exchange_s,
                        transfer_bytes_s=traffic.total / shared_link, head_s=sl.head.seconds,
                        host_cpu_s=host_cpu, host_cores=(md.host_cores or md.cores or 1) if layout.shared_host else 0,
                        device_s=sl.layer_s() + n_attn * att_s if layout.shared_device else 0.0)
    p = pipeline_step(stages, num_layers, n_micro, m)
    neck = {"chain": "latency chain", "network": "network", "host cpu": "host CPU", "device": "shared device",
            "model": "model " + ("memory" if sl.layer.is_memory_bound else "compute"),
            "attention": "attention " + ("memory" if att.is_memory_bound else "compute")}[p.bottleneck]
    return Step(batch, p.step_s, neck, threads)


def kv_capacity_tokens(shape: ModelShape, layout: Layout, catalogue: Mapping[str, Device]) -> int:
    md = catalogue[layout.model_device]
    per_token = kv_bytes_per_token(shape, layout.kv)
    weights = weight_bytes(shape, layout.weights)
    if weights > usable_bytes(md.memory_bytes, layout.tp):
        return 0
    if layout.attention_device is None:  # colocated
        return kv_token_capacity(md.memory_bytes, layout.tp, weights, per_token)
    ad = catalogue[layout.attention_device]
    return kv_token_capacity(ad.memory_bytes, layout.attention_workers, 0.0, per_token)


def _best_step(shape: ModelShape, layout: Layout, catalogue: Mapping[str, Device], max_batch: int,
               context: float, tbt_s: float | None) -> tuple[Step, str]:
    """The largest batch within KV capacity whose step meets the TBT target (a step only
    grows with the batch, and so does tokens per second, so the largest is the best)."""
    lo = layout.micro_batches
    top = decode_step(shape, layout, catalogue, max_batch, context)
    if tbt_s is None or top.step_s <= tbt_s:
        return top, "batch capped by KV capacity"
    first = decode_step(shape, layout, catalogue, lo, context)
    if first.step_s > tbt_s:
        return first, "TBT target unreachable"
    hi = max_batch
    while hi - lo > 1:  # invariant: step(lo) meets the target, step(hi) does not
        mid = (lo + hi) // 2
        if decode_step(shape, layout, catalogue, mid, context).step_s <= tbt_s:
            lo = mid
        else:
            hi = mid
    return decode_step(shape, layout, catalogue, lo, context), "batch capped by TBT target"


def estimate(shape: ModelShape, layout: Layout, catalogue: Mapping[str, Device], stats: WorkloadStats,
             targets: Targets = Targets(), unit_limit: int | None = None,
             decode_only: bool = False) -> Estimate | None:
    """The layout's estimate, or None when it cannot run the workload at all (weights do not
    fit, or not one average request's KV does). `unit_limit` caps the replicas (hardware
    counts). `decode_only`: the decode phase alone, prefill served (and paid for) elsewhere,
    as in Lamina's cost analysis."""
    capacity = kv_capacity_tokens(shape, layout, catalogue)
    context = stats.mean_context
    max_batch = int(capacity // max(context, 1.0))
    if max_batch < layout.micro_batches:
        return None
    step, batch_limit = _best_step(shape, layout, catalogue, max_batch, context, targets.tbt_s)
    md = catalogue[layout.model_device]
    prefill = 0.0 if decode_only else prefill_time(shape, md, stats.mean_prompt, layout.tp, layout.weights,
                                                   stats.mean_prompt_sq)
    decode_tok_s = step.batch / step.step_s
    prefill_unit = prefill / layout.model_workers  # each model worker prefills its share
    # Requests/s of a unit when each request takes its prefill plus its output tokens' share
    # of the decode steps on the model workers.
    req_s = decode_tok_s / (stats.mean_output + prefill_unit * decode_tok_s)
    unit_tok_s = req_s * stats.mean_output
    unit_usd = layout.usd_per_hour(catalogue)
    demand = stats.output_tok_s
    replicas = max(1, math.ceil(demand / (TARGET_UTILIZATION * unit_tok_s)))
    shortfalls: list[str] = []
    if unit_limit is not None and replicas > unit_limit:
        replicas = unit_limit
        shortfalls.append("hardware")
    if targets.budget_usd_h is not None and replicas * unit_usd > targets.budget_usd_h:
        replicas = math.floor(targets.budget_usd_h / unit_usd)
        if replicas < 1:
            return None
        shortfalls.append("budget")
    throughput = replicas * unit_tok_s
    rho = min(demand / throughput, 1.0)
    wait = prefill_unit * rho / (2 * (1 - rho)) if rho < 1 else math.inf
    ttft = prefill + step.step_s + wait
    if rho >= 1:
        shortfalls.append("demand")
    if targets.tbt_s is not None and step.step_s > targets.tbt_s:
        shortfalls.append("tbt")
    if targets.ttft_s is not None and ttft > targets.ttft_s:
        shortfalls.append("ttft")
    network = 0.0
    if layout.is_disaggregated:
        b = math.ceil(step.batch / layout.micro_batches)
        per_step = shape.num_layers * layout.micro_batches * layer_traffic(shape, b).total / layout.model_workers
        handoff = (0.0 if decode_only
                   else req_s / layout.model_workers * stats.mean_prompt * kv_bytes_per_token(shape, layout.kv))
        network = (per_step / step.step_s + handoff) * 8 / 1e9
    neck = step.bottleneck + "; " + batch_limit
    return Estimate(layout, replicas, step.batch, unit_tok_s, throughput, demand, step.step_s, ttft, prefill,
                    replicas * unit_usd, unit_usd / (unit_tok_s * 3600) * 1e6, neck, network, step.threads,
                    tuple(shortfalls), quant_sources(layout, catalogue))
