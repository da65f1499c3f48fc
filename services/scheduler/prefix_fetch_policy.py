"""Whether a prompt's prefill worker pulls a longer cached prefix from a peer: a pure
policy, no I/O.

The scheduler has routed a prompt to one prefill worker (lamina.services.scheduler.prefill_routing).
Another live worker may cache a longer prefix of it (by the metadata store's block
records, counted by `prefill_routing.matched_tokens`). The chosen worker can then
either compute the tokens between its own prefix and the peer's, or receive their KV
from the peer over the data plane (lamina.services.prefill.prefix_peers). The KV of a token does not
depend on who computed it, so both give the same output; only the time differs:

    fetch_s   = overhead_s + extra_tokens x kv_bytes_per_token / bandwidth_bytes_per_s
    compute_s = extra_tokens / compute_tokens_per_s

`auto` fetches when fetch_s < compute_s. The figures are the chosen worker's own
measurements, published to the metadata store with its other figures: its prefill
forwards' tokens per second and its earlier fetches' bytes per second (until it has
fetched, `prior_bandwidth_bytes_per_s`, from the configuration). A worker that has
not yet run a forward has no compute figure, and `auto` then recomputes: a recompute
is never wrong, a guess could be slower. `always` fetches whenever a live peer holds
more (for tests and for comparison); `off` never does.

Of several peers holding more, the one holding the most is asked (ties: the first by
name), so one fetch covers the most tokens.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

MODES = ("auto", "always", "off")  # lamina.services.config.PEER_FETCH_MODES (tested equal)

# A fetch's fixed cost beyond its bytes: a round trip and the peer's cache lookup.
FETCH_OVERHEAD_S = 0.002


@dataclass(frozen=True)
class FetchPlan:
    peer: str  # the node (prefill-I) to fetch from
    tokens: int  # prompt tokens the peer is expected to hold (fetch up to these)
    fetch_s: float  # expected time of the fetch
    compute_s: float | None  # expected time of computing the same tokens (None: not measured)


def plan_fetch(mode: str, chosen: str, matched: Mapping[str, int], alive: Collection[str],
               kv_bytes_per_token: int, bandwidth_bytes_per_s: float, compute_tokens_per_s: float | None,
               overhead_s: float = FETCH_OVERHEAD_S) -> FetchPlan | None:
    """The fetch for a prompt routed to `chosen`, or None to compute it all there.
    `matched`: prompt tokens each node caches as a prefix; `alive`: live nodes."""
    if mode not in MODES:
        raise ValueError(f"unknown peer_fetch mode {mode!r}; expected one of {', '.join(MODES)}")
    if mode == "off":
        return None
    own = matched.get(chosen, 0)
    peers = sorted((-tokens, name) for name, tokens in matched.items()
                   if name != chosen and name in alive and tokens > own)
    if not peers:
        return None
    tokens, peer = -peers[0][0], peers[0][1]
    extra = tokens - own
    fetch_s = overhead_s + extra * kv_bytes_per_token / bandwidth_bytes_per_s
    compute_s = extra / compute_tokens_per_s if compute_tokens_per_s else None
    if mode == "auto" and (compute_s is None or fetch_s >= compute_s):
        return None
    return FetchPlan(peer, tokens, fetch_s, compute_s)
