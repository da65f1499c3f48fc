"""`lamina up --layout auto` where the services compute on one GPU: the layouts ranked on
that GPU's figures, not on the host CPU's profile.

With every service on one GPU (`lamina up --device cuda`), `lamina up` can start the
same layouts as on the host's cores: colocated (the model worker attends on the GPU
itself) and disaggregated with 1 or 2 attention workers and 1 or 2 micro-batches, every
worker on that GPU and exchanging over cuda_ipc (`Layout.shared_device`). The figures
are the device profile `lamina profile --device` wrote for this GPU (its measured
products, attention, overheads and cuda_ipc round trip) where there is one, else the
catalogue's entry of the GPU's kind (named in the GPU's name: "NVIDIA H100 80GB HBM3" is
the catalogue's H100), with cuda_ipc's link assumed. On one device the planner ranks
colocated first for every GPU of the catalogue (the split adds its exchanges to each
layer and, with two micro-batches, a second read of the weights per step:
docs/planner.md), so a GPU that neither a profile nor the catalogue knows gets colocated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lamina.planner.hardware import Device, device_from_entry, load_catalogue
from lamina.planner.layouts import Layout
from lamina.planner.local_layout import (
    ATTENTION_WORKER_CHOICES,
    MICRO_BATCH_CHOICES,
    LocalChoice,
    LocalWorkload,
    rank_candidates,
)
from lamina.planner.perf.quantization import Precision
from lamina.planner.shapes import ModelShape

GPU = "this-gpu"  # the catalogue name the ranking gives the GPU
# cuda_ipc between services on one GPU where no device profile measured it: a 40 us round
# trip and 400 Gbit/s at 1 MiB (as cuda_link reads a profile: bytes/s and seconds one way).
ASSUMED_CUDA_IPC = (400 / 2 * 1e9 / 8, 40e-6 / 2)
_ASSUMED = f"cuda_ipc assumed at {2e6 * ASSUMED_CUDA_IPC[1]:.0f} us a round trip"


def cuda_link(prof: Mapping[str, Any]) -> tuple[float, float] | None:
    """(bytes/s one way, seconds one way) of cuda_ipc on a device profile's GPU, from its
    round trips of CUDA tensors (`cuda_ipc_device`: the ring copies, their waits and frames,
    in one process) else of CPU tensors between processes (`cuda_ipc`); None where the
    profile measured neither."""
    transports = prof.get("measurements", {}).get("transports", {})
    for name in ("cuda_ipc_device", "cuda_ipc"):
        figures = transports.get(name, {})
        if "rtt_us_64B" in figures and "gbit_s_1MiB" in figures:
            return figures["gbit_s_1MiB"] / 2 * 1e9 / 8, figures["rtt_us_64B"] / 2 * 1e-6
    return None


def catalogue_kind(gpu_name: str, kinds: Iterable[str]) -> str | None:
    """The catalogue kind a GPU's name names as one of its words ("NVIDIA H200" is H200,
    not H20); None when it names none (or several)."""
    words = {w for w in re.split(r"[^A-Z0-9]+", gpu_name.upper()) if w}
    hits = [k for k in kinds if k.upper() in words and k.upper() != "CPU"]
    return hits[0] if len(hits) == 1 else None


@dataclass(frozen=True)
class GpuFigures:
    """What the ranking knows of the GPU, and whence (for the line lamina up prints)."""

    device: Device  # named GPU
    link: tuple[float, float]  # cuda_ipc: bytes/s and seconds one way
    source: str


def device_profile_paths(profile: Path, device: str) -> list[Path]:
    """Where `lamina profile --device` writes the profile of `device` ("cuda", "cuda:N"),
    beside the host's `profile`: profile-cuda.json or profile-cudaN.json (cuda:0 either)."""
    names = [device.replace(":", "")]
    if device in ("cuda", "cuda:0"):
        names = ["cuda0", "cuda"]
    return [profile.with_name(f"profile-{name}.json") for name in names]


def gpu_figures(gpu_name: str, profiles: Iterable[Path]) -> GpuFigures | None:
    """The first of `profiles` that exists and measured a GPU of this name, else the
    catalogue's entry for its kind with cuda_ipc assumed; None when neither knows it."""
    for path in profiles:
        try:
            prof = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # none there, or unreadable: the catalogue's figures serve
        if not (isinstance(prof, dict) and prof.get("measurements", {}).get("device") == gpu_name):
            continue  # another GPU's
        link = cuda_link(prof)
        source = f"device profile {path}" + ("" if link else f", {_ASSUMED}")
        return GpuFigures(device_from_entry(GPU, prof["device"]), link or ASSUMED_CUDA_IPC, source)
    catalogue = load_catalogue()
    kind = catalogue_kind(gpu_name, catalogue)
    if kind is None:
        return None
    return GpuFigures(replace(catalogue[kind], name=GPU), ASSUMED_CUDA_IPC,
                      f"the catalogue's {kind}, {_ASSUMED}")


def rank_gpu_layouts(figures: GpuFigures, shape: ModelShape, weights: Precision, kv: Precision,
                     workload: LocalWorkload, device: str) -> list[LocalChoice]:
    """Every layout `lamina up` can start with all its services on the one GPU `device`,
    fastest first for `workload`: colocated, and disaggregated (request partitioning) with
    each number of attention workers and micro-batches, exchanging over cuda_ipc."""
    catalogue: dict[str, Any] = dict(load_catalogue())
    link_bw, link_latency = figures.link
    catalogue[GPU] = replace(figures.device, name=GPU, network_bw=link_bw, network_latency=link_latency)
    candidates = [("colocated", 0, 1, "", Layout(GPU, 1, weights=weights, kv=kv))]
    candidates += [("disaggregated", a, n, "", Layout(GPU, 1, 1, GPU, a, n, "request", weights, kv,
                                                      shared_device=True))
                   for a in ATTENTION_WORKER_CHOICES for n in MICRO_BATCH_CHOICES]
    return rank_candidates(candidates, shape, catalogue, workload, device)
