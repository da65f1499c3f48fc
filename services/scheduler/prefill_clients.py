"""The scheduler's side of its prefill workers: one gRPC channel per worker, which of
them answer, the prompt tokens each has been sent and not answered, and the routing of
each prompt (the decision is lamina.services.scheduler.prefill_routing's).

A worker whose call fails as a lost peer does is marked down and gets no prompt until
`refresh` finds it registered at a new address (it restarted) or answering a health
probe at the old one. `route` refreshes by itself, at most every `_REFRESH_S`, while a
worker is down, so a failed worker's prompts go to the live ones and a worker that
comes back gets prompts again.

`watch` (a task the scheduler owns) refreshes every half service TTL: listing the
prefill services removes a dead worker's registration and its block records from the
metadata store once its lease has expired (lamina.kvstore.metadata.list_services), and each
refresh reads the workers' published figures (forward rate, fetch bandwidth), by which
`route` decides whether the chosen worker fetches a peer's longer prefix
(lamina.services.scheduler.prefix_fetch_policy) rather than computing it.

Routing reads the store's block holders together with `claims` (lamina.services.scheduler.prefix_claims):
the blocks of prompts it routed that the store may not show yet, so a conversation's
next turn sent while the turn before is still computing goes where that turn went.

Ownership: channels are opened by the `open_channel(key, address)` the scheduler passes
(its lamina.services.channels.Channels: a worker's new channel retires its old one, and
the rest close with the scheduler). One asyncio loop uses this object; nothing here locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lamina.kvstore.block_hash import block_hashes
from lamina.kvstore.metadata import REDIS_ERRORS, MetadataStore, ServiceInfo
from lamina.services.config import StackConfig
from lamina.services.protos import lamina_pb2, lamina_pb2_grpc
from lamina.services.runtime import refresh_every_half_ttl
from lamina.services.scheduler.prefill_deadline import prefill_deadline_s
from lamina.services.scheduler.prefill_routing import PrefillLoad, choose, matched_tokens
from lamina.services.scheduler.prefix_claims import PrefixClaims
from lamina.services.scheduler.prefix_fetch_policy import FetchPlan, plan_fetch
from lamina.services.scheduler.scheduling_policies import MAX_DISTANCE

log = logging.getLogger(__name__)

# Codes of a call whose prefill worker may be gone: it is probed before it gets prompts again.
_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
         grpc.StatusCode.UNKNOWN)
# Fewest seconds between two refreshes that `route` starts while a worker is down.
_REFRESH_S = 1.0
# How long a prompt's blocks stay claimed for its worker after it answered: the store
# shows them within the worker publisher's batch interval (50 ms) and a write.
_CLAIM_GRACE_S = 1.0
# Half-life of a worker's recent work (the uncached tokens routed to it), by which new
# conversations are dealt out: long enough to span several turns of the conversations
# it holds, short enough that a burst long past does not count.
_RECENT_HALF_LIFE_S = 30.0


@dataclass
class _Worker:
    name: str  # prefill-I
    endpoint: str = ""
    stub: lamina_pb2_grpc.PrefillStub | None = None
    health: health_pb2_grpc.HealthStub | None = None
    alive: bool = False
    queued_tokens: int = 0
    last_chosen: int = -1
    data_address: str = ""  # where peers fetch prefix KV from it ("" without a prefix cache)
    figures: dict | None = None  # its published stats (lamina.services.prefill.prefill_service.stats)
    recent_tokens: float = 0.0  # uncached prompt tokens routed to it, decayed (as of recent_at)
    recent_at: float = 0.0

    def recent(self, now: float) -> float:
        """Its recent work as of `now`."""
        return self.recent_tokens * 0.5 ** ((now - self.recent_at) / _RECENT_HALF_LIFE_S)

    def add_recent(self, tokens: int, now: float) -> None:
        self.recent_tokens, self.recent_at = self.recent(now) + tokens, now

    def load(self, now: float) -> PrefillLoad:
        return PrefillLoad(self.name, self.alive and self.stub is not None, self.queued_tokens, self.last_chosen,
                           self.recent(now))


class PrefillClients:
    def __init__(self, config: StackConfig, store: MetadataStore,
                 open_channel: Callable[[Hashable, str], grpc.aio.Channel]) -> None:
        self.config = config
        self.store = store
        self._open_channel = open_channel
        pc = config.prefill
        self.workers = [_Worker(f"prefill-{i}") for i in range(pc.workers)]
        self._num_decisions = 0
        self._refreshed_at = 0.0
        self.claims = PrefixClaims()  # blocks routed to a worker that the store may not show yet

    def connect(self, infos: list[ServiceInfo]) -> None:
        """Open a channel to each registered worker (at start)."""
        for info in infos:
            self._connect(info)

    def _connect(self, info: ServiceInfo) -> None:
        w = self._by_name(info.service_id)
        if w is None:
            return  # an index past prefill.workers: not part of this stack's configuration
        channel = self._open_channel(("prefill", w.name), info.endpoint)  # replaces its channel before
        w.endpoint = info.endpoint
        w.data_address = str(info.meta.get("data", ""))
        w.stub = lamina_pb2_grpc.PrefillStub(channel)
        w.health = health_pb2_grpc.HealthStub(channel)
        w.alive = True

    def _by_name(self, name: str) -> _Worker | None:
        return next((w for w in self.workers if w.name == name), None)

    @property
    def _claims_on(self) -> bool:
        """Claims steer prefix routing over several workers; nothing else reads them."""
        return self.config.prefill.routing == "prefix" and len(self.workers) > 1

    @property
    def num_alive(self) -> int:
        return sum(w.alive for w in self.workers)

    async def refresh(self) -> None:
        """Reach restarted workers at their registered address; probe the down ones."""
        self._refreshed_at = time.monotonic()
        with contextlib.suppress(*REDIS_ERRORS):
            for info in await self.store.list_services("prefill"):
                w = self._by_name(info.service_id)
                if w is not None and info.endpoint != w.endpoint:
                    log.info("%s found at %s", w.name, info.endpoint)
                    self._connect(info)
            for w in self.workers:
                w.figures = await self.store.get_stats("prefill", w.name)
        down = [(w, w.health) for w in self.workers if not w.alive and w.health is not None]
        answers = await asyncio.gather(*(health.Check(health_pb2.HealthCheckRequest(),
                                                      timeout=self.config.deadlines.health_s) for _, health in down),
                                       return_exceptions=True)
        for (w, _), answer in zip(down, answers):
            if not isinstance(answer, BaseException) and answer.status == health_pb2.HealthCheckResponse.SERVING:
                log.info("%s answers again", w.name)
                w.alive = True

    async def watch(self) -> None:
        """Refresh every half service TTL, for as long as the scheduler runs."""
        await refresh_every_half_ttl(self.store, self.refresh, "prefill workers")

    async def route(self, token_ids: list[int]) -> tuple[int, int, FetchPlan | None] | None:
        """(worker index, prompt tokens it is expected to hold, the peer prefix it should
        fetch or None) for a prompt; None when no worker is alive (after a refresh)."""
        if self.num_alive < len(self.workers) and time.monotonic() - self._refreshed_at >= _REFRESH_S:
            await self.refresh()
        pc = self.config.prefill
        wants_matches = (pc.routing == "prefix" or pc.peer_fetch != "off") and len(self.workers) > 1
        # Chained hashes: those of all tokens but the last (the blocks a hit can use; the last
        # token is always computed) are the first ones of the whole prompt's (what its worker caches).
        prompt_hashes = block_hashes(token_ids, pc.cache_block_tokens) if wants_matches else []
        hashes = prompt_hashes[:(len(token_ids) - 1) // pc.cache_block_tokens]
        holders = await self._holders(hashes) if wants_matches else []
        matched = matched_tokens(holders, pc.cache_block_tokens)  # by the store: what a peer can serve
        routing_matched: dict[str, int] = {}
        now = time.monotonic()
        if self._claims_on and holders:
            self.claims.prune(now)
            claimed = self.claims.add_to(holders, hashes, (w.name for w in self.workers), now)
            routing_matched = matched_tokens(claimed, pc.cache_block_tokens)
        i = choose(pc.routing, [w.load(now) for w in self.workers], routing_matched,
                   pc.routing_load_weight, pc.routing_min_gain_tokens, pc.routing_max_queue_gap_tokens)
        if i is None:
            return None
        self._num_decisions += 1
        w = self.workers[i]
        w.last_chosen = self._num_decisions
        plan = self._plan_fetch(w, matched)
        held = plan.tokens if plan is not None else routing_matched.get(w.name, matched.get(w.name, 0))
        uncached = max(len(token_ids) - held, 1)
        if self._claims_on:  # until the deadline of the call this routing is for
            self.claims.claim(w.name, prompt_hashes, now + self.deadline_s(w, uncached))
        w.add_recent(uncached, now)
        return i, held, plan

    def _plan_fetch(self, chosen: _Worker, matched: dict[str, int]) -> FetchPlan | None:
        pc = self.config.prefill
        if pc.peer_fetch == "off" or not matched:
            return None
        mine = chosen.figures or {}
        per_token = next((f["kv_bytes_per_token"] for f in (mine, *(w.figures or {} for w in self.workers))
                          if f.get("kv_bytes_per_token")), 0)
        return plan_fetch(pc.peer_fetch, chosen.name, matched,
                          {w.name for w in self.workers if w.alive and w.data_address},
                          per_token, mine.get("fetch_bytes_per_s") or pc.peer_fetch_prior_gbps * 1e9,
                          mine.get("compute_tokens_per_s"))

    def peer_prefix(self, plan: FetchPlan) -> lamina_pb2.PeerPrefix:
        w = self._by_name(plan.peer)
        return lamina_pb2.PeerPrefix(node=plan.peer, address=w.data_address if w else "", tokens=plan.tokens)

    async def _holders(self, hashes: list[str]) -> list[set[str]]:
        """The workers holding each block, by the store; none when the store does not
        answer (then routing goes by load alone)."""
        try:
            return [set(h) for h in await self.store.block_holders(hashes)]
        except REDIS_ERRORS as exc:
            log.debug("prefix lookup failed (%s); routing by load alone", exc)
            return []

    async def prefill(self, worker: int, request: lamina_pb2.PrefillRequest,
                      cached_tokens: int) -> lamina_pb2.PrefillResult:
        """Have `worker` prefill `request`; its uncached tokens count as queued there until
        it answers. A failure that looks like a lost worker marks it down."""
        w = self.workers[worker]
        queued = max(len(request.token_ids) - cached_tokens, 1)
        w.queued_tokens += queued
        try:
            if w.stub is None:  # routing chooses connected workers only
                raise RuntimeError(f"{w.name} was never connected")
            return await w.stub.Prefill(request, timeout=self.deadline_s(w))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _LOST and w.alive:
                log.warning("%s failed (%s: %s); routing around it until it answers", w.name, exc.code().name,
                            exc.details())
                w.alive = False
            raise
        finally:
            w.queued_tokens -= queued
            if self._claims_on:
                hashes = block_hashes(list(request.token_ids), self.config.prefill.cache_block_tokens)
                self.claims.settle(w.name, hashes, time.monotonic() + _CLAIM_GRACE_S)

    def deadline_s(self, w: _Worker, more_tokens: int = 0) -> float:
        """How long a prefill call to `w` may take: the tokens queued there (a call's own
        among them once sent) and `more_tokens` (lamina.services.scheduler.prefill_deadline)."""
        d = self.config.deadlines
        return prefill_deadline_s(d.rpc_s, w.queued_tokens + more_tokens,
                                  (w.figures or {}).get("compute_tokens_per_s"), d.prefill_tokens_per_s)

    async def tier_distances(self, prompts: list[list[int]]) -> list[int] | None:
        """Each prompt's tier distance at the worker that holds it nearest (prefix-aware
        admission); None when no live worker answered."""
        live = [w.stub for w in self.workers if w.alive and w.stub is not None]
        request = lamina_pb2.TierDistanceRequest(prompts=[lamina_pb2.TierDistanceRequest.Prompt(token_ids=p)
                                                          for p in prompts])
        answers = await asyncio.gather(*(stub.TierDistances(request, timeout=self.config.deadlines.rpc_s)
                                         for stub in live), return_exceptions=True)
        found = [list(a.distances) for a in answers if not isinstance(a, BaseException)]
        if not found:
            errors = [a for a in answers if isinstance(a, grpc.aio.AioRpcError)]
            log.warning("tier distances unavailable (%s); admitting in arrival order",
                        errors[0].details() if errors else "no live prefill worker")
            return None
        return [min([d[i] for d in found], default=MAX_DISTANCE) for i in range(len(prompts))]
