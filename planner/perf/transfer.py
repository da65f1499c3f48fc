"""Transfer time: a message costs latency + bytes / bandwidth (the Hockney model), and
what crosses between model and attention workers per layer.

Lamina's communication analysis: per layer and micro-batch the model worker sends each
request's new Q, K and V (sent early: Q first) and receives the attention output, a few
kilobytes per request, so the bandwidth needed grows with the batch but not with the
context; its network section measures the latency term (FHBN 33 us ping-pong).
"""

from __future__ import annotations

from dataclasses import dataclass

from lamina.planner.shapes import ModelShape

ACTIVATION_BYTES = 2


def link_time(num_bytes: float, bandwidth: float, latency: float) -> float:
    """One message of `num_bytes` over a link of `bandwidth` bytes/s and one-way `latency` s."""
    if bandwidth <= 0:
        raise ValueError("bandwidth must be positive")
    return latency + num_bytes / bandwidth if num_bytes > 0 else 0.0


def allreduce_time(num_bytes: float, devices: int, bandwidth: float, latency: float) -> float:
    """A ring all-reduce of `num_bytes` over `devices` devices: each sends and receives
    2 (d - 1) / d of the data; 0 on one device."""
    if devices <= 1:
        return 0.0
    return latency + 2 * (devices - 1) / devices * num_bytes / bandwidth


@dataclass(frozen=True)
class LayerTraffic:
    """Bytes between the model worker and the attention pool for one micro-batch, one layer."""

    to_attention: float  # Q, K and V of each request's new token
    to_model: float  # the attention output

    @property
    def total(self) -> float:
        return self.to_attention + self.to_model


def layer_traffic(shape: ModelShape, batch: int) -> LayerTraffic:
    down = batch * (shape.q_size + 2 * shape.kv_size) * ACTIVATION_BYTES
    up = batch * shape.q_size * ACTIVATION_BYTES
    return LayerTraffic(down, up)


def layer_transfer_s(traffic: LayerTraffic, bandwidth: float, latency: float) -> float:
    """Both directions of one layer's exchange, one after the other (the attention needs
    the K, V first and the model worker the output after)."""
    return link_time(traffic.to_attention, bandwidth, latency) + link_time(traffic.to_model, bandwidth, latency)
