"""What every service process does the same way: gRPC server with the standard
health protocol, Prometheus metrics, registration in the metadata store with a
heartbeat, signal handling and a fixed shutdown order.

Ownership: the runtime owns the gRPC server, the metrics HTTP server, the
heartbeat task and the task publishing the service's figures (`stats`, every
second, into the metadata store's NS:stats:KIND:ID); `close()` stops them in the
reverse order of start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from wsgiref.simple_server import WSGIServer

import grpc
import prometheus_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lamina.aio import cancel_and_wait
from lamina.kvstore.metadata import (
    REDIS_ERRORS,
    MetadataConfig,
    MetadataStore,
    RebuildHook,
    ServiceInfo,
    ServiceRegistration,
)
from lamina.services import stack_dumps, tracing
from lamina.services.addresses import host_port
from lamina.services.attention_members import membership
from lamina.services.auth import server_interceptors
from lamina.services.channels import SERVER_OPTIONS
from lamina.services.config import StackConfig

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 1.0  # how often a service's figures are written to the metadata store


class ServiceRuntime:
    def __init__(self, kind: str, service_id: str, config: StackConfig) -> None:
        if not config.redis_url:
            raise ValueError(f"{kind}: no Redis configured; set redis_url or REDIS_URL (lamina up does this)")
        self.kind = kind
        self.service_id = service_id
        self.config = config
        self.store = MetadataStore(MetadataConfig(url=config.redis_url, namespace=config.namespace))
        self.registry = prometheus_client.CollectorRegistry()
        # process_cpu_seconds_total, resident memory, open descriptors: the whole process's
        # cost beside each service's own counters (Linux only; elsewhere it exports nothing).
        prometheus_client.ProcessCollector(registry=self.registry)
        self.grpc_address: str | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self._metrics_server: WSGIServer | None = None
        self._registration: ServiceRegistration | None = None
        self._stats_task: asyncio.Task | None = None
        self._drained: Callable[[], Awaitable[None]] | None = None
        self.stopping = asyncio.Event()

    async def start_grpc(self, add_servicers: Callable[[grpc.aio.Server], None]) -> str:
        # Every call but the health service's must carry the cluster token (services/auth.py).
        server = grpc.aio.server(interceptors=server_interceptors(self.config.cluster_token, self.service_id),
                                 options=[("grpc.so_reuseport", 0), *SERVER_OPTIONS])
        add_servicers(server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        # Bound on `host` (a wildcard in a container), registered under the address peers reach.
        port = server.add_insecure_port(host_port(self.config.host, self.config.ports.grpc))
        await server.start()
        self._server = server
        self.grpc_address = host_port(self.config.advertised_host, port)
        return self.grpc_address

    def start_metrics(self) -> int:
        server, _thread = prometheus_client.start_http_server(self.config.ports.metrics, addr=self.config.host,
                                                              registry=self.registry)
        self._metrics_server = server
        self.metrics_port = server.server_port
        return self.metrics_port

    async def register(self, endpoint: str, meta: dict | None = None, rebuild: RebuildHook | None = None) -> None:
        meta = dict(meta or {})
        # pid and host: which process to look at (`lamina status`); a pid means something only on its host.
        meta.update({"grpc": self.grpc_address, "metrics_port": self.metrics_port, "pid": os.getpid(),
                     "host": socket.gethostname()})
        self._registration = ServiceRegistration(self.store, self.kind, self.service_id, endpoint, meta,
                                                 rebuild=rebuild)
        await self._registration.start()
        await self._set_serving(True)

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", self.kind):
            result = self._health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def serve(self, add_servicers: Callable[[grpc.aio.Server], None], endpoint: str | None = None,
                    meta: dict | None = None, rebuild: RebuildHook | None = None,
                    stats: Callable[[], dict] | None = None,
                    drained: Callable[[], Awaitable[None]] | None = None) -> None:
        """Start gRPC and metrics, register (under `endpoint`, default the gRPC
        address), serve until SIGINT/SIGTERM, then drain. `rebuild` runs after a
        re-registration that found the metadata store emptied (a restarted Redis);
        `stats()` gives the figures published every STATS_INTERVAL_S; `drained` runs
        at shutdown once the gRPC server has stopped, while the store is still open."""
        self.install_signal_handlers()
        await self.start_grpc(add_servicers)
        self.start_metrics()
        await self.register(endpoint or self.grpc_address or "", meta, rebuild)
        if stats is not None:
            self._stats_task = asyncio.create_task(self._publish_stats(stats), name=f"stats:{self.service_id}")
        self._drained = drained
        log.info("%s serving on %s", self.service_id, self.grpc_address)
        await self.stopping.wait()
        await self.close()

    async def _publish_stats(self, stats: Callable[[], dict]) -> None:
        # A periodic timer, not a wait for a condition: the figures expire unless refreshed.
        while True:
            try:
                await self.store.put_stats(self.kind, self.service_id, stats())
            except REDIS_ERRORS as exc:
                log.debug("%s: figures not published (%s)", self.service_id, exc)
            await asyncio.sleep(STATS_INTERVAL_S)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        stack_dumps.install(loop)
        tracing.install(loop, self.service_id)

    async def close(self) -> None:
        """Drain: stop being found, refuse new calls, finish in-flight ones, then stop."""
        try:
            await self._set_serving(False)
        except Exception:  # shutdown goes on: stopping the server below ends every call anyway
            log.warning("%s: health status not set to NOT_SERVING before stopping", self.service_id, exc_info=True)
        if self._stats_task is not None:
            await cancel_and_wait([self._stats_task])
        if self._registration is not None:
            try:
                await asyncio.wait_for(self._registration.stop(), timeout=5.0)
            except TimeoutError:
                log.warning("%s: could not deregister (Redis unreachable); its entry expires by TTL", self.service_id)
        if self._server is not None:
            await self._server.stop(grace=2.0)
        if self._drained is not None:
            try:
                await asyncio.wait_for(self._drained(), timeout=5.0)
            except Exception:  # shutdown goes on
                log.exception("%s: shutdown step failed", self.service_id)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        await self.store.close()


async def abort_for_remote_error(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Answer a gRPC call that failed on the data plane with the matching status."""
    from lamina.services.wire import RemoteError

    if isinstance(exc, RemoteError):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.code == "kv_full" else grpc.StatusCode.FAILED_PRECONDITION
        await context.abort(code, str(exc))
    await context.abort(grpc.StatusCode.UNAVAILABLE, f"attention worker unreachable: {exc}")


