"""What `lamina status` shows: every service of a cluster as its metadata store and its
own health check see it, the attention workers' KV occupancy, each prefill worker's
prefix cache and the scheduler's queue and decode steps. The gateway's dashboard
(`/dashboard`) shows the same object.

A prefill worker's blocks per tier are counted from its block records in the metadata
store (lamina.kvstore.block_publisher writes them); its prompt and cached tokens are the
figures it publishes there every second.

Read-only: it lists registrations and asks each service over gRPC (or the gateway over
HTTP); it changes nothing. Every question has the deadline `deadlines.health_s`, so a
stopped (SIGSTOP) or unreachable service costs one deadline, asked concurrently.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lamina.kvstore.metadata import MetadataConfig, MetadataStore, ServiceInfo
from lamina.services.channels import open_channel
from lamina.services.config import StackConfig
from lamina.services.protos import lamina_pb2, lamina_pb2_grpc

KINDS = ("attention", "model", "prefill", "scheduler", "gateway")  # the order the launcher starts them


@dataclass(frozen=True)
class ServiceStatus:
    kind: str
    name: str  # its service id (attention-0, prefill-0, ...)
    index: int | None
    pid: int | None  # None: not registered (it exited and was not, or not yet, restarted)
    host: str | None
    endpoint: str | None  # its data plane (a transport URL), or the gateway's HTTP address
    grpc: str | None  # its control plane's gRPC address (None: it has none, or is not registered)
    healthy: bool  # registered, and its health check answers SERVING (the gateway: /health 200)
    restarts: int  # times its launcher restarted it (metadata store, NS:restarts)
    device: str | None = None  # where it computes (prefill, model and attention workers: cpu, cuda:0, ...)


@dataclass(frozen=True)
class AttentionOccupancy:
    name: str
    num_sequences: int | None = None
    num_tokens: int | None = None
    capacity_tokens: int | None = None
    used_bytes: int | None = None
    capacity_bytes: int | None = None
    occupancy: float | None = None
    fragmentation: float | None = None
    error: str | None = None  # why the numbers are missing: "CODE: details" (the gRPC status)

    @property
    def error_code(self) -> str | None:
        """The gRPC status code's name of `error`."""
        return None if self.error is None else self.error.split(":", 1)[0]


UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.name
TIERS = ("device", "host", "disk")  # BlockRecord.tier 0, 1, 2


@dataclass(frozen=True)
class PrefixCacheStatus:
    name: str  # the prefill worker's service id
    tiers: dict[str, dict[str, int]]  # tier -> {"blocks": n, "bytes": b}, from its block records
    hit_tokens: int | None  # prompt tokens its cache served (not computed); None: no figures published
    prompt_tokens: int | None  # prompt tokens it prefilled
    # Prompt tokens whose KV it fetched from peer prefill workers (not computed, not in hit_tokens).
    fetched_tokens: int | None = None

    @property
    def hit_ratio(self) -> float | None:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens and self.hit_tokens is not None else None


@dataclass(frozen=True)
class ClusterStatus:
    services: list[ServiceStatus]
    attention: list[AttentionOccupancy]
    running: int | None  # None: the scheduler did not answer
    waiting: int | None
    prefix_cache: list[PrefixCacheStatus] = dataclasses.field(default_factory=list)
    # The scheduler's decode steps (one per micro-batch step a model worker reports) and
    # their mean batch (tokens per step) since it started; None: it did not answer.
    decode_steps: int | None = None
    mean_decode_batch: float | None = None
    scheduler_error: str | None = None  # why it did not answer: the gRPC status code's name

    @property
    def token_refused(self) -> bool:
        """Whether a service refused this reader's cluster token (services/auth.py): its
        figures are missing for want of the cluster's configuration, not for a fault."""
        codes = [self.scheduler_error, *(a.error_code for a in self.attention)]
        return UNAUTHENTICATED in codes

    def to_dict(self) -> dict:
        # used_tokens and sequences: the names the prefix-cache issue asked for, beside the older keys.
        return {"services": [dataclasses.asdict(s) for s in self.services],
                "attention": [{**dataclasses.asdict(a), "used_tokens": a.num_tokens, "sequences": a.num_sequences}
                              for a in self.attention],
                "prefix_cache": [dataclasses.asdict(p) for p in self.prefix_cache],
                "requests": {"running": self.running, "waiting": self.waiting},
                "decode": {"steps": self.decode_steps, "mean_batch_size": self.mean_decode_batch}}


