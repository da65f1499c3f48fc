"""Redis metadata store: the one module that owns every key Lamina keeps in Redis.

Key layout (NS = MetadataConfig.namespace, default "lamina"):

  NS:epoch                  string  id written when this Redis is first used; if it is
                                    gone, Redis lost its data (restart) and owners of
                                    rebuildable state re-publish it
  NS:svc:KIND:ID            hash    one service: id, kind, endpoint, started_at, meta
                                    (JSON); expires after service_ttl_s unless a
                                    heartbeat refreshes it, so a dead service disappears
  NS:svcs:KIND              set     ids of services of that kind (members whose hash
                                    expired are pruned on read)
  NS:block:HASH             hash    prefix block: field NODE -> JSON {tier, bytes,
                                    last_access}, one field per node caching it
  NS:blocks:NODE            set     block hashes cached on NODE
  NS:req:RID:kv             hash    KV placement of a request: workers (JSON list),
                                    partition ("request" | "head"), slab_ranges (JSON
                                    {worker: [[start, end], ...]})
  NS:reqs                   set     request ids that have a placement
  NS:jrn:RID                hash    journal of a running request: prompt (JSON ids),
                                    params (base64 of its serialized sampling params),
                                    owner (the scheduler's id)
  NS:jrn:RID:out            list    its generated token ids, appended in batches
  NS:jrns                   set     request ids that have a journal entry
  NS:restarts               hash    service id -> how many times its launcher restarted
                                    it (services.launcher.Stack, reset when a stack starts)
  NS:events                 channel pub/sub: JSON {"type": ..., ...} for every change

Event types: service_registered, service_deregistered, blocks_stored, blocks_removed,
placement_set, placement_deleted, epoch_reset.

Every multi-key update (including its event) is one MULTI/EXEC transaction, so readers
never see a half-applied change. Connections retry on connection errors, so a restarted
Redis is reconnected on the next command; ServiceRegistration re-registers and calls
its rebuild hook when it finds the epoch gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


@dataclass(frozen=True)
class MetadataConfig:
    url: str
    namespace: str = "lamina"
    service_ttl_s: float = 10.0
    heartbeat_interval_s: float = 0.0  # 0: a third of the TTL

    def __post_init__(self) -> None:
        if not self.namespace or ":" in self.namespace:
            raise ValueError("namespace must be non-empty and contain no ':'")
        if self.service_ttl_s <= 0:
            raise ValueError("service_ttl_s must be positive")
        if self.heartbeat_interval_s < 0 or self.heartbeat_interval_s >= self.service_ttl_s:
            raise ValueError("heartbeat_interval_s must be in [0, service_ttl_s)")

    @property
    def heartbeat_s(self) -> float:
        return self.heartbeat_interval_s or self.service_ttl_s / 3


@dataclass(frozen=True)
class JournalEntry:
    """What a recovering scheduler needs to know of a request (metadata journal)."""

    request_id: str
    prompt_ids: list[int]
    params: str  # base64 of the serialized lamina_pb2.SamplingParams (seed included)
    owner: str  # the scheduler that admitted it
    output_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ServiceInfo:
    kind: str
    service_id: str
    endpoint: str
    started_at: float
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class BlockRecord:
    block_hash: str
    tier: int  # 0 device, 1 host, 2 disk
    num_bytes: int
    last_access: float


@dataclass(frozen=True)
class KVPlacement:
    workers: tuple[str, ...]
    partition: str  # "request" (whole requests per worker) or "head" (heads split)
    slab_ranges: dict[str, list[tuple[int, int]]]  # worker -> [start, end) slot runs

    def __post_init__(self) -> None:
        if self.partition not in ("request", "head"):
            raise ValueError(f"partition must be 'request' or 'head', got {self.partition!r}")


class MetadataStore:
    """Async access to the metadata keys. Owns its connection pool: `await close()`."""

    def __init__(self, config: MetadataConfig) -> None:
        self.config = config
        self.ns = config.namespace
        self.redis = aioredis.Redis.from_url(
            config.url, decode_responses=True,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 6),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            socket_connect_timeout=2)

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> "MetadataStore":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- keys ----

    @property
    def events_channel(self) -> str:
        return f"{self.ns}:events"

    def _epoch_key(self) -> str:
        return f"{self.ns}:epoch"

    def _svc_key(self, kind: str, service_id: str) -> str:
        return f"{self.ns}:svc:{kind}:{service_id}"

    def _svcs_key(self, kind: str) -> str:
        return f"{self.ns}:svcs:{kind}"

    def _block_key(self, block_hash: str) -> str:
        return f"{self.ns}:block:{block_hash}"

    def _node_blocks_key(self, node: str) -> str:
        return f"{self.ns}:blocks:{node}"

    def _req_key(self, request_id: str) -> str:
        return f"{self.ns}:req:{request_id}:kv"

    def _reqs_key(self) -> str:
        return f"{self.ns}:reqs"

    def _event(self, event_type: str, **fields) -> str:
        return json.dumps({"type": event_type, **fields})

    # ---- epoch: detecting a Redis that lost its data ----

    async def ensure_epoch(self) -> bool:
        """True if the epoch had to be created (first use, or Redis lost its data)."""
        is_new = await self.redis.set(self._epoch_key(), uuid.uuid4().hex, nx=True)
        if is_new:
            await self.redis.publish(self.events_channel, self._event("epoch_reset"))
        return bool(is_new)

    # ---- services ----

    async def register_service(self, kind: str, service_id: str, endpoint: str,
                               meta: dict | None = None) -> None:
        key = self._svc_key(kind, service_id)
        ttl_ms = int(self.config.service_ttl_s * 1000)
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(key)
            p.hset(key, mapping={"kind": kind, "id": service_id, "endpoint": endpoint,
                                 "started_at": repr(time.time()),
                                 "meta": json.dumps(meta or {})})
            p.pexpire(key, ttl_ms)
            p.sadd(self._svcs_key(kind), service_id)
            p.publish(self.events_channel, self._event(
                "service_registered", kind=kind, id=service_id, endpoint=endpoint))
            await p.execute()

    async def heartbeat(self, kind: str, service_id: str) -> bool:
        """Refreshes the TTL; False if the service's key is gone (expired or lost)."""
        ttl_ms = int(self.config.service_ttl_s * 1000)
        return bool(await self.redis.pexpire(self._svc_key(kind, service_id), ttl_ms))

    async def deregister_service(self, kind: str, service_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(self._svc_key(kind, service_id))
            p.srem(self._svcs_key(kind), service_id)
            p.publish(self.events_channel, self._event(
                "service_deregistered", kind=kind, id=service_id))
            await p.execute()

    async def list_services(self, kind: str) -> list[ServiceInfo]:
        ids = sorted(await self.redis.smembers(self._svcs_key(kind)))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as p:
            for service_id in ids:
                p.hgetall(self._svc_key(kind, service_id))
            rows = await p.execute()
        out, dead = [], []
        for service_id, row in zip(ids, rows):
            if not row:
                dead.append(service_id)
                continue
            out.append(ServiceInfo(kind, service_id, row["endpoint"],
                                   float(row["started_at"]), json.loads(row["meta"])))
        if dead:
            await self.redis.srem(self._svcs_key(kind), *dead)
        return out

    async def get_service(self, kind: str, service_id: str) -> ServiceInfo | None:
        """One service's registration; None when it is not (or no longer) registered."""
        row = await self.redis.hgetall(self._svc_key(kind, service_id))
        if not row:
            return None
        return ServiceInfo(kind, service_id, row["endpoint"], float(row["started_at"]), json.loads(row["meta"]))

    # ---- restarts of service processes (counted by their launcher) ----

    async def count_restart(self, service_id: str) -> int:
        """One more restart of `service_id`; returns its count so far."""
        return int(await self.redis.hincrby(f"{self.ns}:restarts", service_id, 1))

    async def restart_counts(self) -> dict[str, int]:
        """service id -> restarts, for the services restarted at least once."""
        return {k: int(v) for k, v in (await self.redis.hgetall(f"{self.ns}:restarts")).items()}

    async def reset_restart_counts(self) -> None:
        await self.redis.delete(f"{self.ns}:restarts")

    # ---- prefix blocks ----

    async def put_blocks(self, node: str, records: Iterable[BlockRecord]) -> None:
        records = list(records)
        if not records:
            return
        async with self.redis.pipeline(transaction=True) as p:
            for r in records:
                p.hset(self._block_key(r.block_hash), node, json.dumps(
                    {"tier": r.tier, "bytes": r.num_bytes, "last_access": r.last_access}))
            p.sadd(self._node_blocks_key(node), *(r.block_hash for r in records))
            p.publish(self.events_channel, self._event(
                "blocks_stored", node=node,
                blocks=[[r.block_hash, r.tier] for r in records]))
            await p.execute()

    async def remove_blocks(self, node: str, block_hashes: Iterable[str]) -> None:
        hashes = list(block_hashes)
        if not hashes:
            return
        async with self.redis.pipeline(transaction=True) as p:
            for h in hashes:
                p.hdel(self._block_key(h), node)
            p.srem(self._node_blocks_key(node), *hashes)
            p.publish(self.events_channel, self._event(
                "blocks_removed", node=node, blocks=hashes))
            await p.execute()

    async def clear_node_blocks(self, node: str) -> None:
        """Forgets every block of a node (it restarted with an empty cache, or died)."""
        await self.remove_blocks(node, await self.redis.smembers(self._node_blocks_key(node)))

    async def get_block(self, block_hash: str) -> dict[str, BlockRecord]:
        """node -> record, for every node caching the block."""
        row = await self.redis.hgetall(self._block_key(block_hash))
        out = {}
        for node, raw in row.items():
            d = json.loads(raw)
            out[node] = BlockRecord(block_hash, d["tier"], d["bytes"], d["last_access"])
        return out

    async def blocks_on(self, node: str) -> set[str]:
        return set(await self.redis.smembers(self._node_blocks_key(node)))

    # ---- request KV placement ----

    async def set_placement(self, request_id: str, placement: KVPlacement) -> None:
        key = self._req_key(request_id)
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(key)
            p.hset(key, mapping={
                "workers": json.dumps(list(placement.workers)),
                "partition": placement.partition,
                "slab_ranges": json.dumps({w: [list(r) for r in rs]
                                           for w, rs in placement.slab_ranges.items()})})
            p.sadd(self._reqs_key(), request_id)
            p.publish(self.events_channel, self._event(
                "placement_set", request=request_id, workers=list(placement.workers)))
            await p.execute()

    async def get_placement(self, request_id: str) -> KVPlacement | None:
        row = await self.redis.hgetall(self._req_key(request_id))
        if not row:
            return None
        ranges = {w: [tuple(r) for r in rs] for w, rs in json.loads(row["slab_ranges"]).items()}
        return KVPlacement(tuple(json.loads(row["workers"])), row["partition"], ranges)

    async def delete_placement(self, request_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(self._req_key(request_id))
            p.srem(self._reqs_key(), request_id)
            p.publish(self.events_channel, self._event("placement_deleted",
                                                       request=request_id))
            await p.execute()

    async def placed_requests(self) -> set[str]:
        return set(await self.redis.smembers(self._reqs_key()))

    # ---- request journal ----

    def _jrn_key(self, request_id: str) -> str:
        return f"{self.ns}:jrn:{request_id}"

    async def write_journal(self, started: Iterable[JournalEntry], tokens: dict[str, list[int]],
                            ended: Iterable[str]) -> None:
        """Apply one batch of journal changes in one transaction: requests that started,
        tokens generated since the last batch, requests that ended."""
        async with self.redis.pipeline(transaction=True) as p:
            for e in started:  # whole entries: tokens of the same batch follow
                p.delete(f"{self._jrn_key(e.request_id)}:out")
                p.hset(self._jrn_key(e.request_id), mapping={
                    "prompt": json.dumps(e.prompt_ids), "params": e.params, "owner": e.owner})
                p.sadd(f"{self.ns}:jrns", e.request_id)
            for rid, ids in tokens.items():
                if ids:
                    p.rpush(f"{self._jrn_key(rid)}:out", *ids)
            for rid in ended:
                p.delete(self._jrn_key(rid), f"{self._jrn_key(rid)}:out")
                p.srem(f"{self.ns}:jrns", rid)
            await p.execute()

    async def read_journal(self) -> list[JournalEntry]:
        """Every journaled request, with the tokens generated so far."""
        ids = sorted(await self.redis.smembers(f"{self.ns}:jrns"))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as p:
            for rid in ids:
                p.hgetall(self._jrn_key(rid))
                p.lrange(f"{self._jrn_key(rid)}:out", 0, -1)
            rows = await p.execute()
        out = []
        for rid, row, toks in zip(ids, rows[::2], rows[1::2]):
            if row:
                out.append(JournalEntry(rid, json.loads(row["prompt"]), row["params"], row["owner"],
                                        [int(t) for t in toks]))
        return out

    # ---- events ----

    @contextlib.asynccontextmanager
    async def subscribe(self) -> AsyncIterator["EventSubscription"]:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.events_channel)
        try:
            yield EventSubscription(pubsub)
        finally:
            await pubsub.unsubscribe(self.events_channel)
            await pubsub.aclose()


class EventSubscription:
    def __init__(self, pubsub) -> None:
        self._pubsub = pubsub

    async def next_event(self, timeout_s: float) -> dict | None:
        """The next event, or None if none arrives within timeout_s."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return None
            msg = await self._pubsub.get_message(ignore_subscribe_messages=True,
                                                 timeout=left)
            if msg is not None and msg["type"] == "message":
                return json.loads(msg["data"])


RebuildHook = Callable[[MetadataStore], Awaitable[None]]


class ServiceRegistration:
    """Registers a service and keeps it alive with a heartbeat task that it owns.

    `start()` registers and starts the task; `stop()` cancels and awaits it, then
    deregisters. When a heartbeat finds the key gone (TTL lapsed, or Redis restarted and
    lost it), the service registers again and runs `rebuild` so the owner re-publishes
    what it holds (e.g. its prefix blocks). Errors are logged and retried at the next
    beat; the task ends only when cancelled.
    """

    def __init__(self, store: MetadataStore, kind: str, service_id: str, endpoint: str,
                 meta: dict | None = None, rebuild: RebuildHook | None = None) -> None:
        self.store = store
        self.kind = kind
        self.service_id = service_id
        self.endpoint = endpoint
        self.meta = meta or {}
        self.rebuild = rebuild
        self.num_registrations = 0
        self.num_rebuilds = 0
        self.registered = asyncio.Event()  # set after every (re-)registration
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self._register(is_first=True)
        self._task = asyncio.create_task(self._beat(), name=f"heartbeat:{self.service_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            with contextlib.suppress(*REDIS_ERRORS):
                await self.store.deregister_service(self.kind, self.service_id)

    async def _register(self, is_first: bool) -> None:
        await self.store.ensure_epoch()
        await self.store.register_service(self.kind, self.service_id, self.endpoint, self.meta)
        # Re-publishing is idempotent, so rebuild on every re-registration: another
        # service may have re-created the epoch first after a restart.
        if not is_first and self.rebuild is not None:
            await self.rebuild(self.store)
            self.num_rebuilds += 1
        self.num_registrations += 1
        self.registered.set()

    async def _beat(self) -> None:
        # A periodic timer, not a wait for a condition: the TTL needs refreshing on time.
        while True:
            await asyncio.sleep(self.store.config.heartbeat_s)
            try:
                if not await self.store.heartbeat(self.kind, self.service_id):
                    await self._register(is_first=False)
            except REDIS_ERRORS as e:
                log.warning("heartbeat of %s failed: %s", self.service_id, e)
            except Exception:
                log.exception("re-registration of %s failed", self.service_id)
