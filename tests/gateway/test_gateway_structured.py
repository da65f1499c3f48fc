"""Structured output and tools at the gateway: parsing, the grammars (checked with the real
tokenizer's llguidance matcher), the tool-call convention, and the responses' shape with the
official client against a scripted backend that replays a tool call."""

from __future__ import annotations

import json

import openai
import pytest
from gateway_helpers import MODEL, ScriptedBackend, serve

from lamina.gateway.protocol import ApiError, parse_chat_request
from lamina.gateway.structured import FieldError, parse_structured
from lamina.gateway.tool_calls import ToolCallSplitter, calls_text, parse_calls
from lamina.sampling.grammar import Grammars

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "$defs": {"Zone": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/Zone"}}, "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = calls_text([("get_weather", {"city": "Paris", "unit": "celsius"})])


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer)


def _accepts(grammars, tokenizer, grammar: str, text: str) -> bool:
    """Whether `grammar` lets the model write `text` and then end."""
    ids = tokenizer.hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    state = grammars.state(grammar, ids)
    return not state.is_error and state.is_accepting


def _body(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, **fields}


# --- grammars -----------------------------------------------------------------------


def test_json_schema_grammar_holds_the_output_to_the_schema(grammars, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    g = parse_structured(_body(response_format={"type": "json_schema",
                                                "json_schema": {"name": "count", "schema": schema}})).grammar
    assert _accepts(grammars, tokenizer, g, '{"n": 12}')
    for text in ('{"n": "12"}', '{"n": 12, "m": 1}', '{"n": 12', "12", '{"n":  12}'):
        assert not _accepts(grammars, tokenizer, g, text), text
    any_object = parse_structured(_body(response_format={"type": "json_object"})).grammar
    assert _accepts(grammars, tokenizer, any_object, '{"a": [1, {"b": null}], "c": "d"}')
    assert not _accepts(grammars, tokenizer, any_object, "[1, 2]")
    assert parse_structured(_body(response_format={"type": "text"})).grammar is None


def test_required_tools_grammar_allows_calls_of_the_tools_alone(grammars, tokenizer):
    s = parse_structured(_body(tools=[WEATHER, TIME], tool_choice="required"))
    assert s.tool_use.choice == "required" and not s.tool_use.may_answer_in_text
    two = calls_text([("get_weather", {"city": "Rome", "unit": "fahrenheit"}), ("get_time", {"zone": {"name": "UTC"}})])
    assert _accepts(grammars, tokenizer, s.grammar, PARIS)
    assert _accepts(grammars, tokenizer, s.grammar, two)  # the $ref into $defs resolves where it was moved
    for text in ("It is sunny.", calls_text([("get_weather", {"city": "Paris"})]),
                 calls_text([("get_news", {})]), calls_text([("get_time", {"zone": {"id": 1}})])):
        assert not _accepts(grammars, tokenizer, s.grammar, text), text
    single = parse_structured(_body(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    assert _accepts(grammars, tokenizer, single.grammar, PARIS)
    assert not _accepts(grammars, tokenizer, single.grammar, two)


def test_named_function_grammar_allows_one_call_of_it(grammars, tokenizer):
    s = parse_structured(_body(tools=[WEATHER, TIME],
                               tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert s.tool_use.function == "get_time"
    assert _accepts(grammars, tokenizer, s.grammar, calls_text([("get_time", {"zone": {"name": "CET"}})]))
    assert not _accepts(grammars, tokenizer, s.grammar, PARIS)


def test_auto_grammar_allows_text_that_does_not_open_a_call_or_calls(grammars, tokenizer):
    s = parse_structured(_body(tools=[WEATHER]))
    assert s.tool_use.choice == "auto"
    for text in ("It is sunny in Paris.", "", "<tool_c", "<tool_call> is a tag", PARIS):
        assert _accepts(grammars, tokenizer, s.grammar, text), text
    assert not _accepts(grammars, tokenizer, s.grammar, "<tool_call>[oops")
    with_json = parse_structured(_body(tools=[WEATHER], response_format={"type": "json_object"}))
    assert _accepts(grammars, tokenizer, with_json.grammar, '{"answer": "sunny"}')
    assert _accepts(grammars, tokenizer, with_json.grammar, PARIS)
    assert not _accepts(grammars, tokenizer, with_json.grammar, "sunny")


def test_tool_choice_none_and_no_tools_leave_the_output_free():
    assert parse_structured(_body(tools=[WEATHER], tool_choice="none")).grammar is None
    assert parse_structured(_body(tool_choice="auto")) == parse_structured(_body())


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object", "extra": 1}}, "response_format.extra"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/X"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "d": {"type": "string", "format": "no-such-format"}}}}}]}, "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_schemas_and_tools_are_refused_naming_the_field(fields, param):
    with pytest.raises(FieldError) as err:
        parse_structured(_body(**fields))
    assert err.value.param == param
    with pytest.raises(ApiError) as api:
        parse_chat_request(_body(**fields))
    assert api.value.status == 400 and api.value.param == param


