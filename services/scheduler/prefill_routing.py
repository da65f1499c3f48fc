"""Which prefill worker computes a prompt: a pure policy, no I/O.

The scheduler gives it, for one prompt, every prefill worker's state (`PrefillLoad`:
alive or not, the prompt tokens it was sent and has not answered yet, when it was last
chosen) and the tokens of the prompt each worker's prefix cache holds, counted by
`matched_tokens` from the metadata store's block records (the prompt's chained block
hashes, lamina.kvstore.block_hash, the keys the prefix caches use).

`prefix` routing considers the live workers whose queued tokens exceed the least
queued worker's by at most `max_queue_gap` (the others are too busy to wait for,
whatever they hold), and asks whether any of them holds a prefix of the prompt worth
following: its `gain`, the tokens it holds beyond what every live worker holds, must
reach `min_gain` tokens. If none does (a new conversation, or one whose only match is
a prefix all workers share, such as a system prompt), the prompt has no home yet and
goes to the one that was sent the least work lately (`recent_tokens`: the uncached
prompt tokens routed to it, decayed over time by the caller), then fewest queued
tokens, then the one chosen least recently, then the lowest index. So new
conversations are dealt out by the work their workers' conversations bring, and the
caches come to hold different ones. Otherwise it goes to the one with the highest

    score(w) = gain(w) - load_weight x queued_tokens(w)

with ties to the fewest queued tokens, the least recently chosen, the lowest index.

Why these rules. A conversation's next turn finds its whole history on the worker that
served the turn before, and nowhere else; sent elsewhere it recomputes that history
there, and the turn after finds its prefix split over two workers. So a turn stays
with its prefix unless the queue it would wait in is much longer (the gap), rather
than whenever another queue is shorter by more than the prefix (load weight 1, the
earliest first token of this prompt alone, counts none of the later turns' loss:
docs/kvstore.md measures weights 0 to 1 on the Kimi trace). Without the `min_gain`
rule the worker that holds only the shared first block of every prompt would win every
new conversation by that one block, and take them all.

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
    recent_tokens: float = 0.0  # uncached prompt tokens routed to it, decayed (the caller's half-life)


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


def choose_by_prefix(workers: Sequence[PrefillLoad], matched: Mapping[str, int], load_weight: float = 0.0,
                     min_gain: int = 0, max_queue_gap: int | None = None) -> int | None:
    """Index (into `workers`) of the worker the prompt goes to; None when none is alive.
    `max_queue_gap` None: no worker is too busy."""
    live = [i for i, w in enumerate(workers) if w.alive]
    if not live:
        return None
    common = min(matched.get(workers[i].name, 0) for i in live)  # tokens every live worker holds
    least = min(workers[i].queued_tokens for i in live)
    near = [i for i in live if max_queue_gap is None or workers[i].queued_tokens - least <= max_queue_gap]
    gain = {i: matched.get(workers[i].name, 0) - common for i in near}
    homed = max(gain.values()) >= max(min_gain, 1)

    def rank(i: int) -> tuple[float, float, int, int, int]:
        w = workers[i]
        if homed:
            return (-(gain[i] - load_weight * w.queued_tokens), 0.0, w.queued_tokens, w.last_chosen, i)
        return (0.0, w.recent_tokens, w.queued_tokens, w.last_chosen, i)

    return min(near, key=rank)


def choose_round_robin(workers: Sequence[PrefillLoad]) -> int | None:
    """Index of the live worker chosen least recently; None when none is alive."""
    live = [i for i, w in enumerate(workers) if w.alive]
    if not live:
        return None
    return min(live, key=lambda i: (workers[i].last_chosen, i))


def choose(routing: str, workers: Sequence[PrefillLoad], matched: Mapping[str, int], load_weight: float = 0.0,
           min_gain: int = 0, max_queue_gap: int | None = None) -> int | None:
    if routing == "prefix":
        return choose_by_prefix(workers, matched, load_weight, min_gain, max_queue_gap)
    if routing == "round_robin":
        return choose_round_robin(workers)
    raise ValueError(f"unknown prefill routing {routing!r}; expected one of {', '.join(ROUTINGS)}")
