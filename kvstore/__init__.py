"""Lamina KV store: slab allocator (attention workers), tiered prefix cache (prefill
workers), eviction, prefetch, and the Redis metadata store. See docs/kvstore.md."""

from lamina.kvstore.block_hash import ROOT_HASH, block_hashes, chain_hash
from lamina.kvstore.eviction import EVICTION_POLICIES, BlockStats, EvictionPolicy, make_policy
from lamina.kvstore.prefetch import Prefetcher
from lamina.kvstore.prefix_cache import PrefixCache, PrefixCacheConfig, PrefixHandle
from lamina.kvstore.prefix_index import PrefixIndex, PrefixMatch
from lamina.kvstore.quant import QuantizedTensor, dequantize_4bit, quantize_4bit
from lamina.kvstore.slab import KVAllocationError, SlabAllocator, SlabConfig
from lamina.kvstore.tiers import Tier

__all__ = [
    "EVICTION_POLICIES",
    "ROOT_HASH",
    "BlockStats",
    "EvictionPolicy",
    "KVAllocationError",
    "Prefetcher",
    "PrefixCache",
    "PrefixCacheConfig",
    "PrefixHandle",
    "PrefixIndex",
    "PrefixMatch",
    "QuantizedTensor",
    "SlabAllocator",
    "SlabConfig",
    "Tier",
    "block_hashes",
    "chain_hash",
    "dequantize_4bit",
    "make_policy",
    "quantize_4bit",
]
