"""The scheduler service: admission, KV placement, prefill routing, decode streams and recovery."""
