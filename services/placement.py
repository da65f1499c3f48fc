"""Where requests' KV lives on the attention workers: pure functions, no I/O."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def head_range(worker: int, num_workers: int, num_kv_heads: int) -> tuple[int, int]:
    """KV heads [start, end) that `worker` holds under head-level partitioning."""
    if num_workers > num_kv_heads:
        raise ValueError(f"head-level partitioning needs at most {num_kv_heads} attention workers "
                         f"(the model has {num_kv_heads} KV heads), got {num_workers}")
    return worker * num_kv_heads // num_workers, (worker + 1) * num_kv_heads // num_workers


def place_request(partition: str, reserved_tokens: Sequence[int], capacity_tokens: Sequence[int],
                  num_tokens: int) -> list[int] | None:
    """Workers for a new request that may grow to `num_tokens` tokens, or None when
    none has room now. Head-level: every worker (each holds a share of every token).
    Request-level: of the workers with room, the least reserved (ties: lowest index)."""
    workers = range(len(reserved_tokens))
    fits = [w for w in workers if reserved_tokens[w] + num_tokens <= capacity_tokens[w]]
    if partition == "head":
        return list(workers) if len(fits) == len(reserved_tokens) else None
    if not fits:
        return None
    return [min(fits, key=lambda w: (reserved_tokens[w], w))]


def placeable(capacity_tokens: Sequence[int], left: Collection[int],
              healthy: Sequence[bool] | None = None) -> list[int]:
    """Each attention worker's KV capacity open to new requests, in tokens: 0 for one
    that left the pool and, given a probe's answers (`healthy`, by index), for one that
    did not answer or was not probed."""
    return [0 if w in left or (healthy is not None and not (w < len(healthy) and healthy[w])) else c
            for w, c in enumerate(capacity_tokens)]
