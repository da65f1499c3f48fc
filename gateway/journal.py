"""The request journal: each live request's prompt and the tokens generated so far.

The gateway writes it (`begin` at admission, `extend` on each token event, `end` when
the request is over for any reason) for a backend that wants prompt and generated ids
(`get` / `request_ids`). The stack's scheduler does not read it: it rebuilds a lost
attention worker's KV from its own records and its journal in Redis (services/scheduler/journal.py).

Ownership: one journal per app, created by whoever builds the app (and handed to
the backend that needs it). It is touched only from the event loop's thread, so
it takes no lock; `get` returns an immutable snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class JournalEntry:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    generated_token_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.generated_token_ids)

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + self.generated_token_ids


class RequestJournal:
    def __init__(self) -> None:
        # request id -> (prompt ids, generated ids); the generated list only grows.
        self._entries: dict[str, tuple[tuple[int, ...], list[int]]] = {}

    def begin(self, request_id: str, prompt_token_ids: Iterable[int]) -> None:
        if request_id in self._entries:
            raise KeyError(f"request {request_id!r} is already in the journal")
        self._entries[request_id] = (tuple(prompt_token_ids), [])

    def extend(self, request_id: str, token_ids: Iterable[int]) -> None:
        self._entries[request_id][1].extend(token_ids)

    def end(self, request_id: str) -> None:
        """Forget a finished or aborted request; a no-op when it is not there."""
        self._entries.pop(request_id, None)

    def get(self, request_id: str) -> JournalEntry | None:
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        return JournalEntry(request_id, entry[0], tuple(entry[1]))

    def request_ids(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)
