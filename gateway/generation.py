"""One request's run through the backend: admission, events, text, journal, metrics.

`Generation` is an async context manager that owns the backend request:
entering admits it (raising `QueueFullError` / `BackendError`), iterating yields
text deltas, and leaving always ends it. If the gateway stops reading before the
backend's last event (stop string, client disconnect, cancellation, shutdown),
leaving awaits `backend.abort` and then closes the event stream, so the backend
frees the request before the handler returns.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from gateway.backend import Backend, BackendError
from gateway.journal import RequestJournal
from gateway.metrics import GatewayMetrics
from gateway.output import OutputProcessor
from gateway.protocol import GenerateRequest, TokenLogprobs
from model.tokenizer import Tokenizer


@dataclass(frozen=True)
class Delta:
    text: str
    finish_reason: str | None  # "stop" or "length" on the last delta
    # The logprobs of the tokens that arrived since the last delta (their text may be
    # held back behind a possible stop string); empty unless the request asked for them.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # The ids of the tokens that arrived since the last delta (the same tokens as `logprobs`'s).
    token_ids: list[int] = field(default_factory=list)


class Generation:
    def __init__(
        self,
        request: GenerateRequest,
        backend: Backend,
        tokenizer: Tokenizer,
        journal: RequestJournal,
        metrics: GatewayMetrics,
        arrived: float | None = None,
    ) -> None:
        """`arrived`: time.monotonic() when the HTTP request arrived (default: now)."""
        self.request = request
        self._backend = backend
        self._journal = journal
        self._metrics = metrics
        stop_ids = set(request.sampling.stop_token_ids)
        if not request.sampling.ignore_eos:
            stop_ids.update(tokenizer.eos_token_ids)
        self._output = OutputProcessor(tokenizer, request.sampling.stop, stop_ids, request.sampling.min_tokens)
        self._events: AsyncIterator | None = None
        self._deltas_iter: AsyncGenerator[Delta, None] | None = None
        self._start = time.monotonic() if arrived is None else arrived
        self._last_event: float | None = None
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprobs] = []  # every generated token's, when asked for
        self.prompt_logprobs: list[TokenLogprobs] = []  # prompt tokens 1.., when asked for (echo)
        self._backend_done = False  # the backend sent its last event: nothing to abort

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return self._output.num_tokens

    @property
    def text(self) -> str:
        return self._output.text

    @property
    def token_ids(self) -> list[int]:
        return list(self._output.token_ids)

    async def __aenter__(self) -> Generation:
        rid = self.request.request_id
        # Journal first: the backend may need the entry as soon as it has admitted the request.
        self._journal.begin(rid, self.request.prompt_token_ids)
        try:
            self._events = await self._backend.generate(self.request)
        except BaseException:
            self._journal.end(rid)
            raise
        self._metrics.prompt_tokens.inc(self.num_prompt_tokens)
        self._metrics.requests_in_flight.inc()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            if self._deltas_iter is not None:
                await self._deltas_iter.aclose()
            if not self._backend_done:
                await self._backend.abort(self.request.request_id)
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                result = aclose()
                if inspect.isawaitable(result):
                    await result
        finally:
            self._journal.end(self.request.request_id)
            self._metrics.requests_in_flight.dec()

    def __aiter__(self) -> AsyncIterator[Delta]:
        if self._deltas_iter is None:
            self._deltas_iter = self._deltas()
        return self._deltas_iter

    async def _deltas(self) -> AsyncGenerator[Delta, None]:
        assert self._events is not None, "enter the Generation before iterating it"
        rid = self.request.request_id
        max_tokens = self.request.sampling.max_tokens
        sent_logprobs = 0  # of self.logprobs, those already in a delta
        sent_ids = 0  # of the generated ids, those already in a delta
        async for event in self._events:
            now = time.monotonic()
            ids = list(event.token_ids)
            reason = event.finish_reason
            if reason is not None:
                self._backend_done = True
                if reason not in ("stop", "length"):
                    raise BackendError(f"the backend ended the request ({reason})")
            # The backend enforces max_tokens; this guards the client against one that does not.
            room = max_tokens - self._output.num_tokens
            if len(ids) >= room:
                ids = ids[:room]
                reason = reason or "length"
            self.logprobs.extend(event.logprobs[:len(ids)])
            self.prompt_logprobs.extend(event.prompt_logprobs)
            if ids:
                self._journal.extend(rid, ids)
                if self._last_event is None:
                    self._metrics.time_to_first_token.observe(now - self._start)
                    self._metrics.observe_tokens(len(ids), None)
                else:
                    self._metrics.observe_tokens(len(ids), now - self._last_event)
                self._last_event = now
            text = self._output.add(ids, reason)
            if self._output.stopped:
                reason = "stop"
            if reason is not None:
                self.finish_reason = reason
                self._metrics.request_latency.observe(now - self._start)
                yield Delta(text, reason, self.logprobs[sent_logprobs:], self._output.token_ids[sent_ids:])
                return
            if text:
                yield Delta(text, None, self.logprobs[sent_logprobs:], self._output.token_ids[sent_ids:])
                sent_logprobs = len(self.logprobs)
                sent_ids = self._output.num_tokens
        raise BackendError("the backend's event stream ended without a finish reason")
