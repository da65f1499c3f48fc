"""Structured output: a chat request's `response_format`, `tools`, `tool_choice` and
`parallel_tool_calls`, validated, and the llguidance grammar the sampler follows for them.

- `response_format` `{"type": "json_object"}`: the content is one JSON object;
  `{"type": "json_schema", "json_schema": {"name", "schema", ...}}`: one JSON value
  valid against the schema; `{"type": "text"}` (the default): free text.
- `tools` with `tool_choice` `"required"`: the output is a list of calls of the tools
  (gateway/tool_calls.py's form), each one's arguments valid against its function's
  `parameters`; a named function `{"type": "function", "function": {"name": ...}}`: one
  call of that function; `"auto"` (the default with tools): either content (free text,
  or `response_format`'s JSON) or calls; `"none"` (the default without tools): content
  alone, and the tools are not shown to the model. `parallel_tool_calls: false` allows
  one call instead of a list of one or more.

The grammar is llguidance's serialized form (a JSON schema's, or a Lark grammar with
`%json` rules for the tools' calls); it travels in `SamplingParams.grammar` and every
sampler applies it (lamina/sampling/grammar.py), so the output follows it by construction,
never by retrying. Pure functions; schemas llguidance cannot compile raise `FieldError`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from llguidance import LLMatcher

from lamina.gateway.tool_calls import CALL_SEPARATOR, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, tools_system_prompt

if TYPE_CHECKING:  # declared in llguidance's stubs only
    from llguidance._lib import JsonCompileOptions

# OpenAI's bounds: at most 128 tools, names of letters, digits, '_' and '-', up to 64 long.
MAX_TOOLS = 128
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_JSON_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# JSON as Python's json.dumps writes it: no whitespace but the one space after "," and ":".
# Free whitespace would let a small model fill its tokens with it.
JSON_FORMAT: JsonCompileOptions = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# A function without `parameters` takes none (OpenAI's rule).
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class FieldError(Exception):
    """A field of the request that cannot be served, with OpenAI's error fields."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # the arguments' JSON schema

    def definition(self) -> dict[str, Any]:
        """The function as the model is shown it."""
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out["parameters"] = self.parameters
        return out


@dataclass(frozen=True)
class ToolUse:
    """What a request lets the model do with its tools (never "none": that is no ToolUse)."""

    tools: tuple[Tool, ...]
    choice: Literal["auto", "required", "named"]
    function: str | None = None  # the named function
    parallel: bool = True

    @property
    def may_answer_in_text(self) -> bool:
        return self.choice == "auto"

    @property
    def system_prompt(self) -> str:
        return tools_system_prompt([t.definition() for t in self.tools], self.may_answer_in_text)


@dataclass(frozen=True)
class StructuredOutput:
    grammar: str | None = None  # llguidance's serialized grammar; None: unconstrained
    tool_use: ToolUse | None = None


def parse_structured(body: dict[str, Any]) -> StructuredOutput:
    """`response_format`, `tools`, `tool_choice`, `parallel_tool_calls` of a chat body."""
    content = _parse_response_format(body.get("response_format"))
    tools = _parse_tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError(f"Invalid type for 'parallel_tool_calls': expected a boolean, but got "
                         f"{type(parallel).__name__} instead.", "parallel_tool_calls", "invalid_type")
    tool_use = _parse_tool_choice(body.get("tool_choice"), tools, parallel is not False)
    grammar = None if content is None else _checked(_json_grammar(content), "response_format")
    if tool_use is None:
        return StructuredOutput(grammar, None)
    return StructuredOutput(_tools_grammar(tool_use, content), tool_use)


# --- response_format ----------------------------------------------------------------


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FieldError(f"Invalid type for '{param}': expected an object.", param, "invalid_type")
    return value


def _only_keys(value: dict[str, Any], allowed: set[str], param: str) -> None:
    for key in value:
        if key not in allowed:
            raise FieldError(f"Unrecognized request argument supplied: {param}.{key}", f"{param}.{key}",
                             "unknown_parameter")


