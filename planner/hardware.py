"""The hardware catalogue: devices with memory, bandwidth, compute by dtype, interconnect
and price, each figure with its source (planner/catalogue.yaml), and `this-machine` from a
profile file in the same format when one is given.

A `Device` holds effective figures in SI units (bytes, bytes/s, FLOP/s, seconds, USD/h);
the efficiencies stay separate so that a report can show peak and achieved side by side.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

THIS_MACHINE = "this-machine"

# Catalogue key -> whether every entry must have it.
_FIGURES = {
    "memory_gb": True, "memory_tb_s": True, "scaleup_gb_s": True, "network_gbit_s": True,
    "network_latency_us": True, "scaleup_latency_us": True, "compute_efficiency": True,
    "memory_efficiency": True, "usd_per_hour": True, "cores": False,
}


class CatalogueError(ValueError):
    """A catalogue or profile entry that is missing a figure or a figure's source."""


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    memory_bytes: float
    memory_bw: float  # bytes/s, peak
    flops: Mapping[str, float]  # dtype ("bf16", "fp8", "fp32") -> FLOP/s, dense peak
    scaleup_bw: float  # bytes/s one way, per device (NVLink, PCIe or UPI)
    network_bw: float  # bytes/s one way, per device (the NIC that reaches other workers)
    network_latency: float  # s, one way
    scaleup_latency: float  # s, one small collective
    compute_efficiency: float
    memory_efficiency: float
    usd_per_hour: float
    cores: int | None = None  # CPU devices: physical cores, for the thread-count model
    sources: Mapping[str, str] = field(default_factory=dict)
    # Measured by `lamina profile` (empty / None in the catalogue): seconds per weight of a
    # decode matmul at each batch size with this machine's kernel, and the bytes/s of KV its
    # attention kernel reads. Where present they replace the roofline's terms.
    linear_s_per_param: Mapping[int, float] = field(default_factory=dict)
    attention_bw: float | None = None
    # Measured too: the rest of a decode layer on this machine's engine (norms, RoPE, the
    # element-wise products, residuals, KV append, dispatch), per layer and micro-batch,
    # plus per token. 0 in the catalogue: the GPU models leave it out.
    layer_overhead_s: float = 0.0
    token_overhead_s: float = 0.0
    # Measured too, for quantized choices: seconds per weight of the packed-weight kernel by
    # format ("q8_0", "q4_0", "q4_1") and batch size; seconds per KV element of attention
    # over q4 KV, and of quantizing a new K or V row. Where present they replace the
    # generic dequantization-FLOP model (lamina.planner.perf.quantization).
    packed_linear_s_per_param: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    attention_q4_s_per_element: float | None = None
    kv_q4_quantize_s_per_element: float | None = None
    # Measured on a running stack (`lamina profile`, all services on this host), per layer
    # and micro-batch: the model worker's CPU per slice beyond its kernels, an attention
    # worker's CPU per frame beyond its kernel, and the exchange's time beyond the
    # transport's ping-pong (frame encoding, event loops); and the cores the host's
    # services share. 0 / None in the catalogue.
    slice_overhead_s: float = 0.0
    frame_overhead_s: float = 0.0
    exchange_overhead_s: float = 0.0
    host_cores: int | None = None
    # Measured too: how many times faster the packed products run on T compute threads than
    # on one (wall time), by T and batch size, and the attention kernel's speedup by T.
    # Empty in the catalogue and in a one-core profile: one thread only.
    linear_thread_speedup: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    attention_thread_speedup: Mapping[int, float] = field(default_factory=dict)

    @property
    def is_cpu(self) -> bool:
        return self.cores is not None

    @property
    def cpu_cores(self) -> int:
        """The physical cores of a CPU device (the thread-count model's input)."""
        if self.cores is None:
            raise ValueError(f"{self.name} is not a CPU device: it has no cores figure")
        return self.cores

    @property
    def matmul_flops(self) -> float:
        """Achievable FLOP/s of 16-bit matmuls (bf16 tensor cores, AMX)."""
        return self.flops["bf16"] * self.compute_efficiency

    @property
    def vector_flops(self) -> float:
        """Achievable FLOP/s of element-wise work ((de)quantization): the fp32 units."""
        return self.flops.get("fp32", self.flops["bf16"]) * self.compute_efficiency

    @property
    def achieved_bw(self) -> float:
        return self.memory_bw * self.memory_efficiency

    @property
    def measured_threads(self) -> tuple[int, ...]:
        """The compute-thread counts this device's figures hold for: 1, and each T with a
        measured speedup."""
        return (1, *sorted(t for t in self.linear_thread_speedup if t > 1 and t in self.attention_thread_speedup))

    def linear_speedup(self, threads: int, batch: int) -> float:
        """How many times faster the products run on `threads` threads at `batch` (1 for
        one thread): linear between measured batch sizes, the nearest one beyond them."""
        if threads <= 1:
            return 1.0
        table = self.linear_thread_speedup.get(threads)
        if not table:
            raise ValueError(f"{self.name}: no measured speedup for {threads} threads")
        return _by_batch(table, batch)

    def attention_speedup(self, threads: int) -> float:
        """How many times faster the attention kernel runs on `threads` threads (1 for one)."""
        if threads <= 1:
            return 1.0
        if threads not in self.attention_thread_speedup:
            raise ValueError(f"{self.name}: no measured attention speedup for {threads} threads")
        return self.attention_thread_speedup[threads]

    def measured_linear_s(self, params: float, batch: int, packed: str | None = None) -> float | None:
        """Seconds for a decode matmul over `params` weights at `batch` from the measured
        table (float32, or the packed format `packed`): linear between measured batch sizes,
        proportional to the batch beyond the largest (compute-bound there); None without a
        table."""
        table = self.linear_s_per_param if packed is None else self.packed_linear_s_per_param.get(packed)
        if not table:
            return None
        largest = max(table)
        if batch >= largest:
            return params * table[largest] * batch / largest
        return params * _by_batch(table, batch)