def test_constraints_refuse_what_holds_eos_back():
    for extra in ({"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(ApiError) as err:
            parse_chat_request(_body(response_format={"type": "json_object"}, **extra))
        assert err.value.param == next(iter(extra))
    parse_chat_request(_body(ignore_eos=True, tools=[WEATHER], tool_choice="none"))


# --- the convention: prompt, history, parsing -----------------------------------------


def test_tools_are_offered_in_the_system_message_and_history_is_rendered():
    req = parse_chat_request(_body(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ], tools=[WEATHER]))
    system = req.messages[0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n")
    tools = json.loads(system["content"].split("<tools>")[1].split("</tools>")[0])
    assert tools == [WEATHER["function"]]
    assert req.messages[2] == {"role": "assistant", "content": PARIS}
    assert req.messages[3] == {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    assert req.sampling.grammar is not None and req.tool_use.may_answer_in_text
    bare = parse_chat_request(_body(tools=[WEATHER], tool_choice="required"))
    assert bare.messages[0]["role"] == "system" and "plain text" not in bare.messages[0]["content"]
    with pytest.raises(ApiError) as err:
        parse_chat_request(_body(messages=[{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]))
    assert err.value.param == "messages[0].tool_calls[0].function.arguments"


def test_calls_parse_back_and_a_cut_output_does_not():
    calls = parse_calls(PARIS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert calls[0].id.startswith("call_")
    assert parse_calls(PARIS[:-3]) is None
    assert parse_calls("<tool_call>[\n]</tool_call>") is None


def test_splitter_passes_text_through_once_it_cannot_open_a_call():
    auto = ToolCallSplitter(may_be_text=True)
    assert auto.feed("<to") == ""
    assert auto.feed("mato") == "<tomato"
    assert auto.feed(" soup") == " soup"
    assert auto.finish() == ("", []) and auto.content == "<tomato soup"
    held = ToolCallSplitter(may_be_text=True)
    assert [held.feed(piece) for piece in (PARIS[:5], PARIS[5:20], PARIS[20:])] == ["", "", ""]
    rest, calls = held.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"] and held.content == ""
    cut = ToolCallSplitter(may_be_text=False)
    assert cut.feed("It is") == ""
    assert cut.finish() == ("It is", []) and cut.content == "It is"


# --- responses, with the official client ----------------------------------------------


def _backend(tokenizer, text: str) -> ScriptedBackend:
    return ScriptedBackend(tokenizer.hf_tokenizer(text, add_special_tokens=False)["input_ids"],
                           tokenizer.eos_token_ids[0], chunk=3)


async def test_tool_calls_in_the_response_and_the_stream(tokenizer):
    backend = _backend(tokenizer, PARIS)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                                 tool_choice="required")
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
        assert backend.requests[0].sampling.grammar is not None

        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER], stream=True)]
        await client.close()
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == ""
    [streamed] = [t for d in deltas for t in (d.tool_calls or [])]
    assert streamed.index == 0 and streamed.id.startswith("call_") and streamed.function.name == "get_weather"
    assert json.loads(streamed.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_auto_text_is_content_and_a_cut_call_comes_back_as_text(tokenizer):
    text = "It is sunny in Paris."
    async with serve(_backend(tokenizer, text), tokenizer) as srv:
        client = srv.client()
        r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER])
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER], stream=True)]
        await client.close()
    assert r.choices[0].message.content == text and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    contents = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(contents) == text and len(contents) > 1  # streamed as it came, once it could not be a call
    async with serve(_backend(tokenizer, PARIS), tokenizer) as srv:
        client = srv.client()
        r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=6)
        await client.close()
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    assert PARIS.startswith(r.choices[0].message.content)


async def test_bad_tools_get_a_400_before_the_backend_sees_anything(tokenizer):
    backend = _backend(tokenizer, PARIS)
    async with serve(backend, tokenizer) as srv:
        client = srv.client()
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                                 tool_choice={"type": "function", "function": {"name": "nope"}})
        await client.close()
    assert err.value.body["param"] == "tool_choice" and backend.requests == []