async def prefix_cache_status(store: MetadataStore, name: str) -> PrefixCacheStatus:
    tiers = {t: {"blocks": 0, "bytes": 0} for t in TIERS}
    for r in await store.node_blocks(name):
        tier = tiers[TIERS[r.tier]]
        tier["blocks"] += 1
        tier["bytes"] += r.num_bytes
    stats = await store.get_stats("prefill", name) or {}
    return PrefixCacheStatus(name, tiers, stats.get("hit_tokens"), stats.get("prompt_tokens"),
                             stats.get("fetched_tokens"))


async def read_status(config: StackConfig) -> ClusterStatus:
    """The cluster's status; redis errors propagate (there is no cluster to show)."""
    async with MetadataStore(MetadataConfig(url=config.redis_url or "", namespace=config.namespace)) as store:
        infos = [info for kind in KINDS for info in await store.list_services(kind)]
        restarts = await store.restart_counts()
        caches = [await prefix_cache_status(store, info.service_id) for info in infos if info.kind == "prefill"]
    deadline = config.deadlines.health_s
    token = config.cluster_token
    healthy = await asyncio.gather(*(_is_healthy(info, token, deadline) for info in infos))
    services = [ServiceStatus(info.kind, info.service_id, _index(info.service_id, info.meta), info.meta.get("pid"),
                              info.meta.get("host"), info.endpoint, info.meta.get("grpc"), ok,
                              restarts.get(info.service_id, 0), info.meta.get("device"))
                for info, ok in zip(infos, healthy)]
    # A restarted service that is not registered (again) is down: show it too.
    registered = {info.service_id for info in infos}
    for service_id in sorted(set(restarts) - registered):
        kind = service_id.rsplit("-", 1)[0]
        services.append(ServiceStatus(kind, service_id, _index(service_id, {}), None, None, None, None, False,
                                      restarts[service_id]))
    services.sort(key=lambda s: (KINDS.index(s.kind) if s.kind in KINDS else len(KINDS), s.index or 0, s.name))
    attention = await asyncio.gather(*(_attention_occupancy(info, token, deadline)
                                       for info in infos if info.kind == "attention"))
    schedulers = [info for info in infos if info.kind == "scheduler"]
    s = await _scheduler_stats(schedulers[0], token, deadline) if schedulers else None
    if not isinstance(s, lamina_pb2.SchedulerStats):
        return ClusterStatus(services, list(attention), None, None, caches, scheduler_error=s)
    return ClusterStatus(services, list(attention), s.num_running, s.num_waiting, caches, s.num_steps,
                         s.mean_batch_size)


def _index(service_id: str, meta: dict) -> int | None:
    if isinstance(meta.get("index"), int):
        return meta["index"]
    suffix = service_id.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else None


async def _is_healthy(info: ServiceInfo, token: str | None, deadline_s: float) -> bool:
    if info.kind == "gateway":  # HTTP only: its /health answers 200 while it serves
        return await _http_ok(info.endpoint + "/health", deadline_s)
    address = info.meta.get("grpc")
    if not address:
        return False
    async with open_channel(address, token) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                    timeout=deadline_s)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def _http_ok(url: str, deadline_s: float) -> bool:
    import aiohttp  # the gateway's own dependency; only the gateway is asked over HTTP

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=deadline_s)) as session:
            async with session.get(url) as response:
                return response.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


async def _attention_occupancy(info: ServiceInfo, token: str | None, deadline_s: float) -> AttentionOccupancy:
    async with open_channel(info.meta.get("grpc", ""), token) as channel:
        try:
            s = await lamina_pb2_grpc.AttentionControlStub(channel).Stats(lamina_pb2.Empty(), timeout=deadline_s)
        except grpc.aio.AioRpcError as exc:
            return AttentionOccupancy(info.service_id, error=f"{exc.code().name}: {exc.details()}")
    return AttentionOccupancy(info.service_id, s.num_sequences, s.num_tokens, s.capacity_tokens, s.used_bytes,
                              s.capacity_bytes, s.occupancy, s.fragmentation)


async def _scheduler_stats(scheduler: ServiceInfo, token: str | None,
                           deadline_s: float) -> lamina_pb2.SchedulerStats | str:
    """Its figures, or why it did not answer (the gRPC status code's name)."""
    async with open_channel(scheduler.meta.get("grpc") or scheduler.endpoint, token) as channel:
        try:
            return await lamina_pb2_grpc.SchedulerStub(channel).Stats(lamina_pb2.Empty(), timeout=deadline_s)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
