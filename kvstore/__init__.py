"""Lamina KV store: slab allocator (attention workers), tiered prefix cache (prefill
workers), eviction, prefetch, and the Redis metadata store. See docs/kvstore.md.

Each module is imported by its own name (lamina.kvstore.slab, ...): the package imports
none of them, so a service that needs only the metadata store (the scheduler, the
gateway) does not import torch with the tensor-holding ones."""
