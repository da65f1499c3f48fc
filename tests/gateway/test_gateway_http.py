"""The gateway over real HTTP on loopback, driven by the official OpenAI client."""

from __future__ import annotations

import asyncio

import openai
import pytest
from gateway_helpers import CONTEXT, MODEL, SCRIPT_TEXT, serve

from lamina.gateway.config import GatewayConfig
from lamina.gateway.state import JOURNAL_KEY, STATE_KEY

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


async def test_chat_completion(tokenizer, make_backend, script_ids):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        resp = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0.5, top_p=0.9, seed=7, max_tokens=100,
            extra_body={"top_k": 20})
        await client.close()
    assert resp.object == "chat.completion" and resp.model == MODEL and resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert (choice.index, choice.message.role, choice.message.content, choice.finish_reason) == (
        0, "assistant", SCRIPT_TEXT, "stop")
    prompt_ids = tokenizer.encode_chat(MESSAGES)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (
        len(prompt_ids), len(script_ids) + 1, len(prompt_ids) + len(script_ids) + 1)  # + EOS
    [req] = backend.requests
    assert req.request_id == resp.id and list(req.prompt_token_ids) == prompt_ids
    s = req.sampling
    assert (s.temperature, s.top_p, s.seed, s.max_tokens, s.top_k) == (0.5, 0.9, 7, 100, 20)
    assert backend.aborted == []  # it finished: nothing to abort
    assert backend.journaled_at_admission == [True]


async def test_chat_without_max_tokens_may_fill_the_context(tokenizer, make_backend):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                             extra_body={"max_completion_tokens": None})
        await client.close()
    assert backend.requests[0].sampling.max_tokens == CONTEXT - len(tokenizer.encode_chat(MESSAGES))


async def test_chat_stream_with_usage(tokenizer, make_backend, script_ids):
    backend = make_backend(chunk=3)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await client.close()
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *content_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == SCRIPT_TEXT
    assert [c.choices[0].finish_reason for c in content_chunks][-2:] == [None, "stop"]
    assert all(c.usage is None for c in content_chunks)
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (
        len(tokenizer.encode_chat(MESSAGES)), len(script_ids) + 1)


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_continuous_usage_stats_puts_the_counts_so_far_in_every_chunk(tokenizer, make_backend, script_ids,
                                                                              kind):
    backend = make_backend(chunk=3)
    options = {"include_usage": True, "continuous_usage_stats": True}
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        if kind == "chat":
            stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                          stream_options=options)
            num_prompt = len(tokenizer.encode_chat(MESSAGES))
        else:
            stream = await client.completions.create(model=MODEL, prompt="Paris", stream=True, max_tokens=100,
                                                     stream_options=options)
            num_prompt = len(tokenizer.encode("Paris"))
        chunks = [c async for c in stream]
        await client.close()
    *content_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(script_ids) + 1
    counts = [c.usage.completion_tokens for c in content_chunks]
    assert all(c.usage.prompt_tokens == num_prompt for c in chunks)
    assert counts == sorted(counts) and counts[-1] == len(script_ids) + 1
    assert all(c.usage.total_tokens == num_prompt + c.usage.completion_tokens for c in chunks)


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_usage_names_the_prompt_tokens_the_prefix_cache_served(tokenizer, make_backend, kind):
    """usage.prompt_tokens_details.cached_tokens: what the backend reported with the first
    token, in the response, in the stream's usage chunk, and counted once for n choices;
    0 from a backend that reports none."""
    async def ask(srv, **kwargs):
        client = srv.client()
        if kind == "chat":
            return await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, **kwargs)
        return await client.completions.create(model=MODEL, prompt="Paris", max_tokens=6, **kwargs)

    async with serve(make_backend(chunk=2, cached_tokens=16), tokenizer) as srv:
        whole = await ask(srv)
        two = await ask(srv, n=2)
        stream = await ask(srv, stream=True, stream_options={"include_usage": True})
        *_, usage_chunk = [c async for c in stream]
    async with serve(make_backend(), tokenizer) as srv:
        uncached = await ask(srv)
    assert whole.usage.prompt_tokens_details.cached_tokens == 16
    assert two.usage.prompt_tokens_details.cached_tokens == 16 and len(two.choices) == 2
    assert usage_chunk.choices == [] and usage_chunk.usage.prompt_tokens_details.cached_tokens == 16
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert uncached.usage.prompt_tokens_details.cached_tokens == 0


