"""What the live dashboard (`/dashboard`) shows, as one JSON snapshot.

A snapshot holds cumulative figures (counters, histogram sums and counts) and the
cluster's state at one instant; the page turns two snapshots into rates and means
over the time between them, so the server keeps no history and any number of pages
can poll it.

The gateway's own figures are read from its Prometheus registry (gateway/metrics.py),
so the page and `/metrics` never disagree. The cluster's (services and their health,
each attention worker's KV, each prefill worker's prefix-cache blocks per tier, the
scheduler's queue and decode steps) come from the function the gateway was built with
(the stack's gateway passes `lamina status`'s `read_status`); `ClusterView` asks it at
most once per `max_age_s`, however many pages poll, so the cluster is not asked once
per page and second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

# The routes whose requests the dashboard counts (not its own polls, nor /metrics).
GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})

ClusterReader = Callable[[], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class ClusterReading:
    status: dict[str, Any] | None  # None: unavailable, and `error` says why
    error: str | None
    read_at: float  # time.time() of the reading


class ClusterView:
    """The cluster's state as `reader` returns it, cached for `max_age_s`.

    `reader` None: the gateway has no cluster to read (an embedded gateway). A reader
    that fails or takes longer than `timeout_s` gives a reading with the error, so the
    page says why the figures are missing instead of showing stale ones. Touched only
    from the event loop; the lock makes concurrent polls share one read.
    """

    def __init__(self, reader: ClusterReader | None, max_age_s: float = 1.0, timeout_s: float = 5.0) -> None:
        self._reader = reader
        self._max_age_s = max_age_s
        self._timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._last: ClusterReading | None = None

    async def read(self) -> ClusterReading:
        if self._reader is None:
            return ClusterReading(None, "this gateway was started without a cluster to read (no metadata store); "
                                        "only its own figures are shown", time.time())
        async with self._lock:
            last = self._last
            if last is not None and time.time() - last.read_at < self._max_age_s:
                return last
            try:
                status = await asyncio.wait_for(self._reader(), self._timeout_s)
                reading = ClusterReading(status, None, time.time())
            except TimeoutError:
                reading = ClusterReading(None, f"the cluster did not answer within {self._timeout_s:g} s", time.time())
            except Exception as exc:  # Redis down, a refused connection: shown on the page, not raised
                log.debug("dashboard: cluster status unavailable", exc_info=True)
                reading = ClusterReading(None, f"{type(exc).__name__}: {exc}", time.time())
            self._last = reading
            return reading


def gateway_figures(registry: CollectorRegistry, model: str) -> dict[str, Any]:
    """The gateway's cumulative figures, from its Prometheus registry."""
    requests = 0.0
    for family in registry.collect():
        if family.name == "lamina_gateway_requests":
            requests = sum(s.value for s in family.samples
                           if s.name.endswith("_total") and s.labels.get("route") in GENERATION_ROUTES)

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    def histogram(name: str) -> dict[str, float]:
        return {"sum": value(f"{name}_sum", model=model), "count": value(f"{name}_count", model=model)}

    return {
        "requests": requests,  # generation requests answered (any status)
        "generation_tokens": value("lamina_gateway_generation_tokens_total", model=model),
        "prompt_tokens": value("lamina_gateway_prompt_tokens_total", model=model),
        "in_flight": value("lamina_gateway_requests_in_flight"),
        "waiting": value("lamina_backend_requests_waiting"),
        "running": value("lamina_backend_requests_running"),
        "time_to_first_token": histogram("lamina_gateway_time_to_first_token_seconds"),
        "inter_token_latency": histogram("lamina_gateway_inter_token_latency_seconds"),
    }


def snapshot(gateway: dict[str, Any], cluster: ClusterReading, now: float) -> dict[str, Any]:
    """The JSON the page polls: `time` (unix seconds), `gateway` (gateway_figures),
    `cluster` (the reader's status, or null) and `cluster_error` (why it is null)."""
    return {"time": now, "gateway": gateway, "cluster": cluster.status, "cluster_error": cluster.error,
            "cluster_read_at": cluster.read_at}