def _by_batch(table: Mapping[int, float], batch: int) -> float:
    """A figure measured at several batch sizes, at `batch`: linear between the measured
    sizes, the nearest one's beyond them."""
    sizes = sorted(table)
    if batch <= sizes[0]:
        return table[sizes[0]]
    if batch >= sizes[-1]:
        return table[sizes[-1]]
    hi = next(b for b in sizes if b >= batch)
    lo = max(b for b in sizes if b <= batch)
    if hi == lo:
        return table[lo]
    return table[lo] + (batch - lo) / (hi - lo) * (table[hi] - table[lo])


def _figure(entry: Mapping[str, Any], key: str, where: str, minimum_exclusive: bool = True) -> tuple[float, str]:
    fig = entry.get(key)
    if not isinstance(fig, Mapping) or "value" not in fig:
        raise CatalogueError(f"{where}: {key} must be {{value, source}}")
    source = fig.get("source")
    if not isinstance(source, str) or not source.strip():
        raise CatalogueError(f"{where}: {key} has no source")
    value = float(fig["value"])
    if value < 0 or (minimum_exclusive and value == 0):
        sign = "positive" if minimum_exclusive else "non-negative"
        raise CatalogueError(f"{where}: {key} must be {sign}, got {value}")
    return value, source


def device_from_entry(name: str, entry: Mapping[str, Any]) -> Device:
    """One catalogue (or profile) entry -> a Device; raises CatalogueError if a figure or its
    source is missing."""
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    for key, required in _FIGURES.items():
        if key not in entry and not required:
            continue
        values[key], sources[key] = _figure(entry, key, name)
    flops: dict[str, float] = {}
    for dtype in (entry.get("tflops") or {}):
        tflops, sources[f"tflops.{dtype}"] = _figure(entry["tflops"], dtype, f"{name}.tflops")
        flops[dtype] = tflops * 1e12
    if "bf16" not in flops:
        raise CatalogueError(f"{name}: tflops.bf16 is required")
    linear: dict[int, float] = {}
    if "linear_s_per_param" in entry:
        fig = entry["linear_s_per_param"]
        if not isinstance(fig, Mapping) or not isinstance(fig.get("value"), Mapping) or not fig.get("source"):
            raise CatalogueError(f"{name}: linear_s_per_param must be {{value: {{batch: seconds}}, source}}")
        linear = {int(b): float(t) for b, t in fig["value"].items()}
        sources["linear_s_per_param"] = fig["source"]
    overheads = {}
    for key in ("layer_overhead_us", "token_overhead_us", "slice_overhead_us", "frame_overhead_us",
                "exchange_overhead_us"):
        if key in entry:
            us, sources[key] = _figure(entry, key, name, minimum_exclusive=False)
            overheads[key] = us * 1e-6
    packed: dict[str, dict[int, float]] = {}
    if "packed_linear_s_per_param" in entry:
        fig = entry["packed_linear_s_per_param"]
        if not isinstance(fig, Mapping) or not isinstance(fig.get("value"), Mapping) or not fig.get("source") \
                or not all(isinstance(t, Mapping) for t in fig["value"].values()):
            raise CatalogueError(f"{name}: packed_linear_s_per_param must be "
                                 f"{{value: {{format: {{batch: seconds}}}}, source}}")
        packed = {fmt: {int(b): float(t) for b, t in table.items()} for fmt, table in fig["value"].items()}
        sources["packed_linear_s_per_param"] = fig["source"]
    per_element = {}
    for key in ("attention_q4_ns_per_element", "kv_q4_quantize_ns_per_element"):
        if key in entry:
            ns, sources[key] = _figure(entry, key, name)
            per_element[key] = ns * 1e-9
    linear_speedup, attention_speedup = _thread_speedups(entry, name, sources)
    attention_bw = None
    if "attention_tb_s" in entry:
        tb_s, sources["attention_tb_s"] = _figure(entry, "attention_tb_s", name)
        attention_bw = tb_s * 1e12
    return Device(
        name=name, description=str(entry.get("description", name)),
        memory_bytes=values["memory_gb"] * 1e9, memory_bw=values["memory_tb_s"] * 1e12,
        flops=flops, scaleup_bw=values["scaleup_gb_s"] * 1e9,
        network_bw=values["network_gbit_s"] * 1e9 / 8,
        network_latency=values["network_latency_us"] * 1e-6,
        scaleup_latency=values["scaleup_latency_us"] * 1e-6,
        compute_efficiency=values["compute_efficiency"], memory_efficiency=values["memory_efficiency"],
        usd_per_hour=values["usd_per_hour"],
        cores=int(values["cores"]) if "cores" in values else None, sources=sources,
        linear_s_per_param=linear, attention_bw=attention_bw,
        layer_overhead_s=overheads.get("layer_overhead_us", 0.0),
        token_overhead_s=overheads.get("token_overhead_us", 0.0),
        packed_linear_s_per_param=packed,
        attention_q4_s_per_element=per_element.get("attention_q4_ns_per_element"),
        kv_q4_quantize_s_per_element=per_element.get("kv_q4_quantize_ns_per_element"),
        slice_overhead_s=overheads.get("slice_overhead_us", 0.0),
        frame_overhead_s=overheads.get("frame_overhead_us", 0.0),
        exchange_overhead_s=overheads.get("exchange_overhead_us", 0.0),
        host_cores=int(_figure(entry, "host_cores", name)[0]) if "host_cores" in entry else None,
        linear_thread_speedup=linear_speedup, attention_thread_speedup=attention_speedup,
    )