async def test_chat_logprobs_parse_into_the_clients_types(tokenizer, make_backend, script_ids):
    async with serve(make_backend(chunk=3), tokenizer) as srv:
        client = srv.client()
        resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2)
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True,
                                                      top_logprobs=2, stream=True)
        chunks = [c async for c in stream]
        plain = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
        await client.close()
    eos = tokenizer.eos_token_ids[0]
    content = resp.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t], skip_special_tokens=False)
                                          for t in script_ids + [eos]]
    assert all(c.logprob == -0.25 and c.bytes == list(c.token.encode()) for c in content)
    assert [(a.token, a.logprob) for a in content[0].top_logprobs] == [
        (tokenizer.decode([script_ids[0] + 1], skip_special_tokens=False), -1.0),
        (tokenizer.decode([script_ids[0] + 2], skip_special_tokens=False), -2.0)]
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob, e.top_logprobs) for e in streamed] == [
        (e.token, e.logprob, e.top_logprobs) for e in content]
    assert plain.choices[0].logprobs is None


async def test_completion_logprobs_in_the_legacy_shape(tokenizer, make_backend, script_ids):
    async with serve(make_backend(chunk=2), tokenizer) as srv:
        client = srv.client()
        resp = await client.completions.create(model=MODEL, prompt="Paris", max_tokens=5, logprobs=1)
        stream = await client.completions.create(model=MODEL, prompt="Paris", max_tokens=5, logprobs=1,
                                                 stream=True)
        chunks = [c async for c in stream]
        await client.close()
    lp = resp.choices[0].logprobs
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in script_ids[:5]]
    assert lp.tokens == texts and lp.token_logprobs == [-0.25] * 5
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(5)]
    assert lp.top_logprobs[0] == {texts[0]: -0.25, tokenizer.decode([script_ids[0] + 1]): -1.0}
    pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == lp.tokens
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset


async def test_echo_with_logprobs_scores_the_prompt(tokenizer, make_backend, script_ids):
    prompt = [tokenizer.encode("Paris")[0], 5, 9]
    async with serve(make_backend(), tokenizer) as srv:
        client = srv.client()
        only = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        both = await client.completions.create(model=MODEL, prompt="Paris", max_tokens=2, echo=True, logprobs=0)
        plain = await client.completions.create(model=MODEL, prompt="Paris", max_tokens=2, echo=True)
        await client.close()
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in prompt]
    assert only.choices[0].text == tokenizer.decode(prompt) and only.choices[0].finish_reason == "length"
    assert (only.usage.prompt_tokens, only.usage.completion_tokens) == (3, 0)
    lp = only.choices[0].logprobs
    assert lp.tokens == texts and lp.token_logprobs == [None, -0.25, -0.25]
    assert lp.top_logprobs[0] is None
    assert lp.top_logprobs[1] == {texts[1]: -0.25, tokenizer.decode([6], skip_special_tokens=False): -1.0}
    assert lp.text_offset == [0, len(texts[0]), len(texts[0]) + len(texts[1])]
    assert both.choices[0].text == "Paris" + tokenizer.decode(script_ids[:2])
    assert len(both.choices[0].logprobs.tokens) == len(tokenizer.encode("Paris")) + 2
    assert plain.choices[0].text == both.choices[0].text and plain.choices[0].logprobs is None


