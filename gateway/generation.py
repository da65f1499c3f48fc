"""One request's run through the backend: admission, events, text, journal, metrics.

`Generation` is an async context manager that owns the backend request:
entering admits it (raising `QueueFullError` / `BackendError`), iterating yields
text deltas, and leaving always ends it. If the gateway stops reading before the
backend's last event (stop string, client disconnect, cancellation, shutdown),
leaving awaits `backend.abort` and then closes the event stream, so the backend
frees the request before the handler returns.

A request of n > 1 choices has one `ChoiceOutput` per choice (its own text, stop
strings, logprobs and finish reason), fed by the events naming it; a choice ended by a
stop string is aborted alone (`backend.abort(request_id, index)`) while the others go
on, and iteration ends when every choice has.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from lamina.gateway.backend import Backend, BackendError
from lamina.gateway.journal import RequestJournal
from lamina.gateway.metrics import GatewayMetrics
from lamina.gateway.output import OutputProcessor
from lamina.gateway.protocol import GenerateRequest, TokenLogprobs
from lamina.gateway.tool_calls import ToolCall, ToolCallSplitter
from lamina.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class Delta:
    text: str
    finish_reason: str | None  # "stop", "length" or "tool_calls" on the choice's last delta
    # The logprobs of the tokens that arrived since the last delta (their text may be
    # held back behind a possible stop string); empty unless the request asked for them.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # The ids of the tokens that arrived since the last delta (the same tokens as `logprobs`'s).
    token_ids: list[int] = field(default_factory=list)
    index: int = 0  # the choice it belongs to
    # With the choice's last delta, when its output was tool calls (finish_reason "tool_calls").
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChoiceOutput:
    """One choice's output: text (stop strings applied), ids, logprobs, finish reason.

    With `tools` (a request whose output may hold tool calls) the text goes through the
    splitter: `text` is the content alone, and `tool_calls` the calls, set at the end."""

    def __init__(self, index: int, output: OutputProcessor, tools: ToolCallSplitter | None = None) -> None:
        self.index = index
        self.output = output
        self._tools = tools
        self.tool_calls: list[ToolCall] = []
        self.logprobs: list[TokenLogprobs] = []  # every generated token's, when asked for
        self.finish_reason: str | None = None  # set when the client has its last delta
        self.backend_done = False  # the backend sent its last event for this choice
        self._sent_logprobs = 0  # of self.logprobs, those already in a delta
        self._sent_ids = 0  # of the generated ids, those already in a delta
        # When this choice's last tokens came: gaps between tokens are per choice (the
        # choices of one request decode side by side, so their events interleave).
        self.last_token_at: float | None = None

    @property
    def text(self) -> str:
        return self.output.text if self._tools is None else self._tools.content

    @property
    def token_ids(self) -> list[int]:
        return list(self.output.token_ids)

    @property
    def num_tokens(self) -> int:
        return self.output.num_tokens

    def delta(self, text: str, finish_reason: str | None) -> Delta:
        """The delta of `text` and the tokens (ids, logprobs) that came since the last one."""
        calls: list[ToolCall] = []
        if self._tools is not None:
            text = self._tools.feed(text)
            if finish_reason is not None:
                rest, calls = self._tools.finish()
                text += rest
                self.tool_calls = calls
                if calls and finish_reason == "stop":
                    finish_reason = self.finish_reason = "tool_calls"
            elif not text:  # held back: its tokens come with the next delta
                return Delta("", None, index=self.index)
        out = Delta(text, finish_reason, self.logprobs[self._sent_logprobs:],
                    self.output.token_ids[self._sent_ids:], self.index, calls)
        self._sent_logprobs, self._sent_ids = len(self.logprobs), self.output.num_tokens
        return out


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
        tool_use = request.tool_use
        sp = request.sampling
        self.choices = [ChoiceOutput(i, OutputProcessor(tokenizer, sp.stop, stop_ids, sp.min_tokens,
                                                        sp.include_stop_str_in_output, sp.skip_special_tokens),
                                     None if tool_use is None else ToolCallSplitter(tool_use.may_answer_in_text))
                        for i in range(request.n)]
        self._events: AsyncIterator | None = None
        self._deltas_iter: AsyncGenerator[Delta, None] | None = None
        self._start = time.monotonic() if arrived is None else arrived
        self._first_token_seen = False
        self.prompt_logprobs: list[TokenLogprobs] = []  # prompt tokens 1.., when asked for (echo)
        self.num_cached_tokens = 0  # of the prompt's, those the backend's prefix cache served

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        """Every choice's tokens."""
        return sum(c.num_tokens for c in self.choices)

    # The first choice's output (the only one unless the request asked for n > 1).
    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def logprobs(self) -> list[TokenLogprobs]:
        return self.choices[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    def _journal_id(self, index: int) -> str:
        """Each choice's journal entry: the request's id, with /i when it has several."""
        rid = self.request.request_id
        return rid if self.request.n == 1 else f"{rid}/{index}"

    async def __aenter__(self) -> Generation:
        # Journal first: the backend may need the entry as soon as it has admitted the request.
        for c in self.choices:
            self._journal.begin(self._journal_id(c.index), self.request.prompt_token_ids)
        # In flight from here: the backend may take a long prompt's prefill before it answers.
        self._metrics.requests_in_flight.inc()
        try:
            self._events = await self._backend.generate(self.request)
        except BaseException:
            self._metrics.requests_in_flight.dec()
            self._end_journal()
            raise
        self._metrics.prompt_tokens.inc(self.num_prompt_tokens)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            if self._deltas_iter is not None:
                await self._deltas_iter.aclose()
            if not all(c.backend_done for c in self.choices):
                await self._backend.abort(self.request.request_id)
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                result = aclose()
                if inspect.isawaitable(result):
                    await result
        finally:
            self._end_journal()
            self._metrics.requests_in_flight.dec()

    def _end_journal(self) -> None:
        for c in self.choices:
            self._journal.end(self._journal_id(c.index))

    def __aiter__(self) -> AsyncIterator[Delta]:
        if self._deltas_iter is None:
            self._deltas_iter = self._deltas()
        return self._deltas_iter

    async def _deltas(self) -> AsyncGenerator[Delta, None]:
        assert self._events is not None, "enter the Generation before iterating it"
        max_tokens = self.request.sampling.max_tokens
        async for event in self._events:
            now = time.monotonic()
            if not 0 <= event.index < len(self.choices):
                raise BackendError(f"the backend sent tokens of choice {event.index} of {len(self.choices)}")
            choice = self.choices[event.index]
            if event.cached_tokens is not None:
                self.num_cached_tokens = event.cached_tokens
            ids = list(event.token_ids)
            reason = event.finish_reason
            if reason is not None:
                choice.backend_done = True
                if choice.finish_reason is None and reason not in ("stop", "length"):
                    raise BackendError(f"the backend ended the request ({reason})")
            if choice.finish_reason is not None:
                continue  # a choice this side ended (stop string): what its abort overtook
            # The backend enforces max_tokens; this guards the client against one that does not.
            room = max_tokens - choice.num_tokens
            if len(ids) >= room:
                ids = ids[:room]
                reason = reason or "length"
            choice.logprobs.extend(event.logprobs[:len(ids)])
            self.prompt_logprobs.extend(event.prompt_logprobs)
            if ids:
                self._journal.extend(self._journal_id(choice.index), ids)
                if not self._first_token_seen:
                    self._metrics.time_to_first_token.observe(now - self._start)
                    self._first_token_seen = True
                gap = None if choice.last_token_at is None else now - choice.last_token_at
                self._metrics.observe_tokens(len(ids), gap)
                choice.last_token_at = now
            text = choice.output.add(ids, reason)
            if choice.output.stopped:
                reason = "stop"
            if reason is not None:
                choice.finish_reason = reason
                if all(c.finish_reason is not None for c in self.choices):
                    self._metrics.request_latency.observe(now - self._start)
                    yield choice.delta(text, reason)
                    return
                if not choice.backend_done:  # ended here (stop string, max_tokens): the others go on
                    await self._backend.abort(self.request.request_id, choice.index)
                yield choice.delta(text, reason)
            elif text:
                yield choice.delta(text, None)
        raise BackendError("the backend's event stream ended without a finish reason")
