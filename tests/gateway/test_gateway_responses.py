"""`POST /v1/responses` (OpenAI's Responses API) over real HTTP on loopback, driven by the
official client's `responses.create`, `responses.parse` and `responses.stream` against a
scripted backend: the prompt and grammar equal the chat endpoint's for the same messages,
the objects and the event sequence parse, and what is not served is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pydantic
import pytest
from gateway_helpers import MODEL, SCRIPT_TEXT, ScriptedBackend, serve

from lamina.gateway.tool_calls import calls_text

QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
PARIS_ARGS = {"city": "Paris", "unit": "celsius"}

TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
TEXT_DONE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


class City(pydantic.BaseModel):
    name: str
    country: str


class GetWeather(pydantic.BaseModel):
    """The weather in a city."""

    city: str
    unit: Literal["celsius", "fahrenheit"]


def _scripted(tokenizer, text: str, **kwargs) -> ScriptedBackend:
    return ScriptedBackend(tokenizer.hf_tokenizer(text, add_special_tokens=False)["input_ids"],
                           tokenizer.eos_token_ids[0], **kwargs)


class CachingBackend(ScriptedBackend):
    """Reports, on each request's first event, that the prefix cache served 4 prompt tokens."""

    async def _events(self, request):
        first = True
        async for event in super()._events(request):
            if first:
                event.cached_tokens, first = 4, False
            yield event


async def test_create_with_string_input(tokenizer, make_backend, script_ids):
    backend = make_backend(chunk=3)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        resp = await client.responses.create(model=MODEL, input=QUESTION, temperature=0.5, top_p=0.9,
                                             max_output_tokens=100, extra_body={"seed": 7})
        await client.close()
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert resp.status == "completed" and resp.incomplete_details is None and resp.error is None
    assert resp.output_text == SCRIPT_TEXT
    [item] = resp.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "completed") and item.id.startswith("msg_")
    [part] = item.content
    assert (part.type, part.text, part.annotations) == ("output_text", SCRIPT_TEXT, [])
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    u = resp.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (
        len(prompt_ids), len(script_ids) + 1, len(prompt_ids) + len(script_ids) + 1)  # + EOS
    assert (u.input_tokens_details.cached_tokens, u.output_tokens_details.reasoning_tokens) == (0, 0)
    assert (resp.temperature, resp.top_p, resp.max_output_tokens) == (0.5, 0.9, 100)
    assert (resp.tool_choice, resp.tools, resp.parallel_tool_calls, resp.text.format.type) == ("auto", [], True, "text")
    assert resp.model_extra["store"] is False
    [req] = backend.requests
    assert req.request_id == resp.id and list(req.prompt_token_ids) == prompt_ids
    s = req.sampling
    assert (s.temperature, s.top_p, s.seed, s.max_tokens, s.grammar) == (0.5, 0.9, 7, 100, None)


async def test_messages_and_instructions_make_the_chat_endpoints_prompt(tokenizer, make_backend):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        resp = await client.responses.create(model=MODEL, instructions="Be brief.", input=[
            {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]},
            {"type": "message", "role": "developer", "content": "Answer in English."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Capital "},
                                                            {"type": "input_text", "text": "of France?"}]}])
        chat = await client.chat.completions.create(model=MODEL, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": "Hi!"}, {"role": "developer", "content": "Answer in English."},
            {"role": "user", "content": "Capital of France?"}])
        await client.close()
    assert resp.output_text == chat.choices[0].message.content == SCRIPT_TEXT
    assert resp.instructions == "Be brief."
    responses_req, chat_req = backend.requests
    assert responses_req.prompt_token_ids == chat_req.prompt_token_ids
    assert responses_req.sampling == chat_req.sampling  # the same defaults: max tokens, temperature, ...


async def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(tokenizer, script_ids):
    backend = CachingBackend(script_ids, tokenizer.eos_token_ids[0], chunk=4)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        resp = await client.responses.create(model=MODEL, input=QUESTION)
        async with client.responses.stream(model=MODEL, input=QUESTION) as stream:
            streamed = await stream.get_final_response()
        await client.close()
    assert resp.usage.input_tokens_details.cached_tokens == 4
    assert streamed.usage.input_tokens_details.cached_tokens == 4


