"""Shared by the gateway tests: a scripted backend and a gateway served on loopback.

The backend is not a mock of anything we own: it is a small, real implementation
of the `Backend` protocol that replays a fixed token sequence, so the HTTP tests
exercise the gateway end to end with the official OpenAI client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import openai
from aiohttp import web

from lamina.gateway.app import create_app, start_server
from lamina.gateway.backend import BackendError, BackendStats, QueueFullError
from lamina.gateway.config import GatewayConfig
from lamina.gateway.journal import RequestJournal
from lamina.gateway.protocol import GenerateRequest, TokenEvent, TokenLogprobs
from lamina.model.tokenizer import Tokenizer

MODEL = "smollm2-135m-instruct"
CONTEXT = 512
# What the scripted backend "generates" (then EOS).
SCRIPT_TEXT = "The capital of France is Paris. It is known for the Eiffel Tower and fine café culture."


class ScriptedBackend:
    """Replays `tokens` (then EOS, finish "stop"), `chunk` tokens per event.

    `stall_after`: after that many tokens, wait for `release` permits, one per event
    (a permit of None ends the wait forever: the stream then waits until cancelled).
    `fail_after`: raise BackendError after that many tokens. `queue_full`: refuse
    admission. `abort` records the id after an await, so a test can tell that the
    gateway awaited it and did not just create the coroutine.

    A request of n > 1 choices: choice i replays the script from its token i on, the
    choices' events interleaved one by one; aborting one choice is recorded in
    `aborted_choices` and its events go on (the gateway must ignore them).

    `cached_tokens`: reported on the request's first event (choice 0's), as a backend
    whose prefix cache served that many prompt tokens does.
    """

    def __init__(self, tokens: list[int], eos: int, *, chunk: int = 1, stall_after: int | None = None,
                 fail_after: int | None = None, queue_full: bool = False, num_waiting: int = 0,
                 cached_tokens: int | None = None) -> None:
        self.script = list(tokens) + [eos]
        self.chunk = chunk
        self.stall_after = stall_after
        self.fail_after = fail_after
        self.queue_full = queue_full
        self.num_waiting = num_waiting
        self.cached_tokens = cached_tokens
        self.num_running = 0
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.aborted_choices: list[tuple[str, int]] = []
        self.abort_done = asyncio.Event()
        self.stalled = asyncio.Event()
        self.release: asyncio.Queue[int | None] = asyncio.Queue()
        self.journal_seen: list[tuple[int, ...]] = []  # generated ids the journal showed at each event
        self.journal: RequestJournal | None = None
        self.journaled_at_admission: list[bool] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        self.journaled_at_admission.append(self.journal is not None and request.request_id in self.journal)
        if self.queue_full:
            raise QueueFullError("scripted queue is full")
        self.requests.append(request)
        self.num_running += 1
        return self._events(request)

    async def _events(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        try:
            if request.n == 1:
                async for event in self._choice_events(request, self.script, 0):
                    yield event
                return
            streams = [self._choice_events(request, self.script[i:], i) for i in range(request.n)]
            while streams:
                for stream in list(streams):
                    try:
                        yield await anext(stream)
                    except StopAsyncIteration:
                        streams.remove(stream)
        finally:
            self.num_running -= 1

    async def _choice_events(self, request: GenerateRequest, script: list[int], index: int
                             ) -> AsyncIterator[TokenEvent]:
        journal_id = request.request_id if request.n == 1 else f"{request.request_id}/{index}"
        produced = 0
        for start in range(0, len(script), self.chunk):
            if self.journal is not None:
                entry = self.journal.get(journal_id)
                self.journal_seen.append(entry.generated_token_ids if entry else ())
            if self.fail_after is not None and produced >= self.fail_after:
                raise BackendError("scripted failure")
            if self.stall_after is not None and produced >= self.stall_after:
                self.stalled.set()
                permit = await self.release.get()
                if permit is None:
                    await asyncio.Event().wait()  # until cancelled
            piece = script[start:start + self.chunk]
            room = request.sampling.max_tokens - produced
            prompt = (scripted_logprobs(list(request.prompt_token_ids[1:]), request)
                      if request.prompt_logprobs and start == 0 and index == 0 else [])
            cached = self.cached_tokens if start == 0 and index == 0 else None
            if len(piece) >= room and start + len(piece) < len(script):
                yield TokenEvent(piece[:room], "length", scripted_logprobs(piece[:room], request), prompt, index,
                                 cached)
                return
            produced += len(piece)
            is_last = start + self.chunk >= len(script)
            yield TokenEvent(piece, "stop" if is_last else None, scripted_logprobs(piece, request), prompt, index,
                             cached)

    async def abort(self, request_id: str, index: int | None = None) -> None:
        await asyncio.sleep(0)
        if index is not None:
            self.aborted_choices.append((request_id, index))
            return
        self.aborted.append(request_id)
        self.abort_done.set()

    def stats(self) -> BackendStats:
        return BackendStats(self.num_waiting, self.num_running)


def scripted_logprobs(ids: list[int], request: GenerateRequest) -> list[TokenLogprobs]:
    """Logprobs a test can predict: -0.25 for the token, then alternatives id+1, id+2, ...
    at -1, -2, ..."""
    k = request.sampling.logprobs
    if k is None:
        return []
    return [TokenLogprobs(t, -0.25, tuple((t + j + 1, -1.0 - j) for j in range(k))) for t in ids]


class Served:
    """A gateway running on a loopback port, for one test."""

    def __init__(self, app, runner, port: int) -> None:
        self.app = app
        self.runner = runner
        self.url = f"http://127.0.0.1:{port}"
        self.is_stopped = False

    def client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        # No retries: a 429 or 5xx must reach the test as it was sent.
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=10.0)

    async def stop(self) -> None:
        if not self.is_stopped:
            self.is_stopped = True
            await self.runner.cleanup()


@contextlib.asynccontextmanager
async def serve(backend, tokenizer: Tokenizer, config: GatewayConfig | None = None, *,
                handler_cancellation: bool = True):
    """Run the gateway in front of `backend` on a free loopback port."""
    config = config or GatewayConfig(host="127.0.0.1", port=0, shutdown_timeout=2.0)
    journal = RequestJournal()
    backend.journal = journal
    app = create_app(config, backend, tokenizer, MODEL, CONTEXT, journal=journal)
    if handler_cancellation:
        runner, port = await start_server(app, "127.0.0.1", 0)
    else:
        runner = web.AppRunner(app, shutdown_timeout=2.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
    served = Served(app, runner, port)
    try:
        yield served
    finally:
        await served.stop()
