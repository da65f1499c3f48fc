"""`POST /v1/responses`: OpenAI's Responses API over the chat endpoint's path.

The request becomes chat messages, sampling fields and tool use (gateway/responses_api.py),
is tokenized with the chat template and run as a `Generation` exactly as a chat request
is (handlers.py's checks, admission and error mapping), and is answered as one response
object or as the Responses API's event stream (gateway/responses_events.py).
"""

from __future__ import annotations

import time

from aiohttp import web

from lamina.gateway import responses_events as ev
from lamina.gateway.generation import Generation
from lamina.gateway.handlers import (
    chat_prompt_ids,
    check_admission,
    check_model,
    finish_generation,
    open_event_stream,
    read_json,
    run_generation,
    usage_of,
    write_event_stream,
)
from lamina.gateway.protocol import ApiError, GenerateRequest, resolve_sampling
from lamina.gateway.responses_api import parse_responses_request
from lamina.gateway.state import STATE_KEY, GatewayState


async def create_response(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    state = request.app[STATE_KEY]
    req = parse_responses_request(await read_json(request))
    check_model(state, req.model)
    prompt_ids = chat_prompt_ids(state, req.messages, "input")
    sampling = resolve_sampling(req.sampling, len(prompt_ids), state.context_length,
                                state.config.default_max_tokens, "input")
    check_admission(state)
    head = ev.ResponseHead(ev.new_id("resp"), int(time.time()), state.model_name, req.settings)
    gen_request = GenerateRequest(head.id, tuple(prompt_ids), sampling, time.time(), tool_use=req.tool_use)

    async def answer(gen: Generation) -> web.StreamResponse:
        if req.stream:
            return await _stream(request, state, gen, head)
        return await _collect(state, gen, head)

    return await run_generation(state, gen_request, arrived, answer)


async def _collect(state: GatewayState, gen: Generation, head: ev.ResponseHead) -> web.Response:
    await finish_generation(state, gen)
    choice = gen.choices[0]
    status = ev.finish_status(choice.finish_reason)
    body = ev.response_object(head, status, ev.output_items(choice.text, choice.tool_calls, status), usage_of(gen))
    return web.json_response(body, headers={"X-Request-Id": head.id})


async def _stream(request: web.Request, state: GatewayState, gen: Generation,
                  head: ev.ResponseHead) -> web.StreamResponse:
    resp = await open_event_stream(request, head.id)
    events = ev.ResponseEvents(head)

    async def written() -> None:
        await _write(resp, events.start())
        async for delta in gen:
            out = events.text(delta.text)
            if delta.finish_reason is not None:
                out += events.finish(delta.tool_calls, delta.finish_reason, usage_of(gen))
            await _write(resp, out)

    async def failed(exc: ApiError) -> None:
        await _write(resp, events.fail(exc.message, usage_of(gen)))

    await write_event_stream(resp, state, head.id, written, failed)
    return resp


async def _write(resp: web.StreamResponse, events: list[dict]) -> None:
    if events:
        await resp.write(b"".join(ev.sse(e) for e in events))
