"""A request's n choices (GenerateRequest.n): their ids, seeds and KV reservation.

A request asking for n > 1 choices runs as n sequences that share its prompt. Choice 0
is admitted, placed and prefilled like any request; the prefill worker also samples
the first token of choices 1..n-1 from the same logits, each with its own seed
(PrefillRequest.choice_seeds), and the attention workers holding choice 0's prompt
fork it for them (AttentionControl.Fork, lamina.kvstore.slab's fork: shared by reference,
nothing copied), so the prompt is computed and stored once. From there each choice
decodes, stops and is freed on its own; the scheduler's stream of the request carries
every choice's tokens, each chunk naming its choice (TokenChunk.index).

Seeds: choice 0 samples with the request's seed, so it is the n = 1 request's output;
choice i > 0 with `choice_seed(seed, i)`. Every choice is then reproducible from the
request's seed alone, whichever choices run beside it.

Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` (> 0) of a request seeded `seed`: the first 8 bytes of
    BLAKE2b(seed as 8 little-endian bytes, then index as 4), read little-endian, modulo
    2**63. A hash, not seed + index: the sampler's generator for output position p is
    derived from seed * 1_000_003 + p, which nearby seeds would make collide."""
    digest = hashlib.blake2b((seed % (1 << 64)).to_bytes(8, "little") + index.to_bytes(4, "little"),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << 63)


def choice_id(request_id: str, index: int, n: int) -> str:
    """The scheduler's id of choice `index`: the request's own id when it has one choice."""
    return request_id if n <= 1 else f"{request_id}/{index}"


def reserve_tokens(num_prompt: int, max_total: int, num_forks: int) -> int:
    """KV tokens to reserve on a worker for a sequence that may grow to `max_total` tokens
    with `num_forks` choices still to fork from its prompt: its own, and what each fork
    adds past the prompt they share."""
    return max_total + num_forks * (max_total - num_prompt)
