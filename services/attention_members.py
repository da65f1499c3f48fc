"""Which attention workers the pool holds: a pure function of the registrations.

An attention pool may grow past the workers a stack starts with (`attention.workers`)
up to `attention.max_workers`: a worker that registers with a higher index joins, and
one whose registration ends (it stopped, or its lease lapsed) leaves. The scheduler
calls `membership` on every listing of the registered attention services; what to do
with the answer (open a channel, stop placing requests on a worker) is its own."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Membership:
    joined: dict[int, str]  # index -> gRPC address of a worker new to the pool, or back at a new address
    left: frozenset[int]  # indexes in the pool whose registration is gone


def worker_index(service_id: str) -> int | None:
    """`attention-7` -> 7; None for an id of another form."""
    prefix, _, number = service_id.rpartition("-")
    return int(number) if prefix and number.isdigit() else None


def membership(present: Mapping[int, str], registered: Iterable[tuple[str, str]], limit: int) -> Membership:
    """`present`: the pool's live workers (index -> gRPC address); `registered`: (service
    id, gRPC address) of every registration now; `limit`: the most workers the pool
    takes (indexes 0 .. limit - 1; others are ignored)."""
    now: dict[int, str] = {}
    for service_id, address in registered:
        index = worker_index(service_id)
        if index is not None and 0 <= index < limit and address:
            now[index] = address
    joined = {w: a for w, a in sorted(now.items()) if present.get(w) != a}
    return Membership(joined=joined, left=frozenset(w for w in present if w not in now))
