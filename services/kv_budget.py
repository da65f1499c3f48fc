"""How much KV each attention core holds when `attention.kv_capacity_bytes` is 0 (auto, the default).

On the CPU, 1 GiB (`CPU_KV_BYTES`), as before there was an auto. On a GPU, what the stack's
processes there leave of its memory, as vLLM's `gpu_memory_utilization` does for one
process: they may use `attention.gpu_memory_utilization` of it (0.9 by default); from that
come the weights of each prefill and model worker on that GPU (in its dtype), each such
prefill worker's device tier of the prefix cache (`prefill.cache_device_bytes`) and a
reserve for each process there (its CUDA context, cuBLAS workspaces, activations and the
CUDA graphs' memory pools: `PROCESS_RESERVE_BYTES`); the rest is divided equally among the
KV holders on it (the attention workers, as many as the pool may grow to, or colocated
each model worker's own core). It is computed from the configuration and the GPU's total
memory alone, not from what is free when the process starts: the services start at once,
and a figure that depended on which of them had loaded its weights yet would differ from
start to start. A Stack (`lamina up`: every service on this host) counts all of its
services there and writes the bytes into the configuration its services read
(`with_kv_budget`); a service started on its own (Kubernetes, Ray, by hand) counts only
its own process, its peers being elsewhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lamina.model.config import ModelConfig
from lamina.services.config import (
    ConfigError,
    ModelWorkerSection,
    PrefillSection,
    StackConfig,
    canonical_device,
)

CPU_KV_BYTES = 1 << 30
# Per process on a GPU: the CUDA context (about 0.5 GiB), cuBLAS and Triton workspaces,
# a step's activations and the decode slices' CUDA graph pools.
PROCESS_RESERVE_BYTES = 2 << 30
# Less KV than this per core is refused: a stack that could hold a few sequences at best.
MIN_KV_BYTES = 64 << 20
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_GIB = float(1 << 30)


def same_device(a: str, b: str) -> bool:
    """Whether two device settings name one device (canonical_device)."""
    return canonical_device(a) == canonical_device(b)


@dataclass(frozen=True)
class KvBudget:
    """Each KV holder's bytes on one device, and how they were counted (for the log)."""

    per_holder: int
    why: str


def kv_budget(config: StackConfig, num_params: int, total_bytes: int | None, whole_host: bool = True) -> KvBudget:
    """The KV bytes each attention core of `config` holds on `attention.device`, whose
    total memory is `total_bytes` (None on the CPU); `num_params`: the model's weights.
    `whole_host`: every service of the stack runs on this host, as a Stack (lamina up)
    starts them, so all of them on that device count; else only the process asking (an
    attention worker, or colocated a model worker with its core) started on its own,
    its peers elsewhere (Kubernetes, Ray, by hand). ConfigError where the GPU's memory
    leaves less than MIN_KV_BYTES a holder."""
    att = config.attention
    if att.kv_capacity_bytes:
        return KvBudget(att.kv_capacity_bytes, "attention.kv_capacity_bytes")
    if total_bytes is None or att.device == "cpu":
        return KvBudget(CPU_KV_BYTES, "auto: 1 GiB on the CPU")
    here = att.device
    weights = 0
    parts = []
    processes = 0
    holding: list[tuple[str, PrefillSection | ModelWorkerSection, int]] = (
        [("prefill", config.prefill, config.prefill.workers)] if whole_host else [])
    if whole_host or config.colocated:  # on its own, a colocated core's process holds the model worker's weights
        holding.append(("model", config.model_worker, config.model_worker.workers if whole_host else 1))
    for kind, section, workers in holding:
        if same_device(section.device, here):
            weights += workers * num_params * _DTYPE_BYTES[section.compute_dtype]
            parts.append(f"{workers} {kind} worker(s)' weights in {section.compute_dtype}")
        if same_device(section.device, here) or (kind == "model" and config.colocated):
            processes += workers  # a colocated model worker has a context on its core's device
    if whole_host and same_device(config.prefill.device, here) and config.prefill.cache_device_bytes:
        weights += config.prefill.workers * config.prefill.cache_device_bytes
        parts.append("their prefix caches' device tier")
    # An elastic pool's workers that may join later take their share too.
    holders = att.pool_limit if whole_host else 1
    if not config.colocated:
        processes += holders
    reserve = processes * PROCESS_RESERVE_BYTES
    usable = att.gpu_memory_utilization * total_bytes
    per_holder = int((usable - weights - reserve) // holders) >> 20 << 20  # whole MiB
    why = (f"auto: {att.gpu_memory_utilization:g} of {total_bytes / _GIB:.1f} GiB on {here}, less "
           f"{weights / _GIB:.1f} GiB ({', '.join(parts) or 'no weights there'}) and "
           f"{reserve / _GIB:.1f} GiB for {processes} process(es), over {holders} KV holder(s)"
           + ("" if whole_host else ", counting only this process"))
    if per_holder < MIN_KV_BYTES:
        raise ConfigError(f"attention.kv_capacity_bytes {why}: {max(per_holder, 0) / _GIB:.2f} GiB each, less than "
                          f"{MIN_KV_BYTES >> 20} MiB; set attention.kv_capacity_bytes, or put a service on another "
                          "device")
    return KvBudget(per_holder, why)


def kv_budget_here(config: StackConfig, whole_host: bool = True, model: ModelConfig | None = None) -> KvBudget:
    """kv_budget on this host (`whole_host`: as kv_budget's): its attention device's total
    memory as torch reports it, the configured model's weights (`model`: its configuration
    where the caller has read it already)."""
    import torch

    from lamina.model.checkpoints import load_config
    from lamina.planner.shapes import ModelShape

    device = torch.device(config.attention.device)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    shape = ModelShape.of(model or load_config(config.model), "")
    return kv_budget(config, shape.num_params, total, whole_host)


def with_kv_budget(config: StackConfig) -> tuple[StackConfig, KvBudget | None]:
    """`config` with auto KV on a GPU made the bytes every service on this host counted
    (kv_budget_here, whole host), which a Stack writes for its services; (config, None)
    where there is nothing to count (a set capacity, or the CPU)."""
    att = config.attention
    if att.kv_capacity_bytes or att.device == "cpu":
        return config, None
    budget = kv_budget_here(config)
    return dataclasses.replace(config, attention=dataclasses.replace(att, kv_capacity_bytes=budget.per_holder)), budget
