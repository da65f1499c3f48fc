"""The prefill service: runs a prompt, samples its first token, and hands the
prompt's KV to the attention workers layer by layer as each layer finishes.

The longest cached prefix of the prompt comes from the tiered prefix cache, so
only the rest runs through the model (at least the last token, whose logits give
the first output token); the prompt's full blocks are cached afterwards. Prompt
attention runs here, over a local token-granular store that lives only for the
request; the KV of layer i is on its way to the attention workers while layer
i + 1 computes.
"""

from __future__ import annotations

import asyncio
import logging
import time

import prometheus_client
import torch

import transports
from kvstore.policies import MAX_DISTANCE
from kvstore.prefix_cache import PrefixCache, PrefixCacheConfig
from lamina.engine.kv import KVStore
from lamina.engine.sampling import sample
from lamina.engine.step import LocalAttention, StepBatch
from services.attention_pool import AttentionPool
from services.config import StackConfig
from services.model_service import ModelSlices, params_from_proto
from services.protos import lamina_pb2, lamina_pb2_grpc
from services.runtime import ServiceRuntime, abort_for_remote_error
from services.wire import RemoteError

log = logging.getLogger(__name__)


class PrefillService:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.slices = ModelSlices(config.model)
        self.cfg = self.slices.cfg
        self.runtime = ServiceRuntime("prefill", "prefill-0", config)
        r = self.runtime.registry
        self.m_prompts = prometheus_client.Counter("lamina_prefill_requests", "prompts prefilled", registry=r)
        self.m_tokens = prometheus_client.Counter("lamina_prefill_tokens", "prompt tokens computed", registry=r)
        self.m_seconds = prometheus_client.Histogram("lamina_prefill_seconds", "prefill time", registry=r)
        self.m_cached = prometheus_client.Counter("lamina_prefill_cached_tokens", "prompt tokens served by the "
                                                  "prefix cache", registry=r)
        pc = config.prefill
        self.cache = PrefixCache(PrefixCacheConfig(
            block_size=pc.cache_block_tokens, device_bytes=pc.cache_device_bytes, host_bytes=pc.cache_host_bytes,
            disk_bytes=pc.cache_disk_bytes, disk_dir=pc.cache_dir, eviction=pc.cache_eviction,
        )) if pc.cache_device_bytes else None
        self.pool: AttentionPool | None = None
        self._lock = asyncio.Lock()

    async def prefill(self, req: lamina_pb2.PrefillRequest) -> lamina_pb2.PrefillResult:
        token_ids = list(req.token_ids)
        workers = list(req.placement.workers)
        async with self._lock:
            start = time.perf_counter()
            num = len(token_ids)
            kv = KVStore(self.cfg, capacity_bytes=(num + 64) * self.cfg.kv_bytes_per_token())
            seq_kv = kv.reserve(req.seq_id, num)
            cached = self._install_prefix(token_ids, seq_kv)
            batch = StepBatch.build([req.seq_id], [token_ids[cached:]], [cached])
            local = LocalAttention(kv, batch)
            inputs = batch.model_inputs()
            split = self.slices.split
            with torch.inference_mode():
                out = split.slices[0](inputs)
                for i in range(split.num_attention):
                    q, k, v = out.qkv
                    attn = local.attend(i, q, k, v)
                    await self.pool.store_layer(req.seq_id, workers, i, seq_kv.buf[i, 0, :num],
                                                seq_kv.buf[i, 1, :num])
                    out = split.slices[i + 1](inputs, attn, out.context)
            local.commit()
            await self.pool.wait_stored(workers)
            if self.cache is not None:
                self.cache.insert(token_ids, seq_kv.buf[:, :, :num])
            params = params_from_proto(req.params)
            (token,) = sample(out.output, [params], [req.params.seed], [0])
            kv.free(req.seq_id)
            self.m_prompts.inc()
            self.m_tokens.inc(num - cached)
            self.m_cached.inc(cached)
            self.m_seconds.observe(time.perf_counter() - start)
            return lamina_pb2.PrefillResult(token_id=token, cached_tokens=cached)

    def tier_distances(self, prompts: list[list[int]]) -> list[int]:
        if self.cache is None:
            return [MAX_DISTANCE] * len(prompts)
        return [self.cache.tier_distance(p[:-1]) for p in prompts]

    def _install_prefix(self, token_ids: list[int], seq_kv) -> int:
        """Copy the longest cached prefix into the sequence's KV; returns its length.
        The last prompt token is always computed: its logits give the first token."""
        if self.cache is None or len(token_ids) < 2:
            return 0
        with self.cache.acquire(token_ids[:-1]) as handle:
            if handle.num_tokens:
                seq_kv.buf[:, :, : handle.num_tokens] = handle.kv  # [L, 2, P, Hkv, D]
                seq_kv.length = handle.num_tokens
            return handle.num_tokens

    async def run(self) -> None:
        self.pool = await AttentionPool.from_registry(self.runtime.store, self.config, self.cfg)
        try:
            await self.runtime.serve(lambda s: lamina_pb2_grpc.add_PrefillServicer_to_server(_PrefillServicer(self), s))
        finally:
            await self.pool.close()


class _PrefillServicer(lamina_pb2_grpc.PrefillServicer):
    def __init__(self, service: PrefillService) -> None:
        self.service = service

    async def TierDistances(self, request, context):  # noqa: N802
        return lamina_pb2.TierDistanceResult(distances=self.service.tier_distances(
            [list(p.token_ids) for p in request.prompts]))

    async def Prefill(self, request, context):  # noqa: N802
        try:
            return await self.service.prefill(request)
        except (RemoteError, transports.TransportError) as exc:
            await abort_for_remote_error(context, exc)


def serve(config: StackConfig, threads: int | None = None) -> None:
    torch.set_num_threads(threads or config.prefill.threads)
    transports.install_uvloop()
    asyncio.run(PrefillService(config).run())
