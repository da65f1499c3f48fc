"""Which prefill worker computes a prompt: a pure policy, no I/O.

The scheduler gives it, for one prompt, every prefill worker's state (`PrefillLoad`:
alive or not, the prompt tokens it was sent and has not answered yet, when it was last
chosen) and the tokens of the prompt each worker's prefix cache holds, counted by
`matched_tokens` from the metadata store's block records (the prompt's chained block
hashes, lamina.kvstore.block_hash, the keys the prefix caches use).

`prefix` routing picks the live worker with the highest

    score(w) = matched_tokens(w) - load_weight x queued_tokens(w)

Why this score: a prompt sent to w waits for the tokens queued there (computed before
it, or in the same forward) and then computes its own tokens but those w has cached;
with a forward's cost about linear in tokens that is queued(w) + n - matched(w), so with
load_weight 1 the highest score is the earliest expected first token. A larger weight
spreads prompts more evenly; 0 ignores load. Ties go to the worker with the fewest
queued tokens, then to the one chosen least recently (so idle workers holding nothing
of a prompt take turns, and their caches come to hold different prompts), then to the
lowest index.

`round_robin` routing (the baseline) picks the live worker chosen least recently.

A worker that is not alive (not registered, or its last call failed and no probe has
answered since) is never chosen; with none alive the answer is None.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

ROUTINGS = ("prefix", "round_robin")  # lamina.services.config.PREFILL_ROUTINGS (tested equal)


@dataclass(frozen=True)
class PrefillLoad:
    """One prefill worker as the router sees it."""

    name: str  # its service id (prefill-I): the node of its blocks in the metadata store
    alive: bool = True
    queued_tokens: int = 0  # tokens of prompts sent to it and not answered, less what its cache held
    last_chosen: int = -1  # the number of the last routing decision that chose it (-1: never)


def matched_tokens(holders: Sequence[Collection[str]], block_size: int) -> dict[str, int]:
    """Tokens of a prompt each node holds as a prefix: `holders[i]` are the nodes whose
    cache holds the prompt's block i. Only an unbroken run of blocks from the first
    counts (a block's KV is of use only after all the blocks before it)."""
    run: dict[str, int] = {}
    alive: set[str] | None = None  # nodes whose run has not broken yet
    for nodes in holders:
        alive = set(nodes) if alive is None else alive & set(nodes)
        if not alive:
            break
        for node in alive:
            run[node] = run.get(node, 0) + block_size
    return run


def choose_by_prefix(workers: Sequence[PrefillLoad], matched: Mapping[str, int], load_weight: float) -> int | None:
    """Index (into `workers`) of the worker the prompt goes to; None when none is alive."""
    live = [i for i, w in enumerate(workers) if w.alive]
    if not live:
        return None

    def rank(i: int) -> tuple[float, int, int, int]:
        w = workers[i]
        score = matched.get(w.name, 0) - load_weight * w.queued_tokens
        return (-score, w.queued_tokens, w.last_chosen, i)

    return min(live, key=rank)


def choose_round_robin(workers: Sequence[PrefillLoad]) -> int | None:
    """Index of the live worker chosen least recently; None when none is alive."""
    live = [i for i, w in enumerate(workers) if w.alive]
    if not live:
        return None
    return min(live, key=lambda i: (workers[i].last_chosen, i))


def choose(routing: str, workers: Sequence[PrefillLoad], matched: Mapping[str, int], load_weight: float) -> int | None:
    if routing == "prefix":
        return choose_by_prefix(workers, matched, load_weight)
    if routing == "round_robin":
        return choose_round_robin(workers)
    raise ValueError(f"unknown prefill routing {routing!r}; expected one of {', '.join(ROUTINGS)}")
