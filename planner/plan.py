"""The planner's search: enumerate the layouts an offer of hardware can hold, estimate
each on the workload, rank them. Pure: catalogue, shapes and statistics in, ranked
estimates out."""

from __future__ import annotations

from collections.abc import Mapping

from lamina.planner.estimate import Estimate, Targets, estimate
from lamina.planner.hardware import Device, HardwareOffer
from lamina.planner.layouts import Layout, enumerate_layouts
from lamina.planner.rank import rank
from lamina.planner.shapes import ModelShape
from lamina.planner.workload import WorkloadStats

NO_TARGETS = Targets()  # frozen: safe to share as the default


def unit_limit(layout: Layout, offer: HardwareOffer) -> int | None:
    """How many copies of `layout` the offer's counts allow (None: no count given)."""
    limits = [limit // n for kind, n in layout.device_counts().items()
              if (limit := offer.limits.get(kind)) is not None]
    return min(limits) if limits else None


def plan(shape: ModelShape, offer: HardwareOffer, catalogue: Mapping[str, Device], stats: WorkloadStats,
         targets: Targets = NO_TARGETS, quantize: str = "any", disaggregate: bool = True,
         decode_only: bool = False) -> list[Estimate]:
    """Every layout that can run the workload, best first (see lamina.planner.rank)."""
    estimates = []
    for layout in enumerate_layouts(shape, offer, catalogue, quantize, disaggregate):
        e = estimate(shape, layout, catalogue, stats, targets, unit_limit(layout, offer), decode_only)
        if e is not None:
            estimates.append(e)
    return rank(estimates)
