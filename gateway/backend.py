"""What the gateway needs from whatever generates tokens.

The local engine (in-process) and the scheduler client (gRPC) both implement
`Backend`. The gateway owns text: it tokenizes prompts, detokenizes output and
applies stop strings; the backend sees only token ids.

Contract, per request id:
- `await backend.generate(request)` admits the request and returns its event
  stream; admission failure raises `QueueFullError` (the gateway answers 429)
  or `RequestRefusedError` (400) before any event. Other failures raise
  `BackendError`, at admission or from the stream.
- The stream yields `TokenEvent`s in order; the last one carries a
  `finish_reason` and the stream ends after it. A request of `n` > 1 choices
  interleaves every choice's events, each naming its choice (`index`); each choice
  ends with its own finish reason, and the stream ends after the last of them.
- When the gateway stops reading before the last event (client disconnect,
  stop string, shutdown) it awaits `abort(request_id)` and then closes the
  stream (`aclose()` when it has one). `abort` must be idempotent and a no-op
  for unknown or finished requests; after it returns, the backend holds no
  resources for the request. `abort(request_id, index)` ends that choice alone (a
  stop string ended it), with a last event for it whose finish reason the gateway
  ignores.
- `stats()` is called from the event loop (at admission and on each metrics
  scrape) and must not block.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from lamina.gateway.protocol import GenerateRequest, TokenEvent


@dataclass(frozen=True)
class BackendStats:
    num_waiting: int  # admitted, not yet scheduled
    num_running: int  # scheduled (prefill or decode)


class BackendError(Exception):
    """The backend failed a request; the message is safe to show to the client."""


class QueueFullError(BackendError):
    """The backend refused a request at admission because its queue is full."""


class RequestRefusedError(BackendError):
    """The backend refused a request at admission as it is (e.g. its prompt plus
    max_tokens exceeds the KV memory of any worker): the client's error, a 400."""


@runtime_checkable
class Backend(Protocol):
    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Admit `request` and return its events (see the module docstring)."""
        ...

    async def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop `request_id` (or only its choice `index`) and free what it holds; idempotent."""
        ...

    def stats(self) -> BackendStats:
        ...
