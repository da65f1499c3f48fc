"""Prometheus metrics of one gateway app, in a registry of its own (no global state).

Queue gauges read the backend's `stats()` at scrape time, so they are never stale
and cost nothing per request.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lamina.gateway.backend import Backend

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, backend: Backend, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("lamina_gateway_requests", "HTTP requests by route and status.",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("lamina_gateway_prompt_tokens", "Prompt tokens of admitted requests.",
                                     ["model"], registry=r).labels(model_name)
        self.generation_tokens = Counter("lamina_gateway_generation_tokens", "Tokens generated.",
                                         ["model"], registry=r).labels(model_name)
        self.time_to_first_token = Histogram(
            "lamina_gateway_time_to_first_token_seconds", "From request arrival to the first generated token.",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.inter_token_latency = Histogram(
            "lamina_gateway_inter_token_latency_seconds",
            "Between successive tokens of one choice of a request (an event of k tokens counts k gaps of 1/k each).",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.request_latency = Histogram(
            "lamina_gateway_request_latency_seconds", "From arrival to the last token of a finished request.",
            ["model"], buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.requests_in_flight = Gauge("lamina_gateway_requests_in_flight",
                                        "Generation requests the gateway is serving.", registry=r)
        waiting = Gauge("lamina_backend_requests_waiting", "Requests waiting in the backend's queue.", registry=r)
        waiting.set_function(lambda: backend.stats().num_waiting)
        running = Gauge("lamina_backend_requests_running", "Requests the backend is running.", registry=r)
        running.set_function(lambda: backend.stats().num_running)

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def observe_tokens(self, num_tokens: int, gap_seconds: float | None) -> None:
        """Count `num_tokens` new tokens; `gap_seconds` since the same choice's previous
        event (None for its first)."""
        self.generation_tokens.inc(num_tokens)
        if gap_seconds is not None and num_tokens:
            per_token = gap_seconds / num_tokens
            for _ in range(num_tokens):
                self.inter_token_latency.observe(per_token)

    def render(self) -> bytes:
        return generate_latest(self.registry)
