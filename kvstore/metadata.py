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
                                    last_access, parent, tokens}, one field per node
                                    caching it (NODE: the prefill worker's service id)
  NS:blocks:NODE            set     block hashes cached on NODE
  NS:stats:KIND:ID          string  JSON figures a service publishes about itself every
                                    second (an attention worker's occupancy, a prefill
                                    worker's prompt and cached tokens); expires after
                                    service_ttl_s, so a dead service's figures go
  NS:req:RID:kv             hash    KV placement of a request: workers (JSON list),
                                    partition ("request" | "head"), slab_ranges (JSON
                                    {worker: [[start, end], ...]}), tokens (JSON
                                    {worker: tokens of KV held there})
  NS:reqs                   set     request ids that have a placement
  NS:jrn:RID                hash    journal of a running request: prompt (JSON ids),
                                    params (base64 of its serialized sampling params),
                                    owner (the scheduler's id)
  NS:jrn:RID:out            list    its generated token ids, appended in batches
  NS:jrns                   set     request ids that have a journal entry
  NS:restarts               hash    service id -> how many times its launcher restarted
                                    it (lamina.services.launch.launcher.Stack, reset when a stack starts)
  NS:events                 channel pub/sub: JSON {"type": ..., ...} for every change

Event types: service_registered, service_deregistered, blocks_stored, blocks_removed,
placement_set, placement_deleted, epoch_reset.

Every multi-key update (including its event) is one MULTI/EXEC transaction, or one Lua
script where it depends on what is there (pruning an expired service, updating
placements' token counts), so readers never see a half-applied change.

Prefix blocks are owned by their node: only that node's publisher writes its entries
(lamina.kvstore.block_publisher). They go when the node does: `list_services` finds a service
whose hash expired (its lease lapsed without a heartbeat) and removes its id and its
blocks in one script (so one that registered again meanwhile keeps both), a node that
stops removes its own, and a node that starts (or finds Redis emptied) replaces its
whole set with what its cache holds. Connections retry on connection errors, so a restarted
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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lamina.aio import raise_if_cancelled

log = logging.getLogger(__name__)

REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


@dataclass(frozen=True)
class MetadataConfig:
    url: str
    namespace: str = "lamina"
    service_ttl_s: float = 10.0
    heartbeat_interval_s: float = 0.0  # 0: a third of the TTL
    # A command's reply waited for at most this long: on a connection whose peer vanished
    # without a word (a cut link, a partition) it fails then, and is retried on a new
    # connection, instead of waiting the minutes TCP takes to give up.
    socket_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.namespace or ":" in self.namespace:
            raise ValueError("namespace must be non-empty and contain no ':'")
        if self.service_ttl_s <= 0:
            raise ValueError("service_ttl_s must be positive")
        if self.heartbeat_interval_s < 0 or self.heartbeat_interval_s >= self.service_ttl_s:
            raise ValueError("heartbeat_interval_s must be in [0, service_ttl_s)")
        if self.socket_timeout_s <= 0:
            raise ValueError("socket_timeout_s must be positive")

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

    @classmethod
    def from_row(cls, kind: str, service_id: str, row: dict) -> ServiceInfo:
        """From the service's hash (NS:svc:KIND:ID)."""
        return cls(kind, service_id, row["endpoint"], float(row["started_at"]), json.loads(row["meta"]))


@dataclass(frozen=True)
class BlockRecord:
    block_hash: str
    tier: int  # 0 device, 1 host, 2 disk
    num_bytes: int
    last_access: float  # wall clock (time.time()) of its latest insert or hit
    parent_hash: str = ""  # the block before it in its prompts (block_hash.ROOT_HASH for a first block)
    num_tokens: int = 0  # tokens it covers (the cache's block size)

    def to_json(self) -> str:
        return json.dumps({"tier": self.tier, "bytes": self.num_bytes, "last_access": self.last_access,
                           "parent": self.parent_hash, "tokens": self.num_tokens})

    @classmethod
    def from_json(cls, block_hash: str, raw: str) -> BlockRecord:
        d = json.loads(raw)
        return cls(block_hash, d["tier"], d["bytes"], d["last_access"], d.get("parent", ""), d.get("tokens", 0))


@dataclass(frozen=True)
class KVPlacement:
    workers: tuple[str, ...]
    partition: str  # "request" (whole requests per worker) or "head" (heads split)
    slab_ranges: dict[str, list[tuple[int, int]]]  # worker -> [start, end) slot runs
    tokens: dict[str, int] = field(default_factory=dict)  # worker -> tokens of KV held there

    def __post_init__(self) -> None:
        if self.partition not in ("request", "head"):
            raise ValueError(f"partition must be 'request' or 'head', got {self.partition!r}")


# Writes the tokens field of each placement that still exists (atomic in Redis).
_UPDATE_IF_PLACED = """
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then redis.call('HSET', key, 'tokens', ARGV[i]) end
end
return 0
"""


# A service whose registration expired: drop its id from its kind's set and its blocks
# from the block index, unless it registered again meanwhile. KEYS: its hash, its
# kind's set, its block set; ARGV: its id, the block key prefix, the events channel.
_FORGET_IF_EXPIRED = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SREM', KEYS[2], ARGV[1])
local hashes = redis.call('SMEMBERS', KEYS[3])
if #hashes > 0 then
  for _, h in ipairs(hashes) do redis.call('HDEL', ARGV[2] .. h, ARGV[1]) end
  redis.call('DEL', KEYS[3])
  redis.call('PUBLISH', ARGV[3], cjson.encode({type = 'blocks_removed', node = ARGV[1], blocks = hashes}))
end
return 1
"""


class _Client(aioredis.Redis):
    """redis-py's asyncio client, with a cancellation that a command lost raised again when
    the command ends (lamina.aio.raise_if_cancelled): every loop around the store's calls
    then ends at its cancellation, without a check of its own."""

    async def execute_command(self, *args, **options):
        try:
            return await super().execute_command(*args, **options)
        finally:
            raise_if_cancelled()  # the cancellation wins over the command's result or error

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> _Pipeline:
        return _Pipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


class _Pipeline(aioredis.client.Pipeline):
    """A pipeline of `_Client`: the same check when it executes."""

    async def execute(self, raise_on_error: bool = True) -> list:
        try:
            return await super().execute(raise_on_error)
        finally:
            raise_if_cancelled()


class MetadataStore:
    """Async access to the metadata keys. Owns its connection pool: `await close()`."""

    def __init__(self, config: MetadataConfig) -> None:
        self.config = config
        self.ns = config.namespace
        self.redis = _Client.from_url(
            config.url, decode_responses=True,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 6),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            socket_connect_timeout=2, socket_timeout=config.socket_timeout_s, socket_keepalive=True)

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> MetadataStore:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # The client decodes every reply (decode_responses=True); redis-py's annotations do
    # not follow that setting and say bytes | str.

    async def _members(self, key: str) -> set[str]:
        return cast(set[str], await self.redis.smembers(key))

    async def _fields(self, key: str) -> dict[str, str]:
        return cast(dict[str, str], await self.redis.hgetall(key))

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

    def _stats_key(self, kind: str, service_id: str) -> str:
        return f"{self.ns}:stats:{kind}:{service_id}"

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
        ids = sorted(await self._members(self._svcs_key(kind)))
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
            out.append(ServiceInfo.from_row(kind, service_id, row))
        for service_id in dead:
            # Its lease lapsed: it is gone, and so is what it cached (unless it registered
            # again meanwhile: the script checks, atomically).
            await self.redis.eval(_FORGET_IF_EXPIRED, 3, self._svc_key(kind, service_id), self._svcs_key(kind),
                                  self._node_blocks_key(service_id), service_id, f"{self.ns}:block:",
                                  self.events_channel)
        return out

    async def get_service(self, kind: str, service_id: str) -> ServiceInfo | None:
        """One service's registration; None when it is not (or no longer) registered."""
        row = await self._fields(self._svc_key(kind, service_id))
        if not row:
            return None
        return ServiceInfo.from_row(kind, service_id, row)

    # ---- figures a service publishes about itself ----

    async def put_stats(self, kind: str, service_id: str, stats: dict) -> None:
        """Replaces the service's figures; they expire after service_ttl_s."""
        await self.redis.set(self._stats_key(kind, service_id), json.dumps(stats),
                             px=int(self.config.service_ttl_s * 1000))

    async def get_stats(self, kind: str, service_id: str) -> dict | None:
        raw = await self.redis.get(self._stats_key(kind, service_id))
        return None if raw is None else json.loads(raw)

    # ---- restarts of service processes (counted by their launcher) ----

    async def count_restart(self, service_id: str) -> int:
        """One more restart of `service_id`; returns its count so far."""
        return int(await self.redis.hincrby(f"{self.ns}:restarts", service_id, 1))

    async def restart_counts(self) -> dict[str, int]:
        """service id -> restarts, for the services restarted at least once."""
        return {k: int(v) for k, v in (await self._fields(f"{self.ns}:restarts")).items()}

    async def reset_restart_counts(self) -> None:
        await self.redis.delete(f"{self.ns}:restarts")

    # ---- prefix blocks ----

    async def put_blocks(self, node: str, records: Iterable[BlockRecord]) -> None:
        await self.update_blocks(node, records, [])

    async def remove_blocks(self, node: str, block_hashes: Iterable[str]) -> None:
        await self.update_blocks(node, [], block_hashes)

    async def update_blocks(self, node: str, records: Iterable[BlockRecord], removed: Iterable[str]) -> None:
        """One batch of a node's changes in one transaction: blocks stored or changed
        (tier, bytes, last use) and blocks it no longer holds."""
        records, removed = list(records), list(removed)
        if not records and not removed:
            return
        async with self.redis.pipeline(transaction=True) as p:
            self._queue_blocks(p, node, records, removed)
            await p.execute()

    async def replace_node_blocks(self, node: str, records: Iterable[BlockRecord]) -> None:
        """The node's whole set becomes `records` (a start, or a Redis found emptied)."""
        records = list(records)
        new = {r.block_hash for r in records}
        old = await self._members(self._node_blocks_key(node))
        async with self.redis.pipeline(transaction=True) as p:
            self._queue_blocks(p, node, records, sorted(old - new))
            await p.execute()

    def _queue_blocks(self, p, node: str, records: list[BlockRecord], removed: list[str]) -> None:
        for h in removed:
            p.hdel(self._block_key(h), node)
        if removed:
            p.srem(self._node_blocks_key(node), *removed)
            p.publish(self.events_channel, self._event("blocks_removed", node=node, blocks=removed))
        for r in records:
            p.hset(self._block_key(r.block_hash), node, r.to_json())
        if records:
            p.sadd(self._node_blocks_key(node), *(r.block_hash for r in records))
            p.publish(self.events_channel, self._event(
                "blocks_stored", node=node, blocks=[[r.block_hash, r.tier] for r in records]))

    async def clear_node_blocks(self, node: str) -> None:
        """Forgets every block of a node (it restarted with an empty cache, or died)."""
        await self.remove_blocks(node, await self._members(self._node_blocks_key(node)))

    async def get_block(self, block_hash: str) -> dict[str, BlockRecord]:
        """node -> record, for every node caching the block."""
        row = await self._fields(self._block_key(block_hash))
        return {node: BlockRecord.from_json(block_hash, raw) for node, raw in row.items()}

    async def block_holders(self, block_hashes: Sequence[str]) -> list[set[str]]:
        """The nodes caching each block, in order, in one round trip (the scheduler's
        prefill routing asks this for a prompt's chained block hashes)."""
        if not block_hashes:
            return []
        async with self.redis.pipeline(transaction=False) as p:
            for h in block_hashes:
                p.hkeys(self._block_key(h))
            rows = await p.execute()
        return [set(nodes) for nodes in rows]

    async def blocks_on(self, node: str) -> set[str]:
        return set(await self._members(self._node_blocks_key(node)))

    async def node_blocks(self, node: str) -> list[BlockRecord]:
        """Every block record of a node, sorted by hash."""
        hashes = sorted(await self._members(self._node_blocks_key(node)))
        if not hashes:
            return []
        async with self.redis.pipeline(transaction=False) as p:
            for h in hashes:
                p.hget(self._block_key(h), node)
            rows = await p.execute()
        return [BlockRecord.from_json(h, raw) for h, raw in zip(hashes, rows) if raw is not None]

    # ---- request KV placement ----

    async def set_placement(self, request_id: str, placement: KVPlacement) -> None:
        key = self._req_key(request_id)
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(key)
            p.hset(key, mapping={
                "workers": json.dumps(list(placement.workers)),
                "partition": placement.partition,
                "slab_ranges": json.dumps({w: [list(r) for r in rs]
                                           for w, rs in placement.slab_ranges.items()}),
                "tokens": json.dumps(placement.tokens)})
            p.sadd(self._reqs_key(), request_id)
            p.publish(self.events_channel, self._event(
                "placement_set", request=request_id, workers=list(placement.workers)))
            await p.execute()

    async def get_placement(self, request_id: str) -> KVPlacement | None:
        row = await self._fields(self._req_key(request_id))
        if not row:
            return None
        ranges = {w: [tuple(r) for r in rs] for w, rs in json.loads(row["slab_ranges"]).items()}
        return KVPlacement(tuple(json.loads(row["workers"])), row["partition"], ranges,
                           json.loads(row.get("tokens", "{}")))

    async def update_placement_tokens(self, tokens: dict[str, dict[str, int]]) -> None:
        """request id -> {worker: tokens held there}, for requests that still have a
        placement (one script: a placement deleted meanwhile is not written again)."""
        if not tokens:
            return
        ids = sorted(tokens)
        await self.redis.eval(_UPDATE_IF_PLACED, len(ids), *(self._req_key(r) for r in ids),
                              *(json.dumps(tokens[r]) for r in ids))

    async def delete_placement(self, request_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(self._req_key(request_id))
            p.srem(self._reqs_key(), request_id)
            p.publish(self.events_channel, self._event("placement_deleted",
                                                       request=request_id))
            await p.execute()

    async def placed_requests(self) -> set[str]:
        return set(await self._members(self._reqs_key()))

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
        ids = sorted(await self._members(f"{self.ns}:jrns"))
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
    async def subscribe(self) -> AsyncIterator[EventSubscription]:
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
