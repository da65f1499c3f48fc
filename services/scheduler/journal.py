"""The scheduler's request journal in the metadata store, written in batches.

Each running request's prompt, sampling parameters (seed included) and generated
tokens are kept in Redis (lamina.kvstore.metadata: NS:jrn:*), so a scheduler that starts
after another died knows which requests that one left behind: it frees their KV on
the attention workers and removes their placements and entries. Writes are
batched: changes gather in memory and one transaction per `interval_s` applies
them, so decode never waits on a Redis round trip per token.

Ownership: the Journal owns its flush task (`start()`, `close()` flushes what is
left). A failed write (Redis down) keeps the batch and tries again a second later.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections import defaultdict

from lamina.kvstore.batches import write_batches
from lamina.kvstore.metadata import REDIS_ERRORS, JournalEntry, MetadataStore
from lamina.services.protos import lamina_pb2

log = logging.getLogger(__name__)


class Journal:
    def __init__(self, store: MetadataStore, owner: str, interval_s: float = 0.05) -> None:
        self._store = store
        self._owner = owner
        self._interval_s = interval_s
        self._started: dict[str, JournalEntry] = {}
        self._tokens: defaultdict[str, list[int]] = defaultdict(list)
        self._ended: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._failing = False
        self.batches = 0  # transactions written

    def start(self) -> None:
        self._task = asyncio.create_task(write_batches(self._wake, self.flush, self._interval_s, 1.0), name="journal")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.flush()

    # -- changes ----------------------------------------------------------------------------
    def started(self, request_id: str, prompt_ids: list[int], params: lamina_pb2.SamplingParams) -> None:
        self._started[request_id] = JournalEntry(
            request_id, list(prompt_ids), base64.b64encode(params.SerializeToString()).decode(), self._owner)
        self._wake.set()

    def restore(self, request_id: str, prompt_ids: list[int], params: lamina_pb2.SamplingParams,
                output_ids: list[int]) -> None:
        """Write a running request's whole entry again (the store lost it: a restarted Redis)."""
        self._ended.discard(request_id)
        self.started(request_id, prompt_ids, params)
        self._tokens[request_id] = list(output_ids)

    def generated(self, request_id: str, token_id: int) -> None:
        self._tokens[request_id].append(token_id)
        self._wake.set()

    def ended(self, request_id: str) -> None:
        if self._started.pop(request_id, None) is not None:
            self._tokens.pop(request_id, None)  # never written: nothing to remove
            return
        self._tokens.pop(request_id, None)
        self._ended.add(request_id)
        self._wake.set()

    # -- writing ----------------------------------------------------------------------------
    async def flush(self) -> bool:
        """Write what changed since the last batch; False (changes kept) if Redis failed."""
        started, tokens, ended = self._started, dict(self._tokens), self._ended
        if not (started or tokens or ended):
            return True
        self._started, self._tokens, self._ended = {}, defaultdict(list), set()
        try:
            await self._store.write_journal(started.values(), tokens, ended)
        except REDIS_ERRORS as exc:
            if not self._failing:
                log.warning("journal: the metadata store is unreachable (%s); keeping changes until it is back", exc)
            self._failing = True
            # Put the batch back in front of what came meanwhile.
            for rid, entry in started.items():
                if rid not in self._ended:
                    self._started.setdefault(rid, entry)
            for rid, ids in tokens.items():
                if rid not in self._ended:
                    self._tokens[rid][:0] = ids
            self._ended |= ended
            return False
        if self._failing:
            log.info("journal: the metadata store is back; written")
        self._failing = False
        self.batches += 1
        return True

