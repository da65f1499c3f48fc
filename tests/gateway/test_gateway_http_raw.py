"""What the OpenAI client cannot send or does not show: raw bodies, SSE framing, health, metrics."""

from __future__ import annotations

import json

import aiohttp
import pytest
from gateway_helpers import MODEL, serve

from lamina.gateway.config import GatewayConfig


async def post(url: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except json.JSONDecodeError:
                return r.status, text


async def get(url: str, headers: dict | None = None) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url, headers=headers or {}) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.text()


async def test_malformed_json_is_400(tokenizer, make_backend):
    async with serve(make_backend(), tokenizer) as srv:
        status, body = await post(srv.url + "/v1/chat/completions", b'{"model": "x", "messages": [')
        status2, body2 = await post(srv.url + "/v1/completions", b'"just a string"')
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "invalid_json"
    assert body["error"]["message"].startswith("We could not parse the JSON body of your request")
    assert status2 == 400
    assert body2["error"]["message"] == "The request body must be a JSON object, but got a string."


async def test_sse_framing(tokenizer, make_backend):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    async with serve(make_backend(), tokenizer) as srv:
        async with aiohttp.ClientSession() as session:
            async with session.post(srv.url + "/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
                raw = (await r.read()).decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert [p["choices"][0]["finish_reason"] for p in payloads[:-1]] == [None, None, "length"]
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 3
    assert all(p["usage"] is None for p in payloads[:-1])


async def test_oversized_body_is_413_in_the_openai_shape(tokenizer, make_backend):
    async with serve(make_backend(), tokenizer, GatewayConfig(port=0, max_request_bytes=4096)) as srv:
        status, body = await post(srv.url + "/v1/completions", {"model": MODEL, "prompt": "x" * 5000})
    assert status == 413 and body["error"]["message"] == "Request Entity Too Large"


async def test_unknown_route_and_method_use_the_openai_error_shape(tokenizer, make_backend):
    async with serve(make_backend(), tokenizer) as srv:
        status, _, text = await get(srv.url + "/v1/nothing")
        async with aiohttp.ClientSession() as session:
            async with session.delete(srv.url + "/v1/audio/speech") as r:
                status_delete, text_delete = r.status, await r.text()
            async with session.get(srv.url + "/v1/chat/completions") as r:
                status2, allow, text2 = r.status, r.headers.get("Allow"), await r.text()
        missing, _, text3 = await get(srv.url + "/static/no-such-file.js")
    error = json.loads(text)["error"]
    assert status == 404 and error["type"] == "invalid_request_error" and error["code"] is None
    assert error["message"].startswith("GET /v1/nothing is not served by this server, which serves ")
    assert all(f" {route}" in error["message"] for route in (
        "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /v1/models/{model}"))
    assert status_delete == 404
    assert json.loads(text_delete)["error"]["message"].startswith("DELETE /v1/audio/speech is not served")
    # A path that is served, with another method: 405 with the methods it takes.
    assert status2 == 405 and allow == "POST" and json.loads(text2)["error"]["type"] == "invalid_request_error"
    assert missing == 404 and "not served" not in text3  # a served route's own 404


async def test_an_unknown_path_under_v1_wants_the_api_key_first(tokenizer, make_backend):
    async with serve(make_backend(), tokenizer, GatewayConfig(port=0, api_key="k")) as srv:
        status, body = await post(srv.url + "/v1/embeddings", {"model": MODEL, "input": "x"})
        keyed, keyed_body = await post(srv.url + "/v1/embeddings", {"model": MODEL, "input": "x"},
                                       {"Authorization": "Bearer k"})
    assert status == 401 and body["error"]["code"] == "missing_api_key"
    assert keyed == 404 and keyed_body["error"]["message"].startswith("POST /v1/embeddings is not served")


async def test_missing_api_key_is_401_but_health_and_metrics_are_open(tokenizer, make_backend):
    async with serve(make_backend(), tokenizer, GatewayConfig(port=0, api_key="k")) as srv:
        status, body = await post(srv.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
        health, _, _ = await get(srv.url + "/health")
        metrics, _, _ = await get(srv.url + "/metrics")
    assert status == 401 and body["error"]["code"] == "missing_api_key"
    assert health == 200 and metrics == 200


async def test_health(tokenizer, make_backend):
    async with serve(make_backend(), tokenizer) as srv:
        status, ctype, text = await get(srv.url + "/health")
    assert status == 200 and ctype.startswith("application/json") and json.loads(text) == {"status": "ok"}


async def test_metrics(tokenizer, make_backend):
    backend = make_backend(num_waiting=2)
    async with serve(backend, tokenizer) as srv:
        ok, _ = await post(srv.url + "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4})
        bad, _ = await post(srv.url + "/v1/completions", {"model": MODEL, "prompt": "x", "n": 17})
        status, ctype, text = await get(srv.url + "/metrics")
    assert (ok, bad, status) == (200, 400, 200) and ctype.startswith("text/plain")
    lines = set(text.splitlines())
    assert 'lamina_gateway_requests_total{route="/v1/completions",status="200"} 1.0' in lines
    assert 'lamina_gateway_requests_total{route="/v1/completions",status="400"} 1.0' in lines
    assert f'lamina_gateway_prompt_tokens_total{{model="{MODEL}"}} 3.0' in lines
    assert f'lamina_gateway_generation_tokens_total{{model="{MODEL}"}} 4.0' in lines
    assert f'lamina_gateway_time_to_first_token_seconds_count{{model="{MODEL}"}} 1.0' in lines
    assert f'lamina_gateway_inter_token_latency_seconds_count{{model="{MODEL}"}} 3.0' in lines
    assert f'lamina_gateway_request_latency_seconds_count{{model="{MODEL}"}} 1.0' in lines
    assert "lamina_gateway_requests_in_flight 0.0" in lines
    assert "lamina_backend_requests_waiting 2.0" in lines
    assert "lamina_backend_requests_running 0.0" in lines


@pytest.mark.parametrize("body, headers, status, code", [
    (b'{"model": "m", "prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}", {}, 400, "invalid_json"),  # nesting
    (b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", {}, 400, "invalid_json"),  # int digits
    (b'{"model": "m", "prompt": "x", "temperature": NaN}', {}, 400, "invalid_json"),
    (b'{"model": "m", "prompt": "x", "top_p": ' + b"1" + b"0" * 400 + b"}", {}, 400, "invalid_value"),
    (b'{"model": "m", "prompt": "x\\ud800"}', {}, 400, "invalid_value"),  # unpaired surrogate
    (b'{"model": "m", "prompt": "x"}', {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
    (b"not gzip", {"Content-Encoding": "gzip"}, 400, "invalid_body"),
    (b'{"model": "m", "prompt": "x", "seed": -1, "top_k": 4294967296}', {}, 400, "invalid_value"),
    (b'{"model": "m", "prompt": "x", "seed": 18446744073709551616}', {}, 400, "invalid_value"),
    (b'{"model": "m", "prompt": "x", "stop_token_ids": [4294967296]}', {}, 400, "invalid_value"),
])
async def test_bodies_python_cannot_take_are_4xx_not_500(tokenizer, make_backend, body, headers, status, code):
    async with serve(make_backend(), tokenizer) as srv:
        got, reply = await post(srv.url + "/v1/completions", body.replace(b'"m"', f'"{MODEL}"'.encode()), headers)
    assert (got, reply["error"]["code"]) == (status, code), reply


async def test_a_declared_length_over_the_limit_is_refused_before_the_body(tokenizer, make_backend):
    import asyncio

    async with serve(make_backend(), tokenizer, GatewayConfig(port=0, max_request_bytes=4096)) as srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(srv.url.rsplit(":", 1)[1]))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 99999999999\r\n\r\n{")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)  # no more of the body was sent
        writer.close()
    assert head.startswith(b"HTTP/1.1 413 ")


async def test_a_text_longer_than_the_context_can_spell_is_refused_untokenized(tokenizer, make_backend):
    # CONTEXT tokens spell at most CONTEXT * max_token_chars characters.
    from gateway_helpers import CONTEXT

    n = CONTEXT * tokenizer.max_token_chars + 1
    async with serve(make_backend(), tokenizer) as srv:
        status, body = await post(srv.url + "/v1/completions", {"model": MODEL, "prompt": " " * n})
        chat_status, chat = await post(srv.url + "/v1/chat/completions",
                                       {"model": MODEL, "messages": [{"role": "user", "content": "x" * n}]})
    assert (status, body["error"]["code"], body["error"]["param"]) == (400, "context_length_exceeded", "prompt")
    assert (chat_status, chat["error"]["param"]) == (400, "messages") and f"{n} characters" in chat["error"]["message"]


async def test_a_request_the_backend_refuses_as_it_is_is_a_400(tokenizer, make_backend):
    from lamina.gateway.backend import RequestRefusedError

    backend = make_backend()

    async def refuse(request):
        raise RequestRefusedError("prompt plus max_tokens (9000 tokens) exceeds the KV capacity of a worker")

    backend.generate = refuse
    async with serve(backend, tokenizer) as srv:
        status, body = await post(srv.url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 400})
    assert (status, body["error"]["code"]) == (400, "request_refused") and "KV capacity" in body["error"]["message"]


async def test_gaps_between_tokens_are_counted_per_choice(tokenizer, make_backend):
    """n = 2, 4 tokens each, their events interleaved: 3 gaps per choice (a gap from one
    choice's token to the other's is no gap between tokens), one first token."""
    async with serve(make_backend(), tokenizer) as srv:
        ok, body = await post(srv.url + "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4,
                                                             "n": 2})
        _, _, text = await get(srv.url + "/metrics")
    assert ok == 200 and len(body["choices"]) == 2
    lines = set(text.splitlines())
    assert f'lamina_gateway_generation_tokens_total{{model="{MODEL}"}} 8.0' in lines
    assert f'lamina_gateway_time_to_first_token_seconds_count{{model="{MODEL}"}} 1.0' in lines
    assert f'lamina_gateway_inter_token_latency_seconds_count{{model="{MODEL}"}} 6.0' in lines


async def test_a_stream_event_carries_every_token_whose_text_was_held_back(tokenizer):
    """Ids past the tokenizer's vocabulary (a random LLaMA's, 128k against SmolLM2's 49k)
    and a split UTF-8 character decode to no text, so their tokens come with the next event
    that has some: the benchmarks count tokens by the ids an event carries
    (stack_run.tokens_in), not by events, or they would count fewer tokens than were made."""
    from gateway_helpers import ScriptedBackend

    from lamina.planner.measure.stack_run import tokens_in

    beyond = tokenizer.vocab_size + 1000
    emoji = tokenizer.encode("🙂")  # several byte tokens, text only with the last
    assert len(emoji) > 1 and all(tokenizer.decode(emoji[:k]).strip("\ufffd") == "" for k in range(1, len(emoji)))
    hello = tokenizer.encode(" Hello")
    script = [*hello, beyond, beyond, *hello, *emoji, *hello]
    backend = ScriptedBackend(script, tokenizer.eos_token_ids[0])
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 100, "stream": True, "return_token_ids": True}
    async with serve(backend, tokenizer) as srv:
        async with aiohttp.ClientSession() as session:
            async with session.post(srv.url + "/v1/completions", json=body) as resp:
                lines = [line async for line in resp.content if line.strip()]
    counts = [tokens_in(line) for line in lines]
    events = [n for n in counts if n]
    assert sum(counts) == len(script) + 1  # the EOS comes with the last event
    assert len(events) < len(script)  # some events carried several tokens
    assert max(events) >= 3  # the two ids past the vocabulary with the next " Hello"


async def test_an_empty_content_type_is_read_as_json_as_none_is(tokenizer, make_backend):
    import asyncio

    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    async with serve(make_backend(), tokenizer) as srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(srv.url.rsplit(":", 1)[1]))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: \r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        writer.close()
    assert head.startswith(b"HTTP/1.1 200 "), head


async def test_a_biased_token_outside_the_vocabulary_is_named_by_its_key(tokenizer, make_backend):
    """As a bias out of range is: `logit_bias.ID`, not the entry's position."""
    async with serve(make_backend(), tokenizer) as srv:
        status, body = await post(srv.url + "/v1/completions",
                                  {"model": MODEL, "prompt": "x", "logit_bias": {"5": 1, "999999": 1}})
        range_status, out_of_range = await post(srv.url + "/v1/completions",
                                                {"model": MODEL, "prompt": "x", "logit_bias": {"5": 200}})
    assert (status, body["error"]["param"]) == (400, "logit_bias.999999"), body
    assert "token id 999999 is outside the vocabulary" in body["error"]["message"]
    assert (range_status, out_of_range["error"]["param"]) == (400, "logit_bias.5")
