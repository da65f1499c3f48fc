"""How a prefill worker cuts long prompts into chunks (`prefill.chunk_tokens`).

A forward computes its prompts whole; one prompt of thousands of tokens then holds the
worker for as long as its forward lasts (3,927 tokens of SmolLM2 on two cores: over
20 s), and every prompt queued behind it waits that long for its first token, however
short. So a prompt computes at most `chunk` of its tokens a forward: its KV stays in
the worker between its forwards, as a cached prefix does, and the prompts queued
meanwhile join the next forward beside its next chunk. A short prompt then waits for
about two chunks' forwards: the rest of the one in progress, then its own beside the
long prompt's next chunk. The prompt's KV goes to its attention workers, and its
first token is sampled, in the forward of its last chunk.

These functions are the policy, pure: which tokens the next forward computes.
"""

from __future__ import annotations

from collections.abc import Sequence

# A chunk where none is configured (`prefill.chunk_tokens: 0`): on a CPU a forward of 512
# tokens of the default model takes 1-2 s on two cores (more the longer its prefix); on a GPU a forward of 2,048
# tokens of an 8B model takes tens of milliseconds, and smaller ones use it less well.
AUTO_CHUNK_TOKENS = {"cpu": 512, "cuda": 2048}


def chunk_tokens(configured: int, device_type: str) -> int:
    """The chunk a prefill worker on `device_type` uses: the configured one, or auto's."""
    return configured or AUTO_CHUNK_TOKENS.get(device_type, AUTO_CHUNK_TOKENS["cpu"])


def first_take(uncached: int, chunk: int, whole: bool) -> int:
    """The tokens a prompt computes in its first forward: at most a chunk of the
    `uncached` ones, or all of them when it is computed `whole` (a prompt that scores
    its own tokens: its logits rows are every position's)."""
    return uncached if whole else min(uncached, chunk)


def continuing_takes(remaining: Sequence[int], chunk: int, max_tokens: int) -> list[int]:
    """The tokens each prompt already in progress computes in the next forward, in queue
    order: a chunk each (its rest where less is left), while together they leave a chunk
    of the forward's `max_tokens` to the prompts queued meanwhile; 0 for one that waits
    for a later forward. The first always computes, so every prompt in progress ends."""
    room = max(max_tokens - chunk, 0)
    takes: list[int] = []
    total = 0
    for rest in remaining:
        n = min(rest, chunk)
        if takes and total + n > room:
            takes.append(0)
            continue
        takes.append(n)
        total += n
    return takes
