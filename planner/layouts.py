"""Deployment layouts and the pure policy that enumerates the candidates for an offer of
hardware: colocated replicas (one tensor-parallel group holds weights and KV) and
model-attention disaggregated units (M model workers of one kind, N micro-batches, an
attention pool of n workers of a kind, partitioned by heads or by requests), each with
a choice of weight and KV precision."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from lamina.planner.hardware import Device, HardwareOffer
from lamina.planner.perf.memory import min_tensor_parallel
from lamina.planner.perf.quantization import FP16, INT4, Precision
from lamina.planner.shapes import ModelShape

MODEL_WORKER_COUNTS = (1, 2, 4)
ATTENTION_WORKER_COUNTS = (1, 2, 4, 8, 16, 32, 64)
# Colocated replicas keep this fraction of usable memory free for KV when choosing tp.
COLOCATED_KV_HEADROOM = 0.2

QUANTIZATION_CHOICES: dict[str, tuple[tuple[Precision, Precision], ...]] = {
    "none": ((FP16, FP16),),
    "weights": ((FP16, FP16), (INT4, FP16)),
    "kv": ((FP16, FP16), (FP16, INT4)),
    "any": ((FP16, FP16), (INT4, FP16), (FP16, INT4), (INT4, INT4)),
}


@dataclass(frozen=True)
class Layout:
    """One unit of deployment; the planner runs `replicas` copies of it."""

    model_device: str
    tp: int  # devices per model worker (tensor parallelism)
    model_workers: int = 1  # M
    attention_device: str | None = None  # None: colocated, attention on the model devices
    attention_workers: int = 0  # n
    micro_batches: int = 1  # N
    partition: str | None = None  # "head" or "request" (disaggregated only)
    weights: Precision = FP16
    kv: Precision = FP16
    # Every service on one host, sharing its cores (`lamina up` on one machine, as the
    # validation runs it); never a planner candidate, whose workers are devices of their own.
    shared_host: bool = False
    # The model worker and its attention workers on one accelerator (the model device),
    # taking turns on its memory: bench/gpu_decode.py's stack, what its validation
    # predicts; never a planner candidate either.
    shared_device: bool = False
    # A CPU model worker's compute threads (its products and, colocated, its attention),
    # each thread count with its measured speedup (Device.linear_speedup); 1 on a GPU.
    threads: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.model_workers < 1 or self.micro_batches < 1 or self.threads < 1:
            raise ValueError("tp, model workers, micro-batches and threads must be positive")
        if (self.attention_device is None) != (self.attention_workers == 0):
            raise ValueError("an attention device needs attention workers, and only then")
        if self.shared_device and self.attention_device != self.model_device:
            raise ValueError("a shared device runs the model and the attention workers: name it for both")

    @property
    def is_disaggregated(self) -> bool:
        return self.attention_device is not None

    def device_counts(self) -> dict[str, int]:
        counts = {self.model_device: self.model_workers * self.tp}
        if self.attention_device is not None:
            counts[self.attention_device] = counts.get(self.attention_device, 0) + self.attention_workers
        return counts

    def usd_per_hour(self, catalogue: Mapping[str, Device]) -> float:
        return sum(catalogue[kind].usd_per_hour * n for kind, n in self.device_counts().items())

    def describe(self) -> str:
        tp = f"(tp{self.tp})" if self.tp > 1 else ""
        quant = f"w={self.weights.name} kv={self.kv.name}"
        if not self.is_disaggregated:
            threads = f" T={self.threads}" if self.threads > 1 else ""
            return f"colocated {self.model_device}{tp}{threads} {quant}"
        return (f"disagg M={self.model_workers}x{self.model_device}{tp} "
                f"A={self.attention_workers}x{self.attention_device} N={self.micro_batches} "
                f"{self.partition} {quant}")


def partition_for(shape: ModelShape, attention_workers: int) -> str:
    """Head-level partitioning when the KV heads split evenly over the workers (no
    imbalance, no combining), request-level otherwise."""
    return "head" if shape.num_kv_heads % attention_workers == 0 else "request"


def _tp_options(shape: ModelShape, device: Device, weights: Precision, headroom: float) -> list[int]:
    tp = min_tensor_parallel(shape, device.memory_bytes, weights, headroom)
    if tp is None:
        return []
    wider = 2 * tp
    return [tp] + ([wider] if wider <= 8 and shape.num_kv_heads % wider == 0 else [])


def _micro_batch_options(model_workers: int) -> tuple[int, ...]:
    # N = M: one micro-batch per model worker; N = M + 1: Lamina's rotational pipeline.
    return (model_workers, model_workers + 1)


def enumerate_layouts(shape: ModelShape, offer: HardwareOffer, catalogue: Mapping[str, Device],
                      quantize: str = "any", disaggregate: bool = True) -> list[Layout]:
    """Every candidate unit the offer can hold once (device counts within its limits)."""
    kinds = list(offer.limits)
    out: list[Layout] = []
    for weights, kv in QUANTIZATION_CHOICES[quantize]:
        for kind in kinds:
            for tp in _tp_options(shape, catalogue[kind], weights, COLOCATED_KV_HEADROOM):
                out.append(Layout(kind, tp, weights=weights, kv=kv))
        if not disaggregate:
            continue
        for model_kind in kinds:
            for tp in _tp_options(shape, catalogue[model_kind], weights, 0.0):
                out.extend(_disaggregated(shape, model_kind, tp, kinds, weights, kv))
    return [layout for layout in out if _fits(layout, offer)]


def _disaggregated(shape: ModelShape, model_kind: str, tp: int, kinds: Iterable[str],
                   weights: Precision, kv: Precision) -> Iterable[Layout]:
    for attention_kind in kinds:
        for m in MODEL_WORKER_COUNTS:
            for n_micro in _micro_batch_options(m):
                for n_attn in ATTENTION_WORKER_COUNTS:
                    yield Layout(model_kind, tp, m, attention_kind, n_attn, n_micro,
                                 partition_for(shape, n_attn), weights, kv)


def _fits(layout: Layout, offer: HardwareOffer) -> bool:
    return all(offer.allows(kind, n) for kind, n in layout.device_counts().items())