async def test_chat_stream_without_usage_has_no_usage_chunk(tokenizer, make_backend):
    async with serve(make_backend(), tokenizer) as srv:
        client = srv.client()
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        chunks = [c async for c in stream]
        await client.close()
    assert chunks[-1].choices[0].finish_reason == "stop" and all(c.choices for c in chunks)


async def test_completion_with_length_limit(tokenizer, make_backend, script_ids):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        resp = await client.completions.create(model=MODEL, prompt="Tell me about Paris.", max_tokens=6)
        await client.close()
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert resp.choices[0].text == tokenizer.decode(script_ids[:6])
    assert resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (
        len(tokenizer.encode("Tell me about Paris.")), 6)


async def test_completion_default_max_tokens_is_16(tokenizer, make_backend):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        resp = await client.completions.create(model=MODEL, prompt="Paris")
        await client.close()
    assert backend.requests[0].sampling.max_tokens == 16 and resp.usage.completion_tokens == 16


async def test_completion_stream_from_token_ids(tokenizer, make_backend, script_ids):
    backend = make_backend(chunk=2)
    prompt = [1, 2, 3, 4, 5]
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        stream = await client.completions.create(model=MODEL, prompt=prompt, stream=True, max_tokens=50,
                                                 stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await client.close()
    assert list(backend.requests[0].prompt_token_ids) == prompt
    *text_chunks, usage_chunk = chunks
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == SCRIPT_TEXT
    assert text_chunks[-1].choices[0].finish_reason == "stop"
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (5, len(script_ids) + 1)


async def test_stop_string_non_stream(tokenizer, make_backend):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stop=["Paris", "Rome"])
        journal_left = len(srv.app[JOURNAL_KEY])
        await client.close()
    assert resp.choices[0].message.content == "The capital of France is "
    assert resp.choices[0].finish_reason == "stop"
    assert backend.aborted == [resp.id]  # the backend was still generating
    assert resp.usage.completion_tokens == len(tokenizer.encode("The capital of France is Paris"))
    assert journal_left == 0


async def test_stop_string_stream(tokenizer, make_backend):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        stream = await client.completions.create(model=MODEL, prompt="x", stream=True, stop="Eiffel",
                                                 max_tokens=50)
        chunks = [c async for c in stream]
        await client.close()
    text = "".join(c.choices[0].text for c in chunks)
    assert text == "The capital of France is Paris. It is known for the "
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert backend.aborted == [chunks[0].id]


async def test_journal_holds_generated_tokens_while_running(tokenizer, make_backend, script_ids):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        await client.completions.create(model=MODEL, prompt="x", max_tokens=50)
        await client.close()
    # Before producing token i the backend saw the i tokens it had already sent.
    assert backend.journal_seen[:5] == [tuple(script_ids[:i]) for i in range(5)]


@pytest.mark.parametrize("kwargs, param, fragment", [
    ({"n": 17}, "n", "must be at most 16, got 17"),
    ({"n": 0}, "n", "must be at least 1, got 0"),
    ({"max_tokens": "5"}, "max_tokens", "expected an integer, but got a string"),
    ({"temperature": [1]}, "temperature", "expected a number, but got an array"),
    ({"stop": 3}, "stop", "expected a string or an array of strings"),
    ({"extra_body": {"top_k": "all"}}, "top_k", "expected an integer"),
])
async def test_invalid_parameters_are_400_with_param(tokenizer, make_backend, kwargs, param, fragment):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        await client.close()
    assert info.value.status_code == 400 and info.value.param == param
    assert fragment in info.value.body["message"] and info.value.body["type"] == "invalid_request_error"
    assert backend.requests == []


async def test_unknown_model_is_404(tokenizer, make_backend):
    async with serve(make_backend(), tokenizer) as srv:
        client = srv.client()
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(model="gpt-9", messages=MESSAGES)
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-9")
        await client.close()
    assert info.value.code == "model_not_found" and info.value.param == "model"
    assert info.value.body["message"] == "The model `gpt-9` does not exist or you do not have access to it."