def _parse_response_format(value: Any) -> dict[str, Any] | None:
    """The content's JSON schema, or None for free text."""
    if value is None:
        return None
    value = _object(value, "response_format")
    kind = value.get("type")
    if kind == "text":
        _only_keys(value, {"type"}, "response_format")
        return None
    if kind == "json_object":
        _only_keys(value, {"type"}, "response_format")
        return {"type": "object"}
    if kind != "json_schema":
        raise FieldError(f"Invalid value for 'response_format.type': expected one of 'text', 'json_object', "
                         f"'json_schema', got {kind!r}.", "response_format.type")
    _only_keys(value, {"type", "json_schema"}, "response_format")
    spec = _object(value.get("json_schema"), "response_format.json_schema")
    _only_keys(spec, {"name", "description", "schema", "strict"}, "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _JSON_SCHEMA_NAME.fullmatch(name):
        raise FieldError("Invalid value for 'response_format.json_schema.name': a name of letters, digits, "
                         "'_' and '-', at most 64 long, is required.", "response_format.json_schema.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise FieldError("Invalid type for 'response_format.json_schema.strict': expected a boolean.",
                         "response_format.json_schema.strict", "invalid_type")
    # Without a schema any JSON value is valid (the output is still JSON).
    return _object(spec.get("schema", {}), "response_format.json_schema.schema")


# --- tools and tool_choice ----------------------------------------------------------


def _parse_tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise FieldError("Invalid type for 'tools': expected an array of tools.", "tools", "invalid_type")
    if len(value) > MAX_TOOLS:
        raise FieldError(f"Invalid value for 'tools': at most {MAX_TOOLS} tools are supported, got {len(value)}.",
                         "tools")
    tools: list[Tool] = []
    for i, item in enumerate(value):
        param = f"tools[{i}]"
        item = _object(item, param)
        _only_keys(item, {"type", "function"}, param)
        if item.get("type") != "function":
            raise FieldError(f"Invalid value for '{param}.type': only 'function' tools are supported, got "
                             f"{item.get('type')!r}.", f"{param}.type")
        fn = _object(item.get("function"), f"{param}.function")
        _only_keys(fn, {"name", "description", "parameters", "strict"}, f"{param}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise FieldError(f"Invalid value for '{param}.function.name': a name of letters, digits, '_' and '-', "
                             f"at most 64 long, is required.", f"{param}.function.name")
        if any(t.name == name for t in tools):
            raise FieldError(f"Invalid value for '{param}.function.name': the function {name!r} is defined twice.",
                             f"{param}.function.name")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise FieldError(f"Invalid type for '{param}.function.description': expected a string.",
                             f"{param}.function.description", "invalid_type")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise FieldError(f"Invalid type for '{param}.function.strict': expected a boolean.",
                             f"{param}.function.strict", "invalid_type")
        parameters = fn.get("parameters")
        parameters = _NO_PARAMETERS if parameters is None else _object(parameters, f"{param}.function.parameters")
        tool = Tool(name, description, parameters)
        _checked(_json_grammar(_call_schema(tool)), f"{param}.function.parameters")
        tools.append(tool)
    return tuple(tools)


def _parse_tool_choice(value: Any, tools: tuple[Tool, ...], parallel: bool) -> ToolUse | None:
    if value is None:
        value = "auto"
    if value == "none" or (value == "auto" and not tools):
        return None
    if value in ("auto", "required"):
        if not tools:
            raise FieldError("Invalid value for 'tool_choice': 'required' needs 'tools'.", "tool_choice")
        return ToolUse(tools, value, None, parallel)
    if isinstance(value, dict):
        _only_keys(value, {"type", "function"}, "tool_choice")
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if value.get("type") != "function" or not isinstance(name, str):
            raise FieldError("Invalid value for 'tool_choice': a named choice is "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")
        if not any(t.name == name for t in tools):
            raise FieldError(f"Invalid value for 'tool_choice': no tool named {name!r} is in 'tools'.",
                             "tool_choice")
        return ToolUse(tools, "named", name, False)
    raise FieldError(f"Invalid value for 'tool_choice': expected 'none', 'auto', 'required' or a named function, "
                     f"got {value!r}.", "tool_choice")


# --- grammars -----------------------------------------------------------------------


def _json_grammar(schema: dict[str, Any]) -> str:
    return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_FORMAT)


def _lark_json(schema: dict[str, Any]) -> str:
    """A Lark rule's body: JSON valid against `schema`, written as JSON_FORMAT says."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_FORMAT})


def _checked(grammar: str, param: str) -> str:
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise FieldError(f"Invalid value for '{param}': the schema cannot be used for constrained decoding: "
                         f"{error.strip().splitlines()[0]}", param)
    return grammar


def _moved_refs(schema: Any, base: str) -> Any:
    """The schema with its local `$ref`s ("#...") pointing into it from `base` (the
    pointer of where it is placed inside a larger schema)."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _moved_refs(v, base))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_moved_refs(v, base) for v in schema]
    return schema


def _call_schema(tool: Tool) -> dict[str, Any]:
    """One call of `tool`: {"name": its name, "arguments": valid against its parameters}."""
    return {"type": "object",
            "properties": {"name": {"const": tool.name},
                           "arguments": _moved_refs(tool.parameters, "#/properties/arguments")},
            "required": ["name", "arguments"], "additionalProperties": False}


def _not_starting_with(prefix: str) -> str:
    """A regex (llguidance's syntax) of every text that does not start with `prefix`: its
    proper prefixes, and any text that leaves it at some character."""
    heads = [re.escape(prefix[:i]) for i in range(len(prefix))]
    forks = [f"{re.escape(prefix[:i])}[^{re.escape(prefix[i])}](?s:.*)" for i in range(len(prefix))]
    return "|".join(heads + forks)


def _tools_grammar(tool_use: ToolUse, content: dict[str, Any] | None) -> str:
    """A Lark grammar: the calls (one, or a list), or with tool_choice "auto" the
    content instead (free text that does not open a call, or response_format's JSON)."""
    tools = [t for t in tool_use.tools if tool_use.function in (None, t.name)]
    more = f' ({json.dumps(CALL_SEPARATOR)} call)*' if tool_use.parallel else ""
    lines = [f"calls: {json.dumps(TOOL_CALL_OPEN + chr(10))} call{more} {json.dumps(chr(10) + TOOL_CALL_CLOSE)}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    lines += [f"call_{i}: {_lark_json(_call_schema(t))}" for i, t in enumerate(tools)]
    if not tool_use.may_answer_in_text:
        start = "start: calls"
    elif content is None:
        start = "start: TEXT | calls"
        lines.append(f"TEXT: /{_not_starting_with(TOOL_CALL_OPEN)}/")
    else:
        start = "start: content | calls"
        lines.append(f"content: {_lark_json(content)}")
    return _checked(LLMatcher.grammar_from_lark("\n".join([start, *lines]) + "\n"), "tools")


def parse_history_calls(value: Any, param: str) -> list[tuple[str, Any]]:
    """An earlier assistant message's `tool_calls`, as (name, arguments object) pairs."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise FieldError(f"Invalid type for '{param}': expected an array of tool calls.", param, "invalid_type")
    calls = []
    for i, call in enumerate(value):
        call = _object(call, f"{param}[{i}]")
        fn = _object(call.get("function"), f"{param}[{i}].function")
        name, arguments = fn.get("name"), fn.get("arguments")
        if not isinstance(name, str):
            raise FieldError(f"Invalid type for '{param}[{i}].function.name': expected a string.",
                             f"{param}[{i}].function.name", "invalid_type")
        if not isinstance(arguments, str):
            raise FieldError(f"Invalid type for '{param}[{i}].function.arguments': expected a string (JSON).",
                             f"{param}[{i}].function.arguments", "invalid_type")
        try:
            calls.append((name, json.loads(arguments)))
        except ValueError:
            raise FieldError(f"Invalid value for '{param}[{i}].function.arguments': it is not valid JSON.",
                             f"{param}[{i}].function.arguments") from None
    return calls
