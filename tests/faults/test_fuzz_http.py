"""Fuzzing the gateway over HTTP: malformed requests (broken JSON, wrong types, huge
numbers, invalid UTF-8, oversized bodies, wrong content types, unknown fields, absurd
sampling values, deep nesting) each get a 4xx in OpenAI's error shape; slow,
half-closed and badly framed clients only cost their own connection; requests
running beside them finish with the right tokens, and nothing answers 500.

Against the gateway with a scripted backend (fast, many requests) and against a
real stack. The seed (LAMINA_FUZZ_SEED) is printed on failure."""

from __future__ import annotations

import asyncio
import json
import os
import random

import aiohttp
import openai
import pytest
from fault_helpers import ONE_WORKER
from gateway_helpers import MODEL, SCRIPT_TEXT, ScriptedBackend, serve
from http_fuzz import BROKEN_FRAMING, MalformedRequests, check_refusal, raw_exchange, slow_client

from lamina.gateway.config import GatewayConfig

pytestmark = pytest.mark.timeout(300)

SEED = int(os.environ.get("LAMINA_FUZZ_SEED", "1123"))
CONCURRENCY = 8


async def _send(session: aiohttp.ClientSession, url: str, m) -> tuple[int, object]:
    async with session.request(m.method, url + m.path, data=m.body, headers=m.headers,
                               skip_auto_headers=["Content-Type"]) as r:
        text = await r.text()
    try:
        return r.status, json.loads(text)
    except json.JSONDecodeError:
        return r.status, text


async def _fuzz(url: str, model: str, max_request_bytes: int, count: int, beside) -> dict[str, int]:
    """`count` malformed requests, CONCURRENCY at a time, and the misbehaving raw
    clients, while `beside()` runs correct requests; returns the kinds sent."""
    port = int(url.rsplit(":", 1)[1])
    gen = MalformedRequests(random.Random(SEED), model, max_request_bytes)
    cases = gen.fixed() + [gen.next() for _ in range(count)]
    kinds: dict[str, int] = {}
    stop = asyncio.Event()

    async def keep_running() -> int:
        runs = 0
        while not stop.is_set() or runs == 0:
            await beside()
            runs += 1
        return runs

    async def worker(queue: list) -> None:
        async with aiohttp.ClientSession() as session:
            while queue:
                m = queue.pop()
                kinds[m.what.split("=")[0].split(" ")[0]] = kinds.get(m.what.split("=")[0].split(" ")[0], 0) + 1
                try:
                    status, body = await _send(session, url, m)
                except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                    # An oversized body refused while it was still being sent: the
                    # server answered and closed before taking the rest.
                    assert m.what == "oversized", m.what
                    continue
                check_refusal(m, status, body)

    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: 64\r\n\r\n{\"model\": ")
    running = asyncio.create_task(keep_running())
    try:
        queue = list(cases)
        slow = [asyncio.create_task(slow_client(port, request, gaps=len(request), gap_s=0.02)) for _ in range(3)]
        await asyncio.gather(*(worker(queue) for _ in range(CONCURRENCY)))
        for data in BROKEN_FRAMING:  # refused by the HTTP parser: a plain 400, and the connection closed
            reply = await raw_exchange(port, data, half_close=False)
            assert reply.startswith(b"HTTP/1.") and b" 400 " in reply.split(b"\r\n")[0], reply[:200]
        body = json.dumps({"model": model, "prompt": 5}).encode()
        whole = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body)) + body
        # A client that ends its side (after a whole request or part of one) has gone
        # away: the server cancels its handler and closes, or answers first.
        for cut in (len(whole), 5, len(whole) // 2, len(whole) - 3):
            reply = await raw_exchange(port, whole[:cut], half_close=True)
            assert reply == b"" or b" 400 " in reply.split(b"\r\n")[0], reply[:300]
        await asyncio.gather(*slow)
    finally:
        stop.set()
        runs = await running
    assert runs >= 1
    return kinds


async def _no_server_errors(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/health") as r:
            assert r.status == 200
        async with session.get(url + "/metrics") as r:
            text = await r.text()
    errors = [line for line in text.splitlines()
              if line.startswith("lamina_gateway_requests_total") and 'status="5' in line]
    assert not errors, errors


@pytest.fixture(scope="module")
def tokenizer():
    from lamina.model.checkpoints import load_tokenizer

    return load_tokenizer(None)[0]


async def test_malformed_requests_against_the_gateway(tokenizer, caplog):
    print(f"fuzz seed: {SEED} (set LAMINA_FUZZ_SEED to replay)")
    backend = ScriptedBackend(tokenizer.encode(SCRIPT_TEXT), tokenizer.eos_token_ids[0], chunk=3)
    config = GatewayConfig(host="127.0.0.1", port=0, shutdown_timeout=2.0, max_request_bytes=64 << 10)
    async with serve(backend, tokenizer, config) as srv:
        client = srv.client()

        async def beside() -> None:
            r = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=200, temperature=0)
            assert r.choices[0].text == SCRIPT_TEXT
            chunks = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                          max_tokens=200, temperature=0, stream=True)
            assert "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices]) == SCRIPT_TEXT

        kinds = await _fuzz(srv.url, MODEL, config.max_request_bytes, 600, beside)
        await _no_server_errors(srv.url)
    assert len(kinds) >= 14, kinds
    assert not [r for r in caplog.records if r.name.startswith("gateway") and r.levelname == "ERROR"]
    assert backend.num_running == 0


@pytest.mark.stack(ONE_WORKER)
def test_malformed_requests_against_a_real_stack(stack):
    print(f"fuzz seed: {SEED} (set LAMINA_FUZZ_SEED to replay)")

    async def scenario() -> None:
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = (await client.models.list()).data[0].id

        async def complete() -> list[int]:
            r = await client.completions.create(model=model, prompt="The three primary colours are",
                                                max_tokens=16, temperature=0,
                                                extra_body={"return_token_ids": True, "ignore_eos": True})
            return r.choices[0].model_extra["token_ids"]

        before = await complete()

        async def beside() -> None:
            assert await complete() == before

        await _fuzz(stack.base_url, model, 8 << 20, 220, beside)
        await _no_server_errors(stack.base_url)

    asyncio.run(scenario())
    assert stack.dead_process() is None
    assert "unhandled error" not in (stack.log_dir / "gateway.log").read_text()