async def test_a_path_the_server_does_not_serve_is_a_404_that_names_it(tokenizer, make_backend):
    async with serve(make_backend(), tokenizer) as srv:
        client = srv.client()
        with pytest.raises(openai.NotFoundError) as info:
            await client.embeddings.create(model=MODEL, input="hello")
        with pytest.raises(openai.NotFoundError) as images:
            await client.images.generate(model=MODEL, prompt="a lighthouse")
        await client.close()
    message = info.value.body["message"]
    assert message.startswith("POST /v1/embeddings is not served by this server, which serves ")
    assert "POST /v1/chat/completions" in message and "POST /v1/completions" in message
    assert "GET /v1/models" in message and info.value.body["type"] == "invalid_request_error"
    assert images.value.body["message"].startswith("POST /v1/images/generations is not served by this server")


async def test_prompt_over_the_context_is_400(tokenizer, make_backend):
    backend = make_backend()
    long_prompt = "word " * (CONTEXT + 10)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model=MODEL, prompt=long_prompt)
        with pytest.raises(openai.BadRequestError) as info2:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=CONTEXT)
        await client.close()
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    assert info2.value.code == "context_length_exceeded" and info2.value.param == "max_completion_tokens"
    assert backend.requests == []


async def test_backend_queue_full_is_429(tokenizer, make_backend):
    async with serve(make_backend(queue_full=True), tokenizer) as srv:
        client = srv.client()
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        await client.close()
        assert len(srv.app[JOURNAL_KEY]) == 0
    assert info.value.status_code == 429 and info.value.code == "queue_full"
    assert info.value.response.headers["retry-after"] == "1"


async def test_gateway_max_queue_is_429(tokenizer, make_backend):
    backend = make_backend(num_waiting=4)
    config = GatewayConfig(port=0, max_queue=4)
    async with serve(backend, tokenizer, config) as srv:
        client = srv.client()
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model=MODEL, prompt="x")
        backend.num_waiting = 3
        resp = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        await client.close()
    assert resp.choices[0].finish_reason == "length" and len(backend.requests) == 1


async def test_api_key(tokenizer, make_backend):
    async with serve(make_backend(), tokenizer, GatewayConfig(port=0, api_key="sekrit")) as srv:
        bad = srv.client(api_key="wrong")
        with pytest.raises(openai.AuthenticationError) as info:
            await bad.models.list()
        await bad.close()
        good = srv.client(api_key="sekrit")
        models = await good.models.list()
        resp = await good.completions.create(model=MODEL, prompt="x", max_tokens=1)
        await good.close()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    assert [m.id for m in models.data] == [MODEL] and resp.usage.completion_tokens == 1


async def test_models(tokenizer, make_backend):
    async with serve(make_backend(), tokenizer) as srv:
        client = srv.client()
        models = await client.models.list()
        model = await client.models.retrieve(MODEL)
        await client.close()
    assert [(m.id, m.object, m.owned_by) for m in models.data] == [(MODEL, "model", "lamina")]
    assert model.id == MODEL and model.model_extra["max_model_len"] == CONTEXT


async def test_client_disconnect_mid_stream_aborts_the_backend_request(tokenizer, make_backend):
    backend = make_backend(stall_after=3)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        first = await anext(aiter(stream))
        await asyncio.wait_for(backend.stalled.wait(), 5)
        await stream.close()  # the client goes away while the backend is between tokens
        await asyncio.wait_for(backend.abort_done.wait(), 5)
        await client.close()
        journal = srv.app[JOURNAL_KEY]
        assert backend.aborted == [first.id]
        assert len(journal) == 0 and backend.num_running == 0
        metrics = srv.app[STATE_KEY].metrics.render().decode()
        assert 'lamina_gateway_requests_total{route="/v1/chat/completions",status="499"} 1.0' in metrics
        assert "lamina_gateway_requests_in_flight 0.0" in metrics


