"""OpenAI's Responses API request (`POST /v1/responses`) JSON -> typed, with validation.

A Responses request is served as the chat request it amounts to, on the chat endpoint's
path: `instructions` become a first system message, `input` (a string: one user message;
or a list of items) the chat messages, an earlier `function_call` item an assistant
message's tool call and a `function_call_output` item a tool message (both rendered as
gateway/tool_calls.py writes them), `text.format` the chat's `response_format` and the
flat `tools` / `tool_choice` the chat's. The grammar, the tools' system prompt and the
sampling fields come from the same code as the chat's (gateway/structured.py,
protocol.py), so the same messages give the same prompt tokens and, greedy, the same text.

Nothing is stored: `store` may be omitted, null or false (the official client omits it);
what needs stored responses (`store: true`, `previous_response_id`, `conversation`,
`background`), built-in tools, `include`, prompt templates and reasoning settings are
refused with a 400 that names the field. Pure functions: no I/O, no tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from lamina.gateway.protocol import (
    SamplingFields,
    bad_value,
    check_text,
    get_bool,
    invalid,
    parse_model,
    parse_sampling,
    require_object,
    type_name,
    wrong_type,
)
from lamina.gateway.structured import FieldError, ToolUse, parse_structured
from lamina.gateway.tool_calls import history_content, with_tools

INPUT_ROLES = frozenset({"user", "assistant", "system", "developer"})

# Fields of OpenAI's Responses API this server does not serve: accepted at the value that
# asks for nothing (null always), refused naming the field otherwise, with the reason.
_NOT_SERVED = "this server stores no responses"
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "store": ((False,), f"{_NOT_SERVED}; omit it or send false."),
    "previous_response_id": ((), f"{_NOT_SERVED} to continue from; send the whole conversation as 'input'."),
    "conversation": ((), f"{_NOT_SERVED} or conversations; send the whole conversation as 'input'."),
    "background": ((False,), "background mode needs stored responses, and this server stores none; "
                             "stream the response instead."),
    "include": (([],), "no extra output (reasoning, logprobs, tool results) can be included."),
    "prompt": ((), "stored prompt templates are not supported; send 'instructions' and 'input'."),
    "reasoning": ((), "the model has no reasoning settings; omit it."),
    "truncation": (("disabled",), "only 'disabled' is supported: an input too long for the context is refused."),
    "top_logprobs": ((0,), "log-probabilities are served by /v1/chat/completions, not here."),
    "max_tool_calls": ((), "it limits built-in tool calls, which this server does not run."),
}
# Accepted and not used: they do not change the output.
_IGNORED = frozenset({"metadata", "user", "safety_identifier", "service_tier", "prompt_cache_key"})
_FIELDS = frozenset({"model", "input", "instructions", "stream", "stream_options", "max_output_tokens", "temperature",
                     "top_p", "seed", "text", "tools", "tool_choice", "parallel_tool_calls"}) \
    | frozenset(_UNSUPPORTED) | _IGNORED

_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
_PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})
_TEXT_PARTS = frozenset({"input_text", "output_text"})
_CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
_CALL_OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status"})
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})


@dataclass(frozen=True)
class ResponsesRequest:
    model: str
    # As parse_chat_request gives a chat request's: {"role", "content"}, history rendered,
    # the tools' system prompt first when there are tools.
    messages: tuple[dict[str, str], ...]
    sampling: SamplingFields
    tool_use: ToolUse | None
    stream: bool
    # The request's settings as the response object repeats them (instructions, tools,
    # tool_choice, text, temperature, ...).
    settings: dict[str, Any]


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Validate a decoded `/v1/responses` JSON body."""
    body = require_object(body)
    _check_fields(body)
    model = parse_model(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise wrong_type("instructions", "a string", instructions)
    messages = _parse_input(body)
    if instructions:
        messages = ({"role": "system", "content": check_text(instructions, "instructions")}, *messages)
    stream = _parse_stream(body)
    sampling = parse_sampling(body, ("max_output_tokens",))
    response_format, text_setting = _parse_text(body.get("text"))
    tools, tools_setting = _parse_tools(body.get("tools"))
    tool_choice = _parse_tool_choice(body.get("tool_choice"))
    chat_fields = {"response_format": response_format, "tools": tools, "parallel_tool_calls": body.get(
        "parallel_tool_calls"), "tool_choice": None if tool_choice is None else _chat_tool_choice(tool_choice)}
    try:
        structured = parse_structured(chat_fields)
    except FieldError as exc:
        param = _responses_param(exc.param)
        raise invalid(exc.message.replace(exc.param, param), param, exc.code) from None
    if structured.tool_use is not None:
        messages = with_tools(messages, structured.tool_use.system_prompt)
    sampling = dataclasses.replace(sampling, grammar=structured.grammar)
    settings = {
        "instructions": instructions,
        "max_output_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "text": text_setting,
        "tools": tools_setting,
        "tool_choice": "auto" if tool_choice is None else tool_choice,
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "metadata": body.get("metadata") or {},
        "user": body.get("user"),
    }
    return ResponsesRequest(model, messages, sampling, structured.tool_use, stream, settings)


# --- fields -------------------------------------------------------------------------


def _is_off(value: Any, offs: tuple[Any, ...]) -> bool:
    # type() too: 0 == False, and neither stands for the other here
    return value is None or any(type(value) is type(off) and value == off for off in offs)


def _check_fields(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name not in _FIELDS:
            raise invalid(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
        if name in _UNSUPPORTED:
            offs, reason = _UNSUPPORTED[name]
            if not _is_off(value, offs):
                raise invalid(f"'{name}' is not supported by this server: {reason}", name, "unsupported_parameter")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise wrong_type("metadata", "an object", metadata)
    for name in ("user", "safety_identifier", "service_tier", "prompt_cache_key"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise wrong_type(name, "a string", body[name])


def _parse_stream(body: dict[str, Any]) -> bool:
    stream = get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream
    if not isinstance(options, dict):
        raise wrong_type("stream_options", "an object", options)
    if not stream:
        raise invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
    _only_keys(options, frozenset({"include_obfuscation"}), "stream_options")
    get_bool(options, "include_obfuscation", False, "stream_options.")  # accepted: no event is padded
    return stream


def _only_keys(value: dict[str, Any], allowed: frozenset[str], param: str) -> None:
    for key in value:
        if key not in allowed:
            raise invalid(f"Unrecognized request argument supplied: {param}.{key}", f"{param}.{key}",
                          "unknown_parameter")


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise wrong_type(param, "an object", value)
    return value


def _string(item: dict[str, Any], key: str, param: str) -> str:
    if key not in item or item[key] is None:
        raise invalid(f"Missing required parameter: '{param}.{key}'.", f"{param}.{key}", "missing_required_parameter")
    value = item[key]
    if not isinstance(value, str):
        raise wrong_type(f"{param}.{key}", "a string", value)
    return check_text(value, f"{param}.{key}")


# --- input --------------------------------------------------------------------------


@dataclass
class _Turn:
    role: str
    content: str
    calls: list[tuple[str, Any]] = dataclasses.field(default_factory=list)


def _parse_input(body: dict[str, Any]) -> tuple[dict[str, str], ...]:
    if "input" not in body or body["input"] is None:
        raise invalid("Missing required parameter: 'input'.", "input", "missing_required_parameter")
    value = body["input"]
    if isinstance(value, str):
        if not value:
            raise bad_value("input", "the input must not be empty.")
        return ({"role": "user", "content": check_text(value, "input")},)
    if not isinstance(value, list):
        raise wrong_type("input", "a string or an array of input items", value)
    if not value:
        raise bad_value("input", "expected at least one input item.")
    turns: list[_Turn] = []
    call_ids: set[str] = set()
    for i, item in enumerate(value):
        param = f"input[{i}]"
        item = _object(item, param)
        kind = item.get("type", "message")
        if kind == "message":
            _only_keys(item, _MESSAGE_KEYS, param)
            role = _string(item, "role", param)
            if role not in INPUT_ROLES:
                raise bad_value(f"{param}.role", f"must be one of {', '.join(sorted(INPUT_ROLES))}; got {role!r}.")
            turns.append(_Turn(role, _content(item.get("content"), f"{param}.content")))
        elif kind == "function_call":
            _only_keys(item, _CALL_KEYS, param)
            call_id, name = _string(item, "call_id", param), _string(item, "name", param)
            try:
                arguments = json.loads(_string(item, "arguments", param))
            except ValueError:
                raise bad_value(f"{param}.arguments", "it is not valid JSON.") from None
            call_ids.add(call_id)
            # The calls of one turn (and its text before them) are one assistant message, as in chat.
            if not (turns and turns[-1].role == "assistant"):
                turns.append(_Turn("assistant", ""))
            turns[-1].calls.append((name, arguments))
        elif kind == "function_call_output":
            _only_keys(item, _CALL_OUTPUT_KEYS, param)
            call_id = _string(item, "call_id", param)
            if call_id not in call_ids:
                raise bad_value(f"{param}.call_id", f"no function_call item before it has call_id {call_id!r}.")
            if "output" not in item or item["output"] is None:
                raise invalid(f"Missing required parameter: '{param}.output'.", f"{param}.output",
                              "missing_required_parameter")
            turns.append(_Turn("tool", _content(item["output"], f"{param}.output")))
        elif isinstance(kind, str):
            raise invalid(f"Invalid value for '{param}.type': only 'message', 'function_call' and "
                          f"'function_call_output' items are supported, got {kind!r} (this server stores no "
                          f"items to refer to, and runs no built-in tools).", f"{param}.type", "unsupported_value")
        else:
            raise wrong_type(f"{param}.type", "a string", kind)
    return tuple(history_content(t.role, t.content, t.calls) for t in turns)


def _content(value: Any, param: str) -> str:
    """A message's content (or a function call's output): a string, or text parts."""
    if value is None:
        raise invalid(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    if isinstance(value, str):
        return check_text(value, param)
    if not isinstance(value, list):
        raise wrong_type(param, "a string or an array of content parts", value)
    texts = []
    for j, part in enumerate(value):
        part = _object(part, f"{param}[{j}]")
        kind = part.get("type")
        if kind not in _TEXT_PARTS:
            raise invalid(f"Invalid value for '{param}[{j}].type': only text parts ('input_text', 'output_text') "
                          f"are supported, got {kind!r}.", f"{param}[{j}].type", "unsupported_value")
        _only_keys(part, _PART_KEYS, f"{param}[{j}]")
        texts.append(_string(part, "text", f"{param}[{j}]"))
    return "".join(texts)


# --- text.format, tools, tool_choice -> the chat's fields ------------------------------


def _parse_text(value: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`text` -> (the chat's `response_format`, the setting the response repeats)."""
    if value is None:
        return None, {"format": {"type": "text"}}
    value = _object(value, "text")
    _only_keys(value, frozenset({"format", "verbosity"}), "text")
    verbosity = value.get("verbosity")
    if verbosity not in (None, "medium"):
        raise invalid(f"'text.verbosity' is not supported by this server: the model has no verbosity setting; "
                      f"omit it or send 'medium', got {verbosity!r}.", "text.verbosity", "unsupported_parameter")
    fmt = value.get("format")
    if fmt is None:
        return None, {"format": {"type": "text"}}
    fmt = _object(fmt, "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        _only_keys(fmt, frozenset({"type"}), "text.format")
        return {"type": kind}, {"format": {"type": kind}}
    if kind != "json_schema":
        raise bad_value("text.format.type", f"expected one of 'text', 'json_object', 'json_schema', got {kind!r}.")
    _only_keys(fmt, frozenset({"type", "name", "schema", "description", "strict"}), "text.format")
    spec = {k: v for k, v in fmt.items() if k != "type"}
    return {"type": "json_schema", "json_schema": spec}, {"format": dict(fmt)}


def _parse_tools(value: Any) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """`tools` (the Responses API's flat function tools) -> (the chat's, the setting the
    response repeats)."""
    if value is None:
        return None, []
    if not isinstance(value, list):
        raise wrong_type("tools", "an array of tools", value)
    chat, setting = [], []
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        tool = _object(tool, param)
        kind = tool.get("type")
        if kind != "function":
            raise invalid(f"Invalid value for '{param}.type': built-in tools are not supported by this server, only "
                          f"'function' tools (your code runs them), got {kind!r}.", f"{param}.type",
                          "unsupported_value")
        _only_keys(tool, _TOOL_KEYS, param)
        function = {k: v for k, v in tool.items() if k != "type"}
        chat.append({"type": "function", "function": function})
        setting.append({"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                        "parameters": tool.get("parameters"),
                        "strict": True if tool.get("strict") is None else tool["strict"]})
    return chat, setting


def _parse_tool_choice(value: Any) -> str | dict[str, Any] | None:
    """`tool_choice` as sent, checked for its shape: "none", "auto", "required" or
    {"type": "function", "name": ...} (whether the function is in `tools` is the chat's check)."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict):
        kind = value.get("type")
        if kind != "function":
            raise invalid(f"Invalid value for 'tool_choice.type': only a named 'function' can be chosen, got "
                          f"{kind!r} (this server runs no built-in tools).", "tool_choice.type", "unsupported_value")
        _only_keys(value, frozenset({"type", "name"}), "tool_choice")
        if not isinstance(value.get("name"), str):
            raise wrong_type("tool_choice.name", "a string", value.get("name"))
        return {"type": "function", "name": value["name"]}
    got = repr(value) if isinstance(value, str) else type_name(value)
    raise bad_value("tool_choice", f"expected 'none', 'auto', 'required' or {{\"type\": \"function\", \"name\": "
                                    f"...}}, got {got}.")


def _chat_tool_choice(value: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(value, str):
        return value
    return {"type": "function", "function": {"name": value["name"]}}


_CHAT_TOOL = re.compile(r"^tools\[(\d+)\]\.function")


def _responses_param(param: str) -> str:
    """A chat field's name (gateway/structured.py's) as this request spells it."""
    param = param.replace("response_format.json_schema.", "text.format.").replace("response_format", "text.format")
    return _CHAT_TOOL.sub(r"tools[\1]", param)

