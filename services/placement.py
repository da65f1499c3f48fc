"""Where requests' KV lives on the attention workers: pure functions, no I/O."""

from __future__ import annotations

from collections.abc import Sequence


def head_range(worker: int, num_workers: int, num_kv_heads: int) -> tuple[int, int]:
    """KV heads [start, end) that `worker` holds under head-level partitioning."""
    if num_workers > num_kv_heads:
        raise ValueError(f"head-level partitioning needs at most {num_kv_heads} attention workers "
                         f"(the model has {num_kv_heads} KV heads), got {num_workers}")
    return worker * num_kv_heads // num_workers, (worker + 1) * num_kv_heads // num_workers


def place_request(partition: str, load_tokens: Sequence[int], num_tokens: int) -> list[int]:
    """Workers for a new request: every worker for head-level partitioning; for
    request-level, the one holding the fewest tokens (ties: the lowest index)."""
    if partition == "head":
        return list(range(len(load_tokens)))
    best = min(range(len(load_tokens)), key=lambda w: (load_tokens[w], w))
    return [best]
