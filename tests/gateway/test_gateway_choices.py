"""`n` > 1 choices through the gateway, with the official client, against a scripted backend.

The scripted backend's choice i replays the script from its token i on, so the
choices' texts differ and each can be told from the others."""

from __future__ import annotations

import asyncio

import aiohttp
from gateway_helpers import MODEL, serve

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _texts(tokenizer, script_ids, n: int, max_tokens: int = 100) -> list[str]:
    return [tokenizer.decode(script_ids[i:][:max_tokens]) for i in range(n)]


async def test_completions_return_every_choice_and_count_their_tokens(tokenizer, make_backend, script_ids):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        r = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=100, n=3,
                                            extra_body={"return_token_ids": True})
        await client.close()
    assert backend.requests[0].n == 3
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == _texts(tokenizer, script_ids, 3)
    assert all(c.finish_reason == "stop" for c in r.choices)
    eos = tokenizer.eos_token_ids[0]
    assert [c.model_extra["token_ids"] for c in r.choices] == [script_ids[i:] + [eos] for i in range(3)]
    # The prompt counts once, every choice's tokens (EOS included) count.
    assert r.usage.prompt_tokens == len(tokenizer.encode("Hi"))
    assert r.usage.completion_tokens == sum(len(script_ids) - i + 1 for i in range(3))
    assert backend.aborted == [] and backend.aborted_choices == []


async def test_chat_stream_carries_each_choice_by_index(tokenizer, make_backend, script_ids):
    backend = make_backend(chunk=2)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=2, max_tokens=100, stream=True,
            stream_options={"include_usage": True})]
        await client.close()
    texts, roles, reasons = ["", ""], [0, 0], [None, None]
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        if choice.finish_reason is not None:
            assert reasons[choice.index] is None  # one finish per choice
            reasons[choice.index] = choice.finish_reason
    assert texts == _texts(tokenizer, script_ids, 2)
    assert roles == [1, 1] and reasons == ["stop", "stop"]
    # The choices' chunks interleave: both were streamed as they came.
    indexes = [c.choices[0].index for c in chunks[:-1] if c.choices[0].delta.content]
    assert indexes[:2] == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(script_ids) - 1 + 2


async def test_a_stop_string_ends_its_choice_alone(tokenizer, make_backend, script_ids):
    """"The" starts choice 0's text only: it stops at once, and is aborted alone, while
    choice 1 runs to its end."""
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        r = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=100, n=2, stop=["The"])
        streamed = [c async for c in await client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=100, n=2, stop=["The"], stream=True)]
        await client.close()
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    assert r.choices[1].text == _texts(tokenizer, script_ids, 2)[1] and r.choices[1].finish_reason == "stop"
    assert [rid for rid, _ in backend.aborted_choices] == [r.id, streamed[0].id]
    assert [i for _, i in backend.aborted_choices] == [0, 0]
    # The scripted backend goes on sending the aborted choice's tokens (ignored), so its
    # last event has not come when choice 1 ends: leaving aborts the request whole.
    assert backend.aborted == [r.id, streamed[0].id]
    text = "".join(c.choices[0].text for c in streamed if c.choices[0].index == 1)
    assert text == r.choices[1].text
    # Choice 0's events after its stop string are dropped: it finished once, with no text.
    assert [c.choices[0].finish_reason for c in streamed if c.choices[0].index == 0] == ["stop"]


async def test_echo_gives_every_choice_the_prompt_and_its_logprobs(tokenizer, make_backend, script_ids):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        r = await client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, n=2, echo=True,
                                            logprobs=1, extra_body={"return_token_ids": True})
        only = await client.completions.create(model=MODEL, prompt="Hello there", max_tokens=0, echo=True,
                                               extra_body={"return_token_ids": True})
        await client.close()
    prompt = tokenizer.encode("Hello there")
    for i, c in enumerate(r.choices):
        assert c.text == "Hello there" + tokenizer.decode(script_ids[i:i + 4])
        assert c.logprobs.token_logprobs[0] is None
        assert len(c.logprobs.tokens) == len(prompt) + 4
        assert c.model_extra["token_ids"] == script_ids[i:i + 4]  # the generated ids, not the echoed prompt's
    assert r.usage.completion_tokens == 8
    assert only.choices[0].text == "Hello there" and only.choices[0].model_extra["token_ids"] == []


async def test_a_client_gone_mid_stream_aborts_every_choice(tokenizer, make_backend):
    backend = make_backend(stall_after=2)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        stream = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=100, n=3, stream=True)
        seen = []
        async for c in stream:
            seen.append(c.choices[0].index)
            if len(seen) == 3:
                break
        await stream.close()
        await asyncio.wait_for(backend.abort_done.wait(), 10)
        await client.close()
    assert seen == [0, 1, 2]
    assert backend.aborted == [backend.requests[0].request_id] and backend.aborted_choices == []


async def test_n_is_checked_before_the_backend_sees_anything(tokenizer, make_backend):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        async with aiohttp.ClientSession() as http:
            for n, status in ((17, 400), ("2", 400), (True, 400), (16, 200)):
                async with http.post(srv.url + "/v1/completions",
                                     json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": n}) as resp:
                    assert resp.status == status, (n, await resp.text())
                    body = await resp.json()
                    if status == 400:
                        assert body["error"]["param"] == "n"
                    else:
                        assert [c["index"] for c in body["choices"]] == list(range(16))
    assert [r.n for r in backend.requests] == [16]


def test_n_is_parsed_for_both_endpoints():
    from lamina.gateway.protocol import parse_chat_request, parse_completion_request

    assert parse_chat_request({"model": MODEL, "messages": MESSAGES, "n": 3}).n == 3
    assert parse_chat_request({"model": MODEL, "messages": MESSAGES}).n == 1
    assert parse_completion_request({"model": MODEL, "prompt": "x", "n": 16}).n == 16
    assert parse_completion_request({"model": MODEL, "prompt": "x", "n": None}).n == 1
