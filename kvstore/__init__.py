"""Lamina KV store: slab allocator (attention workers), tiered prefix cache (prefill
workers), eviction, prefetch, prefix-aware scheduling policies, and the Redis metadata
store. See docs/kvstore.md."""

from kvstore.block_hash import ROOT_HASH, block_hashes, chain_hash
from kvstore.eviction import EVICTION_POLICIES, BlockStats, EvictionPolicy, make_policy
from kvstore.policies import (
    SCHEDULING_POLICIES,
    QueuedRequest,
    fcfs,
    fastest_prefix_first,
    relaxed_fpf,
)
from kvstore.prefetch import Prefetcher
from kvstore.prefix_cache import PrefixCache, PrefixCacheConfig, PrefixHandle
from kvstore.prefix_index import PrefixIndex, PrefixMatch
from kvstore.quant import QuantizedTensor, dequantize_4bit, quantize_4bit
from kvstore.slab import KVAllocationError, SlabAllocator, SlabConfig
from kvstore.tiers import Tier

__all__ = [
    "ROOT_HASH", "block_hashes", "chain_hash",
    "EVICTION_POLICIES", "BlockStats", "EvictionPolicy", "make_policy",
    "SCHEDULING_POLICIES", "QueuedRequest", "fcfs", "fastest_prefix_first", "relaxed_fpf",
    "Prefetcher", "PrefixCache", "PrefixCacheConfig", "PrefixHandle",
    "PrefixIndex", "PrefixMatch", "QuantizedTensor", "dequantize_4bit", "quantize_4bit",
    "KVAllocationError", "SlabAllocator", "SlabConfig", "Tier",
]
