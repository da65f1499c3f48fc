"""How tool calls are written in the model's text, and read back out of it.

SmolLM2's chat template has no tool syntax; the tool-calling convention of SmolLM2's
prompts (as Ollama's smollm2 template writes it) is used instead:
- the tools are offered in a system message, as a JSON list of the functions'
  definitions inside `<tools></tools>` (`with_tools`);
- the model calls them by answering with a JSON list of `{"name": ..., "arguments":
  {...}}` objects inside `<tool_call>[` ... `]</tool_call>`, the calls separated by ",\\n";
- an assistant message's earlier `tool_calls` are rendered back in that form, and a
  `tool` message's result as a user message inside `<tool_response></tool_response>`
  (`history_content`).
The grammar that holds the model to this form is built in gateway/structured.py; the
calls are parsed back into OpenAI's `tool_calls` here (`ToolCallSplitter`). Pure
functions and one small stateful splitter: no I/O.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>["
TOOL_CALL_CLOSE = "]</tool_call>"
CALL_SEPARATOR = ",\n"


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: OpenAI's `tool_calls` entry."""

    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:  # streamed deltas name their call's position
            out = {"index": index, **out}
        return out


def calls_text(calls: Sequence[tuple[str, Any]]) -> str:
    """(name, arguments object) pairs as the model writes them."""
    body = CALL_SEPARATOR.join(json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
                               for name, args in calls)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def tools_system_prompt(definitions: Sequence[dict[str, Any]], may_answer_in_text: bool) -> str:
    """The system message that offers the tools (each definition: name, description,
    parameters) and says how to call them."""
    example = calls_text([("function_name", {"argument_name": "value"})])
    text = ("You can call functions. These are the functions you may call, described as JSON:\n"
            f"<tools>{json.dumps(list(definitions), ensure_ascii=False)}</tools>\n"
            "To call functions, reply with nothing but a JSON list of calls, each naming the function and "
            f"giving its arguments, inside <tool_call></tool_call>, like this:\n{example}")
    if may_answer_in_text:
        text += "\nIf no function fits the request, reply in plain text instead."
    return text


def with_tools(messages: Sequence[dict[str, str]], system_prompt: str) -> tuple[dict[str, str], ...]:
    """The messages with the tools' system prompt after the first system (or developer)
    message's text, or in a system message of its own before them."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {"role": "system", "content": f"{messages[0]['content']}\n\n{system_prompt}"}
        return (first, *messages[1:])
    return ({"role": "system", "content": system_prompt}, *messages)


def history_content(role: str, content: str, calls: Sequence[tuple[str, Any]]) -> dict[str, str]:
    """One earlier message as the template renders it: an assistant's calls after its
    text, a tool's result as a user message holding it."""
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    if calls:
        text = calls_text(calls)
        return {"role": role, "content": f"{content}\n{text}" if content else text}
    return {"role": role, "content": content}


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls in a whole output, or None when it is not a complete list of calls
    (an output cut short by max_tokens or a stop string)."""
    if not (text.startswith(TOOL_CALL_OPEN) and text.endswith(TOOL_CALL_CLOSE)):
        return None
    try:
        calls = json.loads(text[len(TOOL_CALL_OPEN) - 1:len(text) - len(TOOL_CALL_CLOSE) + 1])
    except ValueError:
        return None
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for call in calls:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call):
            return None
        out.append(ToolCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
    return out


class ToolCallSplitter:
    """Splits a tool-using request's output, as it arrives, into content and tool calls.

    With `may_be_text` (tool_choice "auto") the output is content as soon as it is known
    not to start with the calls' opening, and passes through from then on; until then it
    is held back. Otherwise (or once it starts with the opening) it is held to the end
    and parsed as calls; an output that does not parse is returned as content."""

    def __init__(self, may_be_text: bool) -> None:
        self._may_be_text = may_be_text
        self._is_text = False
        self._held = ""
        self.content = ""  # all the content returned so far

    def feed(self, text: str) -> str:
        """The content to send now, of `text` and what was held back."""
        if not self._is_text:
            self._held += text
            if not (self._may_be_text and not TOOL_CALL_OPEN.startswith(self._held[:len(TOOL_CALL_OPEN)])):
                return ""
            self._is_text = True
            text, self._held = self._held, ""
        self.content += text
        return text

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the output's end: the content still held back, and the calls."""
        calls = None if self._is_text else parse_calls(self._held)
        if calls:
            return "", calls
        rest, self._held = self._held, ""
        self.content += rest
        return rest, []