def _thread_speedups(entry: Mapping[str, Any], name: str, sources: dict[str, str]
                     ) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
    """A profile's `thread_speedup` ({value: {threads: {linear: {batch: x}, attention: x}},
    source}) as (the products' speedup by threads and batch, attention's by threads)."""
    if "thread_speedup" not in entry:
        return {}, {}
    fig = entry["thread_speedup"]
    shape = f"{name}: thread_speedup must be {{value: {{threads: {{linear: {{batch: x}}, attention: x}}}}, source}}"
    if not isinstance(fig, Mapping) or not isinstance(fig.get("value"), Mapping) or not fig.get("source"):
        raise CatalogueError(shape)
    linear: dict[int, dict[int, float]] = {}
    attention: dict[int, float] = {}
    for threads, figures in fig["value"].items():
        if not isinstance(figures, Mapping) or not isinstance(figures.get("linear"), Mapping) \
                or not figures["linear"] or "attention" not in figures:
            raise CatalogueError(shape)
        values = [float(x) for x in figures["linear"].values()] + [float(figures["attention"])]
        if any(x <= 0 for x in values):
            raise CatalogueError(f"{name}: thread_speedup figures must be positive")
        linear[int(threads)] = {int(b): float(x) for b, x in figures["linear"].items()}
        attention[int(threads)] = float(figures["attention"])
    sources["thread_speedup"] = fig["source"]
    return linear, attention


def load_catalogue(profile: Path | None = None) -> dict[str, Device]:
    """Every catalogue device by name, plus `this-machine` from `profile` (a JSON file whose
    "device" object is a catalogue entry) when it is given."""
    text = resources.files("lamina.planner").joinpath("catalogue.yaml").read_text()
    devices = {name: device_from_entry(name, entry) for name, entry in yaml.safe_load(text).items()}
    if profile is not None:
        entry = json.loads(Path(profile).read_text())["device"]
        devices[THIS_MACHINE] = device_from_entry(THIS_MACHINE, entry)
    return devices


@dataclass(frozen=True)
class HardwareOffer:
    """What the user lets the planner use: device kinds, each with at most `count` devices
    (None: as many as the workload and the budget call for)."""

    limits: Mapping[str, int | None]

    def allows(self, kind: str, count: int) -> bool:
        limit = self.limits.get(kind)
        return kind in self.limits and (limit is None or count <= limit)


def parse_hardware(spec: str, catalogue: Mapping[str, Device]) -> HardwareOffer:
    """`H100:8,H20:16` or `H100,H20` (names are matched case-insensitively)."""
    by_lower = {name.lower(): name for name in catalogue}
    limits: dict[str, int | None] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, count = part.partition(":")
        name = by_lower.get(kind.strip().lower())
        if name is None:
            hint = (" (this-machine needs a profile: run `lamina profile`)"
                    if kind.strip().lower() == THIS_MACHINE else "")
            raise ValueError(f"unknown hardware {kind!r}{hint} (catalogue: {', '.join(catalogue)})")
        if count and (not count.strip().isdigit() or int(count) <= 0):
            raise ValueError(f"bad count in {part!r}: expected a positive integer")
        limits[name] = int(count) if count else None
    if not limits:
        raise ValueError("no hardware given")
    return HardwareOffer(limits)
