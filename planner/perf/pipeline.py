"""The staggered pipeline: decode step time with N micro-batches and M model workers
sharing one attention pool (Lamina's execution pipelining, with its rotational form).

Per layer each micro-batch needs, in order: its model slice on a model worker (t_m), the
exchange with the attention pool (t_x), attention (t_a). Resources serve the N
micro-batches concurrently, so a layer of all N micro-batches takes

    period = max(t_m + t_x + t_a,      # one micro-batch's dependency chain
                 N * t_m / M,          # the model workers, busy with every micro-batch
                 N * t_a,              # the attention pool, likewise
                 N * t_x_bytes,        # the link's bytes (latency overlaps)
                 N * w / C,            # services sharing C cores of one host: all their work w
                 N * d)                # services sharing one accelerator: its work d on both sides

and a step (one token for every request of every micro-batch) takes L * period plus
the LM head of each micro-batch on its model worker. With N = 1 nothing overlaps; with
N = M + 1 (rotational) the attention pool is kept busy even if t_m > t_a. Colocated
serving is the special case where model and attention share one device: their times add.
So do they when a model worker and its attention workers are processes on one GPU (the
stack of bench/gpu_decode.py): each micro-batch's slice reads every weight again and
each attention worker its share of the KV, from the one memory, so micro-batches there
hide the exchanges' latency but add weight reads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageTimes:
    """Per layer, one micro-batch."""

    model_s: float
    attention_s: float
    transfer_s: float  # both directions, latency included
    transfer_bytes_s: float  # the bandwidth part of transfer_s
    head_s: float = 0.0  # once per step, per micro-batch
    # Every service on one host's cores (`lamina up` on one machine): the CPU work of all
    # processes for one micro-batch and layer, and the cores they share (0: separate devices).
    host_cpu_s: float = 0.0
    host_cores: int = 0
    # Model and attention workers on one accelerator: its work for one micro-batch and
    # layer (the slice, and every attention worker's part; 0: devices of their own).
    device_s: float = 0.0


@dataclass(frozen=True)
class PipelineStep:
    step_s: float
    period_s: float
    bottleneck: str  # "chain", "model", "attention", "network", "host cpu" or "device"


def pipeline_step(stages: StageTimes, num_layers: int, micro_batches: int, model_workers: int) -> PipelineStep:
    if micro_batches < 1 or model_workers < 1 or num_layers < 1:
        raise ValueError("layers, micro-batches and model workers must be positive")
    n, m = micro_batches, model_workers
    terms = {
        "chain": stages.model_s + stages.transfer_s + stages.attention_s,
        "model": n * stages.model_s / m,
        "attention": n * stages.attention_s,
        "network": n * stages.transfer_bytes_s,
    }
    if stages.host_cores:
        terms["host cpu"] = n * stages.host_cpu_s / stages.host_cores
    if stages.device_s:
        terms["device"] = n * stages.device_s
    bottleneck = max(terms, key=terms.__getitem__)
    period = terms[bottleneck]
    head = stages.head_s * max(1.0, n / m)
    return PipelineStep(num_layers * period + head, period, bottleneck)


def colocated_step(model_layer_s: float, attention_layer_s: float, head_s: float, num_layers: int) -> float:
    """One device (group) runs everything in turn: no overlap."""
    return num_layers * (model_layer_s + attention_layer_s) + head_s
