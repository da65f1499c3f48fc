"""The ranking policy: a pure function from estimates to their order.

Configurations that meet every target (TBT, TTFT, the demand within the hardware limits
and budget) come first, cheapest per million output tokens first, ties broken by higher
throughput; the rest follow in the same order, fewest shortfalls first.
"""

from __future__ import annotations

from collections.abc import Iterable

from lamina.planner.estimate import Estimate


def rank(estimates: Iterable[Estimate]) -> list[Estimate]:
    return sorted(estimates, key=lambda e: (len(e.shortfalls), e.usd_per_mtok, -e.throughput_tok_s,
                                            e.layout.describe()))
