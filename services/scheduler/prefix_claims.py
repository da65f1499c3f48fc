"""Blocks the scheduler has sent a prefill worker to compute and the metadata store may
not show yet: a pure structure, no I/O (times are passed in).

Why: a worker's blocks reach the store only after its forward ends (and the publisher's
batch, lamina.kvstore.block_publisher). A conversation's next turn often arrives while
the turn before is still queued or computing; routed by the store alone it would find
no home (or a shorter one) and could go to the other worker, which then recomputes the
whole history. So `PrefillClients` claims each routed prompt's blocks for its worker
until the prefill has answered and the store has had time to show them, and routing
reads the store's holders together with the claims (`add_to`). Claims steer routing
only: a peer fetch reads what the store shows, never a claim (the blocks may not exist
yet).

A claim lasts until `until` (the call's deadline when routed, which grows with the tokens
queued at the worker (lamina.services.scheduler.prefill_deadline), shortened to a moment
after the answer by `settle`), so a prompt routed and never sent, or a worker that
failed, leaves nothing behind for long.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixClaims:
    def __init__(self) -> None:
        self._until: dict[tuple[str, str], float] = {}  # (node, block hash) -> expiry

    def __len__(self) -> int:
        return len(self._until)

    def claim(self, node: str, hashes: Iterable[str], until: float) -> None:
        for h in hashes:
            key = (node, h)
            self._until[key] = max(self._until.get(key, until), until)

    def settle(self, node: str, hashes: Iterable[str], until: float) -> None:
        """The prompt was answered: its claims end at `until` at the latest."""
        for h in hashes:
            key = (node, h)
            if key in self._until:
                self._until[key] = min(self._until[key], until)

    def prune(self, now: float) -> None:
        for key in [k for k, t in self._until.items() if t <= now]:
            del self._until[key]

    def add_to(self, holders: Sequence[set[str]], hashes: Sequence[str], nodes: Iterable[str],
               now: float) -> list[set[str]]:
        """`holders` (the nodes holding each of `hashes`, by the store) with each of
        `nodes`' live claims added."""
        nodes = tuple(nodes)
        out = []
        for held, h in zip(holders, hashes):
            claimed = {n for n in nodes if self._until.get((n, h), now) > now}
            out.append(set(held) | claimed)
        return out