async def test_function_call_round_trip(tokenizer):
    backend = _scripted(tokenizer, calls_text([("get_weather", PARIS_ARGS)]), chunk=3)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        resp = await client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required")
        [call] = resp.output
        assert call.type == "function_call" and call.status == "completed" and call.id.startswith("fc_")
        assert call.call_id.startswith("call_") and call.name == "get_weather"
        assert json.loads(call.arguments) == PARIS_ARGS
        assert resp.status == "completed" and resp.output_text == "" and resp.tool_choice == "required"
        assert resp.tools[0].name == "get_weather" and resp.tools[0].parameters == WEATHER["parameters"]
        # The call and its output go back as input items, as the client hands them over.
        history = [{"role": "user", "content": QUESTION}, *resp.output,
                   {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
        await client.responses.create(model=MODEL, input=history, tools=[WEATHER])
        await client.chat.completions.create(model=MODEL, tools=[CHAT_WEATHER], messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}])
        await client.close()
    first, round_trip, chat = backend.requests
    assert first.sampling.grammar is not None and first.tool_use.choice == "required"
    assert round_trip.prompt_token_ids == chat.prompt_token_ids
    assert round_trip.sampling.grammar == chat.sampling.grammar and round_trip.tool_use == chat.tool_use


async def test_parse_with_a_pydantic_tool_and_a_pydantic_text_format(tokenizer):
    backend = _scripted(tokenizer, calls_text([("GetWeather", PARIS_ARGS)]))
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        resp = await client.responses.parse(model=MODEL, input=QUESTION,
                                            tools=[openai.pydantic_function_tool(GetWeather)])
        await client.close()
    [call] = resp.output
    assert call.parsed_arguments == GetWeather(**PARIS_ARGS)
    city = '{"name": "Paris", "country": "France"}'
    backend = _scripted(tokenizer, city)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        resp = await client.responses.parse(model=MODEL, input=QUESTION, text_format=City)
        chat = await client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                   response_format=City)
        await client.responses.create(model=MODEL, input=QUESTION, text={"format": {"type": "json_object"}})
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                             response_format={"type": "json_object"})
        await client.close()
    assert resp.output_parsed == City(name="Paris", country="France") == chat.choices[0].message.parsed
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "City"
    schema_req, chat_schema_req, object_req, chat_object_req = backend.requests
    assert schema_req.sampling.grammar is not None and schema_req.sampling.grammar == chat_schema_req.sampling.grammar
    assert object_req.sampling.grammar is not None and object_req.sampling.grammar == chat_object_req.sampling.grammar


async def test_stream_with_the_clients_accumulator(tokenizer, make_backend, script_ids):
    backend = make_backend(chunk=3)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        async with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=100) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
        await client.close()
    kinds = [e.type for e in events]
    num_deltas = kinds.count("response.output_text.delta")
    assert kinds == TEXT_EVENTS + ["response.output_text.delta"] * num_deltas + TEXT_DONE + ["response.completed"]
    assert num_deltas > 1 and [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == SCRIPT_TEXT and deltas[-1].snapshot == SCRIPT_TEXT
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.id == events[0].response.id and final.status == "completed" and final.output_text == SCRIPT_TEXT
    assert final.usage.output_tokens == len(script_ids) + 1
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


async def test_create_stream_sends_the_documented_events(tokenizer, make_backend):
    async with serve(make_backend(chunk=5), tokenizer) as srv:
        client = srv.client()
        events = [e async for e in await client.responses.create(model=MODEL, input=QUESTION, stream=True)]
        whole = await client.responses.create(model=MODEL, input=QUESTION)
        await client.close()
    kinds = [e.type for e in events]
    num_deltas = kinds.count("response.output_text.delta")
    assert kinds == TEXT_EVENTS + ["response.output_text.delta"] * num_deltas + TEXT_DONE + ["response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, part_added, *deltas = events[2:-4]
    text_done, part_done, item_done, completed = events[-4:]
    assert added.output_index == 0 and added.item.status == "in_progress" and added.item.content == []
    assert part_added.part.text == "" and part_added.content_index == 0
    assert all((d.output_index, d.content_index, d.logprobs, d.item_id) == (0, 0, [], added.item.id) for d in deltas)
    assert text_done.text == part_done.part.text == SCRIPT_TEXT == item_done.item.content[0].text
    assert item_done.item.status == "completed"
    final = completed.response
    assert final.status == "completed" and final.output[0].id == added.item.id
    assert final.output_text == whole.output_text and final.usage == whole.usage


async def test_streamed_function_call(tokenizer):
    backend = _scripted(tokenizer, calls_text([("get_weather", PARIS_ARGS)]), chunk=3)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        async with client.responses.stream(model=MODEL, input=QUESTION, tools=[WEATHER]) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
        await client.close()
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, delta, done, item_done = events[2:6]
    assert added.item.type == "function_call" and added.item.arguments == "" and added.item.name == "get_weather"
    assert delta.item_id == done.item_id == added.item.id == item_done.item.id
    assert json.loads(delta.delta) == json.loads(done.arguments) == PARIS_ARGS
    [call] = final.output
    assert call.type == "function_call" and call.call_id == added.item.call_id
    assert json.loads(call.arguments) == PARIS_ARGS


async def test_a_length_cut_response_is_incomplete(tokenizer, make_backend):
    async with serve(make_backend(chunk=2), tokenizer) as srv:
        client = srv.client()
        resp = await client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5)
        events = [e async for e in await client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5,
                                                                 stream=True)]
        async with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=5) as stream:
            accumulated = [e async for e in stream]
            with pytest.raises(RuntimeError):  # the client's: only a completed response is final
                await stream.get_final_response()
        await client.close()
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 5 and resp.output[0].status == "incomplete"
    assert SCRIPT_TEXT.startswith(resp.output_text) and resp.output_text
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == resp.output_text and events[-2].item.status == "incomplete"
    assert [e.type for e in accumulated] == [e.type for e in events]
    assert accumulated[-1].response.output_text == resp.output_text


