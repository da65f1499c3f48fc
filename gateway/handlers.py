"""HTTP handlers: OpenAI endpoints, health and metrics.

Each generation handler validates and tokenizes the request, then runs it as a
`Generation` (which owns the backend request and aborts it on every early exit)
and answers either one JSON object or a server-sent event stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestPayloadError

from lamina.gateway import responses as r
from lamina.gateway.backend import BackendError, QueueFullError, RequestRefusedError
from lamina.gateway.generation import ChoiceOutput, Generation
from lamina.gateway.logprobs_json import CompletionLogprobs, chat_logprobs
from lamina.gateway.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ApiError,
    GenerateRequest,
    SamplingFields,
    SamplingParams,
    check_token_ids,
    invalid,
    parse_chat_request,
    parse_completion_request,
    resolve_sampling,
)
from lamina.gateway.state import STATE_KEY, GatewayState
from lamina.gateway.structured import ToolUse

log = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    state = request.app[STATE_KEY]
    req = parse_chat_request(await read_json(request))
    check_model(state, req.model)
    prompt_ids = chat_prompt_ids(state, req.messages, "messages")
    _check_sampling_ids(state, req.sampling)
    sampling = resolve_sampling(req.sampling, len(prompt_ids), state.context_length,
                                state.config.default_max_tokens, "messages")
    return await _generate(request, state, "chat", prompt_ids, sampling, req.stream, req.include_usage, arrived,
                           req.return_token_ids, req.continuous_usage, n=req.n, tool_use=req.tool_use)


async def completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    state = request.app[STATE_KEY]
    req = parse_completion_request(await read_json(request))
    check_model(state, req.model)
    if isinstance(req.prompt, str):
        check_text_size(state, len(req.prompt), "prompt")
        prompt_ids = state.tokenizer.encode(req.prompt)
        if not prompt_ids:
            raise invalid("Invalid value for 'prompt': it encodes to no tokens.", "prompt", "invalid_value")
    else:
        check_token_ids(req.prompt, state.vocab_size)
        prompt_ids = list(req.prompt)
    _check_sampling_ids(state, req.sampling)
    default = min(COMPLETIONS_DEFAULT_MAX_TOKENS, state.config.default_max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS)
    sampling = resolve_sampling(req.sampling, len(prompt_ids), state.context_length, default, "prompt")
    echo = None
    if req.echo:
        text = req.prompt if isinstance(req.prompt, str) else state.tokenizer.decode(prompt_ids)
        echo = Echo(text, req.prompt_only)
    return await _generate(request, state, "completion", prompt_ids, sampling, req.stream, req.include_usage,
                           arrived, req.return_token_ids, req.continuous_usage, echo, req.n)


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.json_response(r.model_list(state.model_name, state.created, state.context_length))


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    check_model(state, request.match_info["model"])
    return web.json_response(r.model_card(state.model_name, state.created, state.context_length))


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.is_draining:
        return web.json_response({"status": "shutting_down"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.Response(body=state.metrics.render(), headers={"Content-Type": state.metrics.content_type})


# --- checks and errors the handlers share (responses_handler.py too) ------


async def read_json(request: web.Request) -> Any:
    """The request's JSON body; every way it can be unreadable is the client's 4xx."""
    # An empty header counts as none (aiohttp would read it as application/octet-stream).
    if request.headers.get(hdrs.CONTENT_TYPE, "").strip() and not _is_json(request.content_type):
        raise ApiError(415, f"Unsupported Content-Type '{request.content_type}': send the request body as "
                            f"application/json.", code="unsupported_media_type")
    limit = request.app[STATE_KEY].config.max_request_bytes
    if request.content_length is not None and request.content_length > limit:
        # Refused before reading: the client may be about to send all of it.
        raise ApiError(413, "Request Entity Too Large", code="request_too_large")
    try:
        raw = await request.read()
    except RequestPayloadError as exc:  # a body that does not decompress, or broken chunked framing
        detail = getattr(exc.__cause__, "message", None) or "its framing or encoding is broken"
        raise invalid(f"We could not read the body of your request: {detail}.", code="invalid_body") from None
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise invalid("We could not parse the JSON body of your request: it is nested too deeply.",
                      code="invalid_json") from None
    except ValueError as exc:  # malformed JSON, invalid UTF-8, an integer too long to convert
        raise invalid(f"We could not parse the JSON body of your request: {exc}.", code="invalid_json") from None


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def check_text_size(state: GatewayState, num_chars: int, param: str) -> None:
    """Refuse, before tokenizing it, a text longer than the context window's tokens can
    spell: tokenizing megabytes holds the event loop, and every stream, for seconds."""
    limit = state.context_length * state.tokenizer.max_token_chars
    if num_chars > limit:
        raise invalid(
            f"This model's maximum context length is {state.context_length} tokens. However, your {param} "
            f"has {num_chars} characters, more than {state.context_length} tokens can hold. "
            f"Please reduce the length of the {param}.", param, "context_length_exceeded")


def chat_prompt_ids(state: GatewayState, messages: Sequence[dict[str, str]], param: str) -> list[int]:
    """The prompt of chat `messages` (the client's `param`), in the model's chat template."""
    if not state.tokenizer.has_chat_template:
        raise invalid("This model has no chat template; use /v1/completions instead.", param)
    check_text_size(state, sum(len(m["content"]) for m in messages), param)
    try:
        return state.tokenizer.encode_chat(list(messages))
    except (jinja2.TemplateError, ValueError) as exc:
        raise invalid(f"The {param} could not be rendered with the model's chat template: {exc}", param) from exc


def _check_sampling_ids(state: GatewayState, sampling: SamplingFields) -> None:
    check_token_ids(sampling.stop_token_ids, state.vocab_size, "stop_token_ids")
    check_token_ids(tuple(t for t, _ in sampling.logit_bias), state.vocab_size, "logit_bias", keyed=True)


def check_model(state: GatewayState, model: str) -> None:
    if model != state.model_name:
        raise ApiError(404, f"The model `{model}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found")


def shutting_down() -> ApiError:
    return ApiError(503, "The server is shutting down; retry on another replica.", type="server_error",
                    code="shutting_down")


def check_admission(state: GatewayState) -> None:
    if state.is_draining:
        raise shutting_down()
    limit = state.config.max_queue
    if limit is not None and state.backend.stats().num_waiting >= limit:
        raise queue_full()


def queue_full() -> ApiError:
    return ApiError(429, "The server is busy: its request queue is full. Retry later.",
                    type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})


def server_error(exc: BaseException) -> ApiError:
    return ApiError(500, f"The request failed in the backend: {exc}", type="server_error", code="backend_error")


async def _generate(
    request: web.Request,
    state: GatewayState,
    kind: Kind,
    prompt_ids: list[int],
    sampling: SamplingParams,
    stream: bool,
    include_usage: bool,
    arrived: float,
    return_token_ids: bool = False,
    continuous_usage: bool = False,
    echo: Echo | None = None,
    n: int = 1,
    tool_use: ToolUse | None = None,
) -> web.StreamResponse:
    check_admission(state)
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    gen_request = GenerateRequest(rid, tuple(prompt_ids), sampling, time.time(),
                                  prompt_logprobs=echo is not None and sampling.logprobs is not None, n=n,
                                  tool_use=tool_use)
    head = r.ResponseHead(rid, int(time.time()), state.model_name)

    async def answer(gen: Generation) -> web.StreamResponse:
        if stream:
            return await _stream(request, state, gen, head, kind, include_usage, continuous_usage, return_token_ids)
        return await _collect(state, gen, head, kind, return_token_ids, echo)

    return await run_generation(state, gen_request, arrived, answer)


async def run_generation(state: GatewayState, gen_request: GenerateRequest, arrived: float,
                         answer: Callable[[Generation], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Run `gen_request` as a `Generation` in flight under its id (a shutdown ends it)
    and answer with `answer`; the backend's refusals and failures become the API's errors."""
    task = asyncio.current_task()
    assert task is not None
    try:
        async with Generation(gen_request, state.backend, state.tokenizer, state.journal, state.metrics,
                              arrived) as gen:
            state.in_flight[gen_request.request_id] = task
            try:
                return await answer(gen)
            finally:
                state.in_flight.pop(gen_request.request_id, None)
    except QueueFullError:
        raise queue_full() from None
    except RequestRefusedError as exc:
        raise invalid(f"The request cannot be served: {exc}.", code="request_refused") from None
    except BackendError as exc:
        raise server_error(exc) from exc


async def finish_generation(state: GatewayState, gen: Generation) -> None:
    """Read `gen` to its end (a non-streamed answer); a shutdown meanwhile is a 503."""
    try:
        async for _ in gen:
            pass
    except asyncio.CancelledError:
        if not state.is_draining:
            raise  # the client went away; Generation aborts the backend request
        task = asyncio.current_task()
        assert task is not None
        task.uncancel()
        raise shutting_down() from None


async def _collect(state: GatewayState, gen: Generation, head: r.ResponseHead, kind: Kind,
                   return_token_ids: bool = False, echo: Echo | None = None) -> web.Response:
    await finish_generation(state, gen)
    bodies = [_choice_body(state, gen, head, kind, c, return_token_ids, echo) for c in gen.choices]
    body = bodies[0]
    body["choices"] = [b["choices"][0] for b in bodies]
    return web.json_response(body, headers={"X-Request-Id": head.id})


def _choice_body(state: GatewayState, gen: Generation, head: r.ResponseHead, kind: Kind, choice: ChoiceOutput,
                 return_token_ids: bool, echo: Echo | None) -> dict[str, Any]:
    """The response as if `choice` were its only one (its index set); `_collect` joins them."""
    if echo is not None:
        body = _echoed(state, gen, head, echo, choice)
    else:
        build = r.chat_completion if kind == "chat" else r.text_completion
        body = build(head, choice.text, choice.finish_reason or "stop", usage_of(gen),
                     _logprobs_json(state, gen, kind)(choice.logprobs))
        if choice.tool_calls:
            r.add_tool_calls(body["choices"][0], choice.tool_calls)
    if return_token_ids:  # the generated ids only, echoed prompt or not (none when only the prompt is asked for)
        body["choices"][0]["token_ids"] = [] if echo is not None and echo.prompt_only else choice.token_ids
    body["choices"][0]["index"] = choice.index
    return body


async def _stream(request: web.Request, state: GatewayState, gen: Generation, head: r.ResponseHead, kind: Kind,
                  include_usage: bool, continuous_usage: bool = False,
                  return_token_ids: bool = False) -> web.StreamResponse:
    resp = await open_event_stream(request, head.id)
    logprobs = [_logprobs_json(state, gen, kind) for _ in gen.choices]  # each choice's text offsets

    async def chunks() -> None:
        if kind == "chat":
            for c in gen.choices:
                await resp.write(r.sse(_at(r.chat_chunk(head, {"role": "assistant", "content": ""}, None,
                                                        include_usage, usage_of(gen) if continuous_usage else None),
                                           c.index)))
        async for delta in gen:
            for i, call in enumerate(delta.tool_calls):  # before the chunk that finishes the choice
                await resp.write(r.sse(_at(r.chat_chunk(head, r.tool_call_delta(i, call), None, include_usage,
                                                        usage_of(gen) if continuous_usage else None), delta.index)))
            await resp.write(_delta_chunks(head, kind, delta.text, delta.finish_reason, include_usage,
                                           usage_of(gen) if continuous_usage else None,
                                           logprobs[delta.index](delta.logprobs),
                                           delta.token_ids if return_token_ids else None, delta.index))
        if include_usage:
            build = r.chat_usage_chunk if kind == "chat" else r.text_usage_chunk
            await resp.write(r.sse(build(head, usage_of(gen))))

    async def error(exc: ApiError) -> None:
        await resp.write(r.sse(exc.body()))

    await write_event_stream(resp, state, head.id, chunks, error, last=r.DONE)
    return resp


async def write_event_stream(resp: web.StreamResponse, state: GatewayState, request_id: str,
                             events: Callable[[], Awaitable[None]], error: Callable[[ApiError], Awaitable[None]],
                             last: bytes = b"") -> None:
    """Write a generation's `events` to `resp`, then `last`, and end it. A backend failure,
    or a shutdown, meanwhile is written as `error(...)` before the end; a client that went
    away between two writes (servers run without handler cancellation notice it here) ends
    it quietly, and leaving aborts the backend request."""
    try:
        try:
            await events()
        except BackendError as exc:
            await error(server_error(exc))
        except asyncio.CancelledError:
            if not state.is_draining:
                raise  # the client went away; Generation aborts the backend request
            current = asyncio.current_task()
            assert current is not None
            current.uncancel()
            await error(shutting_down())
        if last:
            await resp.write(last)
        await resp.write_eof()
    except ConnectionResetError:
        log.debug("client of %s disconnected mid-stream", request_id)


async def open_event_stream(request: web.Request, request_id: str) -> web.StreamResponse:
    """A server-sent event stream answering `request`, its headers sent."""
    resp = web.StreamResponse(headers={
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",  # no proxy buffering: each event as it is written
        "X-Request-Id": request_id,
    })
    await resp.prepare(request)
    return resp


def usage_of(gen: Generation) -> r.Usage:
    return r.Usage(gen.num_prompt_tokens, gen.num_completion_tokens, gen.num_cached_tokens)


@dataclass(frozen=True)
class Echo:
    """A completions request's `echo`: its prompt's text, and whether to return it alone
    (max_tokens 0: the one token the backend generated is dropped, and not counted)."""

    text: str
    prompt_only: bool


def _echoed(state: GatewayState, gen: Generation, head: r.ResponseHead, echo: Echo,
            choice: ChoiceOutput) -> dict[str, Any]:
    """A completion (of one choice) whose text (and logprobs) start with the prompt's."""
    logprobs = None
    if gen.request.sampling.logprobs is not None:
        pieces = CompletionLogprobs(lambda t: state.tokenizer.decode([t], skip_special_tokens=False))
        logprobs = pieces.take_prompt(gen.request.prompt_token_ids, gen.prompt_logprobs)
        if not echo.prompt_only:
            generated = pieces.take(choice.logprobs)
            logprobs = {key: value + generated[key] for key, value in logprobs.items()}
    if echo.prompt_only:
        return r.text_completion(head, echo.text, "length", r.Usage(gen.num_prompt_tokens, 0, gen.num_cached_tokens),
                                 logprobs)
    return r.text_completion(head, echo.text + choice.text, choice.finish_reason or "stop", usage_of(gen), logprobs)


def _logprobs_json(state: GatewayState, gen: Generation, kind: Kind) -> Callable[[list], dict[str, Any] | None]:
    """Token logprobs -> the response's JSON for them (None when the request did not ask)."""
    if gen.request.sampling.logprobs is None:
        return lambda entries: None

    def token_text(token_id: int) -> str:
        return state.tokenizer.decode([token_id], skip_special_tokens=False)

    if kind == "chat":
        return lambda entries: chat_logprobs(entries, token_text)
    return CompletionLogprobs(token_text).take


def _delta_chunks(head: r.ResponseHead, kind: Kind, text: str, finish_reason: str | None,
                  include_usage: bool, usage: r.Usage | None = None, logprobs: dict[str, Any] | None = None,
                  token_ids: list[int] | None = None, index: int = 0) -> bytes:
    """`usage`: the counts so far, sent in each chunk (continuous_usage_stats), else null.
    `logprobs`, `token_ids` (None: not asked for): those of the tokens since the last chunk,
    in the first chunk written. `index`: the choice they belong to."""
    if kind == "completion":
        return r.sse(_at(_with_ids(r.text_chunk(head, text, finish_reason, include_usage, usage, logprobs),
                                   token_ids), index))
    out = b""
    if text:
        out += r.sse(_at(_with_ids(r.chat_chunk(head, {"content": text}, None, include_usage, usage, logprobs),
                                   token_ids), index))
        logprobs = None
        token_ids = None if token_ids is None else []
    if finish_reason is not None:
        out += r.sse(_at(_with_ids(r.chat_chunk(head, {}, finish_reason, include_usage, usage, logprobs),
                                   token_ids), index))
    return out


def _at(chunk: dict[str, Any], index: int) -> dict[str, Any]:
    """The chunk as choice `index`'s (the builders write a chunk of choice 0)."""
    chunk["choices"][0]["index"] = index
    return chunk


def _with_ids(chunk: dict[str, Any], token_ids: list[int] | None) -> dict[str, Any]:
    if token_ids is not None:
        chunk["choices"][0]["token_ids"] = token_ids
    return chunk