async def test_client_disconnect_while_waiting_for_a_non_stream_response_aborts(tokenizer, make_backend):
    backend = make_backend(stall_after=3)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        waiting = asyncio.create_task(client.completions.create(model=MODEL, prompt="x", max_tokens=50))
        await asyncio.wait_for(backend.stalled.wait(), 5)
        waiting.cancel()  # the client gives up and closes its connection
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(backend.abort_done.wait(), 5)
        await client.close()
        assert backend.aborted == [backend.requests[0].request_id] and len(srv.app[JOURNAL_KEY]) == 0


async def test_client_disconnect_is_noticed_on_write_without_handler_cancellation(tokenizer, make_backend):
    backend = make_backend(stall_after=2)
    async with serve(backend, tokenizer, handler_cancellation=False) as srv:
        client = srv.client()
        stream = await client.completions.create(model=MODEL, prompt="x", stream=True, max_tokens=50)
        first = await anext(aiter(stream))
        await asyncio.wait_for(backend.stalled.wait(), 5)
        await stream.close()
        # Release tokens one at a time until writing one fails and the gateway aborts.
        for _ in range(20):
            backend.release.put_nowait(1)
            try:
                await asyncio.wait_for(backend.abort_done.wait(), 0.2)
                break
            except TimeoutError:
                continue
        await client.close()
    assert backend.aborted == [first.id] and backend.num_running == 0


async def test_backend_failure(tokenizer, make_backend):
    async with serve(make_backend(fail_after=4), tokenizer) as srv:
        client = srv.client()
        with pytest.raises(openai.InternalServerError) as info:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=50)
        stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=50, stream=True)
        with pytest.raises(openai.APIError) as stream_info:
            async for _ in stream:
                pass
        await client.close()
    assert info.value.code == "backend_error" and "scripted failure" in info.value.body["message"]
    assert "scripted failure" in stream_info.value.message


async def test_shutdown_ends_in_flight_streams_and_aborts_them(tokenizer, make_backend):
    backend = make_backend(stall_after=2)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        first = await anext(aiter(stream))
        await asyncio.wait_for(backend.stalled.wait(), 5)
        stopping = asyncio.create_task(srv.stop())
        with pytest.raises(openai.APIError) as info:
            async for _ in stream:
                pass
        await stopping
        await client.close()
    assert "shutting down" in info.value.message
    assert backend.aborted == [first.id] and backend.num_running == 0


async def test_return_token_ids_extension(tokenizer, make_backend, script_ids):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        resp = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=100,
                                               extra_body={"return_token_ids": True})
        plain = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
        # Streamed, each chunk carries the ids of the tokens it brings (the EOS in the last).
        chat_chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, extra_body={"return_token_ids": True})]
        text_chunks = [c async for c in await client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=100, stream=True, extra_body={"return_token_ids": True})]
        plain_chunks = [c async for c in await client.completions.create(model=MODEL, prompt="Hi", stream=True)]
        await client.close()
    ids = resp.choices[0].model_extra["token_ids"]
    assert ids[:-1] == list(script_ids) and ids[-1] in tokenizer.eos_token_ids  # the EOS id included
    assert len(ids) == resp.usage.completion_tokens
    assert "token_ids" not in (plain.choices[0].model_extra or {})
    for chunks in (chat_chunks[1:], text_chunks):  # the chat's first chunk is the role's
        assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == ids
        assert all(c.choices[0].model_extra["token_ids"] for c in chunks if getattr(c.choices[0], "text", None)
                   or getattr(getattr(c.choices[0], "delta", None), "content", None))
    assert "token_ids" not in (chat_chunks[0].choices[0].model_extra or {})
    assert all("token_ids" not in (c.choices[0].model_extra or {}) for c in plain_chunks)