async def refresh_every_half_ttl(store: MetadataStore, refresh: Callable[[], Awaitable[None]], what: str) -> None:
    """Run `refresh` every half service TTL for as long as the caller's task runs: a
    periodic timer, since leases expire on Redis's clock and nothing here signals it. A
    failed round is logged; the next one tries again. (A cancellation that a Redis read
    under `refresh` loses is raised again by the store's client: lamina/aio.py.)"""
    interval = max(store.config.service_ttl_s / 2, 0.5)
    while True:
        await asyncio.sleep(interval)
        try:
            await refresh()
        except Exception as exc:  # noqa: BLE001 - the next round tries again
            log.warning("refreshing the %s failed: %s", what, exc)


async def workers_by_index(store: MetadataStore, kind: str, count: int, limit: int,
                           address: Callable[[ServiceInfo], str]) -> dict[int, str]:
    """Index -> `address(info)` of the registered workers of `kind` with indexes below
    `limit`, once `count` are registered: those waited for (even if one's entry lapsed
    since) and any other registered by now (a newer address wins). By index, not by
    position: in an elastic pool the first registered need not be 0 .. count - 1."""
    waited = await wait_for_services(store, kind, count)
    listed = [*waited, *await store.list_services(kind)]
    return membership({}, [(i.service_id, address(i)) for i in listed], limit).joined


async def wait_for_services(store: MetadataStore, kind: str, count: int, timeout_s: float = 120.0) -> list:
    """The first `count` registered services of `kind`, ordered by id; waits for them
    by following the metadata store's events (re-listing on each event)."""
    async with store.subscribe() as sub:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            services = sorted(await store.list_services(kind), key=lambda s: s.service_id)
            if len(services) >= count:
                return services[:count]
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise TimeoutError(f"only {len(services)} of {count} {kind} services registered "
                                   f"after {timeout_s:.0f} s")
            await sub.next_event(timeout_s=min(remaining, 1.0))
