"""`Generation` against backends that misbehave: the gateway guards the client."""

from __future__ import annotations

import pytest

from lamina.gateway.backend import BackendError, BackendStats
from lamina.gateway.generation import Generation
from lamina.gateway.journal import RequestJournal
from lamina.gateway.metrics import GatewayMetrics
from lamina.gateway.protocol import GenerateRequest, SamplingParams, TokenEvent


class ListBackend:
    """Sends the given events, whatever the request asked for."""

    def __init__(self, events: list[TokenEvent]) -> None:
        self.events = events
        self.aborted: list[str] = []

    async def generate(self, request: GenerateRequest):
        async def events():
            for e in self.events:
                yield e
        return events()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> BackendStats:
        return BackendStats(0, 0)


async def run(backend: ListBackend, tokenizer, max_tokens: int = 50, stop: tuple[str, ...] = ()):
    journal = RequestJournal()
    request = GenerateRequest("r", (1, 2), SamplingParams(max_tokens=max_tokens, stop=stop), 0.0)
    gen = Generation(request, backend, tokenizer, journal, GatewayMetrics(backend, "m"))
    async with gen:
        deltas = [d async for d in gen]
    assert len(journal) == 0
    return gen, deltas


async def test_tokens_past_max_tokens_are_cut_and_the_backend_aborted(tokenizer):
    ids = tokenizer.encode("one two three four five")
    backend = ListBackend([TokenEvent(ids[:2]), TokenEvent(ids[2:])])
    gen, deltas = await run(backend, tokenizer, max_tokens=3)
    assert gen.num_completion_tokens == 3 and gen.finish_reason == "length"
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids[:3]) and deltas[-1].finish_reason == "length"
    assert backend.aborted == ["r"]


async def test_empty_events_are_harmless(tokenizer):
    ids = tokenizer.encode("hello")
    eos = tokenizer.eos_token_ids[0]
    backend = ListBackend([TokenEvent([]), TokenEvent(ids), TokenEvent([]), TokenEvent([eos], "stop")])
    gen, _deltas = await run(backend, tokenizer)
    assert gen.text == "hello" and gen.num_completion_tokens == len(ids) + 1 and backend.aborted == []


async def test_a_backend_that_gives_up_is_an_error(tokenizer):
    with pytest.raises(BackendError, match=r"the backend ended the request \(abort\)"):
        await run(ListBackend([TokenEvent([5]), TokenEvent([], "abort")]), tokenizer)


async def test_a_stream_that_ends_without_a_finish_reason_is_an_error(tokenizer):
    backend = ListBackend([TokenEvent([5])])
    with pytest.raises(BackendError, match="ended without a finish reason"):
        await run(backend, tokenizer)
    assert backend.aborted == ["r"]
