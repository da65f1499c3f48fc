"""The planner's output: a readable table and the `--json` form."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lamina.planner.estimate import Estimate
from lamina.planner.hardware import Device
from lamina.planner.perf.quantization import device_verdicts


def to_dict(e: Estimate, simulated: dict[str, Any] | None = None) -> dict[str, Any]:
    layout = e.layout
    d: dict[str, Any] = {
        "layout": layout.describe(),
        "kind": "disaggregated" if layout.is_disaggregated else "colocated",
        "model_device": layout.model_device,
        "tensor_parallel": layout.tp,
        "model_workers": layout.model_workers,
        "attention_device": layout.attention_device,
        "attention_workers": layout.attention_workers,
        "micro_batches": layout.micro_batches,
        "partition": layout.partition,
        "weights": layout.weights.name,
        "kv": layout.kv.name,
        "quant_source": dict(e.quant_sources),
        "threads": None if e.threads is None else {"inter_op": e.threads.inter_op, "intra_op": e.threads.intra_op},
        "replicas": e.replicas,
        "devices": {k: n * e.replicas for k, n in layout.device_counts().items()},
        "batch": e.batch,
        "throughput_tok_s": round(e.throughput_tok_s, 1),
        "demand_tok_s": round(e.demand_tok_s, 1),
        "tbt_ms": round(e.tbt_s * 1e3, 2),
        "ttft_ms": round(e.ttft_s * 1e3, 1) if e.ttft_s != float("inf") else None,
        "usd_per_hour": round(e.usd_per_hour, 2),
        "usd_per_mtok": round(e.usd_per_mtok, 4),
        "network_gbit_s": round(e.network_gbit_s, 2),
        "bottleneck": e.bottleneck,
        "meets_targets": e.feasible,
        "shortfalls": list(e.shortfalls),
    }
    if simulated is not None:
        d["simulated"] = simulated
    return d


def table(estimates: Iterable[Estimate]) -> str:
    header = (f"{'#':>3} {'layout':58} {'rep':>3} {'batch':>5} {'tok/s':>8} {'TBT ms':>7} {'TTFT ms':>8} "
              f"{'$/Mtok':>7} {'$/h':>7} {'Gb/s':>6}  bottleneck")
    lines = [header, "-" * len(header)]
    for i, e in enumerate(estimates, 1):
        ttft = f"{e.ttft_s * 1e3:8.0f}" if e.ttft_s != float("inf") else f"{'inf':>8}"
        miss = f"  [misses: {', '.join(e.shortfalls)}]" if e.shortfalls else ""
        if any(v == "measured" for v in e.quant_sources.values()):
            miss += "  [4-bit costs measured]"
        lines.append(f"{i:>3} {e.layout.describe():58} {e.replicas:>3} {e.batch:>5} {e.throughput_tok_s:>8.0f} "
                     f"{e.tbt_s * 1e3:>7.1f} {ttft} {e.usd_per_mtok:>7.3f} {e.usd_per_hour:>7.2f} "
                     f"{e.network_gbit_s:>6.1f}  {e.bottleneck}{miss}")
    return "\n".join(lines)


def verdicts(device: Device) -> dict[str, Any]:
    """Whether 4-bit weights and KV pay on `device` (per 1e9 elements) and from what."""
    return {part: {"quantize": v.worth_it, "saved_s": round(v.saved_s, 4), "cost_s": round(v.cost_s, 4),
                   "source": source} for part, (v, source) in device_verdicts(device).items()}


def verdict_lines(name: str, device: Device) -> str:
    return "\n".join(f"4-bit {part} on {name}: {'yes' if v['quantize'] else 'no'} (per 1e9 elements saves "
                     f"{v['saved_s']:.4f} s, costs {v['cost_s']:.4f} s; {v['source']})"
                     for part, v in verdicts(device).items())
