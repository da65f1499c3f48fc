"""Lamina KV store: slab allocator (attention workers), tiered prefix cache (prefill
workers), eviction, prefetch, prefix-aware scheduling policies, and the Redis metadata
store. See docs/kvstore.md."""

from lamina.kvstore.block_hash import ROOT_HASH, block_hashes, chain_hash
from lamina.kvstore.eviction import EVICTION_POLICIES, BlockStats, EvictionPolicy, make_policy
from lamina.kvstore.policies import (
    SCHEDULING_POLICIES,
    QueuedRequest,
    fcfs,
    fastest_prefix_first,
    relaxed_fpf,
)
from lamina.kvstore.prefetch import Prefetcher
from lamina.kvstore.prefix_cache import PrefixCache, PrefixCacheConfig, PrefixHandle
from lamina.kvstore.prefix_index import PrefixIndex, PrefixMatch
from lamina.kvstore.quant import QuantizedTensor, dequantize_4bit, quantize_4bit
from lamina.kvstore.slab import KVAllocationError, SlabAllocator, SlabConfig
from lamina.kvstore.tiers import Tier

__all__ = [
    "ROOT_HASH", "block_hashes", "chain_hash",
    "EVICTION_POLICIES", "BlockStats", "EvictionPolicy", "make_policy",
    "SCHEDULING_POLICIES", "QueuedRequest", "fcfs", "fastest_prefix_first", "relaxed_fpf",
    "Prefetcher", "PrefixCache", "PrefixCacheConfig", "PrefixHandle",
    "PrefixIndex", "PrefixMatch", "QuantizedTensor", "dequantize_4bit", "quantize_4bit",
    "KVAllocationError", "SlabAllocator", "SlabConfig", "Tier",
]
