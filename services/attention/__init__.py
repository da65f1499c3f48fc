"""The attention service: KV slabs and attention over them, and worker index claims."""