async def test_a_backend_failure_mid_stream_fails_the_response(tokenizer, make_backend):
    async with serve(make_backend(fail_after=3), tokenizer) as srv:
        client = srv.client()
        events = [e async for e in await client.responses.create(model=MODEL, input=QUESTION, stream=True)]
        with pytest.raises(openai.InternalServerError):
            await client.responses.create(model=MODEL, input=QUESTION)
        await client.close()
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.code == "server_error" and "scripted failure" in failed.response.error.message
    assert failed.response.output[0].status == "incomplete" and failed.response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_what_is_not_served_may_be_sent_at_its_off_value(tokenizer, make_backend):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        resp = await client.responses.create(
            model=MODEL, input=QUESTION, store=False, background=False, include=[], reasoning=None,
            truncation="disabled", top_logprobs=0, previous_response_id=None, metadata={"team": "a"}, user="u1",
            safety_identifier="s1", service_tier="auto", prompt_cache_key="k", text={"verbosity": "medium"},
            stream_options=None, parallel_tool_calls=False)
        await client.close()
    assert resp.status == "completed" and resp.metadata == {"team": "a"} and resp.parallel_tool_calls is False


@pytest.mark.parametrize(("fields", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"prompt": {"id": "pmpt_123"}}, "prompt"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"store": 0}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[1].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"top_k": 5}, "top_k"),
])
async def test_what_is_not_served_is_a_400_naming_the_field(tokenizer, make_backend, fields, param):
    backend = make_backend()
    body = {"input": QUESTION, **fields}
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model=MODEL, input=body.pop("input"), extra_body=body)
        await client.close()
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    assert param.split("[")[0].split(".")[0] in err.value.body["message"]
    assert backend.requests == []


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({}, "input", "missing_required_parameter"),
    ({"input": ""}, "input", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": 5}, "input", "invalid_type"),
    ({"input": [["hi"]]}, "input[0]", "invalid_type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "invalid_value"),
    ({"input": [{"role": "user"}]}, "input[0].content", "missing_required_parameter"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0].content", "invalid_type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]}, "input[0].content[0].text",
     "invalid_type"),
    ({"input": [{"role": "user", "content": "hi", "name": "bob"}]}, "input[0].name", "unknown_parameter"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]}, "input[0].call_id",
     "invalid_value"),
    ({"input": [{"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{no"}]},
     "input[0].arguments", "invalid_value"),
    ({"input": "hi", "instructions": 3}, "instructions", "invalid_type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": "hi", "max_output_tokens": 100_000}, "max_output_tokens", "context_length_exceeded"),
    ({"input": "hi", "temperature": 3}, "temperature", "invalid_value"),
    ({"input": "hi", "stream_options": {"include_obfuscation": False}}, "stream_options", None),
    ({"input": "hi", "messages": []}, "messages", "unknown_parameter"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}},
     "text.format", "invalid_value"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "bad name", "schema": {}}}},
     "text.format.name", "invalid_value"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type", "invalid_value"),
    ({"input": "hi", "tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name", "invalid_value"),
    ({"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "strin"}}]}, "tools[0].parameters",
     "invalid_value"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "invalid_value"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"input": "hi", "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_type"),
])
async def test_bad_requests_are_a_400_naming_the_field(tokenizer, make_backend, fields, param, code):
    backend = make_backend()
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model=MODEL, extra_body=fields)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="gpt-4o", input="hi")
        await client.close()
    assert (err.value.body["param"], err.value.body["code"]) == (param, code), err.value.body
    assert backend.requests == []
