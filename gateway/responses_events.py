"""The Responses API's output: the response object, its output items, and the server-sent
events of a streamed response; pure builders.

Shapes follow OpenAI's API reference (and what the official client's `responses.stream`
accumulates): a response is `{"id": "resp_...", "object": "response", "status", "output":
[items], "usage", ...}` repeating the request's settings; its output is one `message` item
(`content: [{"type": "output_text", "text", "annotations": []}]`) or, when the model
called tools, one `function_call` item per call (`call_id`, `name`, `arguments`). A
response cut by `max_output_tokens` is `"incomplete"`, its `incomplete_details.reason`
`"max_output_tokens"`.

A stream is `event: TYPE\\ndata: JSON\\n\\n` events, numbered by `sequence_number` from 0:
`response.created`, `response.in_progress`; for the text, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`s, `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`; for each call,
`response.output_item.added`, `response.function_call_arguments.delta` (the whole
arguments: calls come whole), `response.function_call_arguments.done`,
`response.output_item.done`; then `response.completed` (or `response.incomplete`, or
`response.failed` when the backend fails or the server shuts down mid-stream). There is
no `[DONE]` line.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lamina.gateway.responses import Usage
from lamina.gateway.tool_calls import ToolCall


@dataclass(frozen=True)
class ResponseHead:
    """What every state of one response repeats: its id, creation, model and the
    request's settings (instructions, tools, tool_choice, text, temperature, ...)."""

    id: str
    created_at: int
    model: str
    settings: dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def finish_status(finish_reason: str | None) -> str:
    """A finished generation's response status: cut by the token limit, or complete."""
    return "incomplete" if finish_reason == "length" else "completed"


def response_object(head: ResponseHead, status: str, output: Sequence[dict[str, Any]],
                    usage: Usage | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """`status`: "in_progress", "completed", "incomplete" (cut by max_output_tokens) or "failed"."""
    return {
        "id": head.id,
        "object": "response",
        "created_at": head.created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": head.model,
        "output": list(output),
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "truncation": "disabled",
        "usage": None if usage is None else usage.to_responses_json(),
        **head.settings,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The assistant's message; `text` None: no content part yet (a stream's first state)."""
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text)]}


def function_call_item(item_id: str, call: ToolCall, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.id, "name": call.name,
            "arguments": arguments}


def output_items(text: str, calls: Sequence[ToolCall], status: str) -> list[dict[str, Any]]:
    """A finished generation's output: its text as a message (even empty, unless there are
    calls), then its calls."""
    items = [function_call_item(new_id("fc"), c, c.arguments, "completed") for c in calls]
    if text or not calls:
        items.insert(0, message_item(new_id("msg"), text, "incomplete" if status == "incomplete" else "completed"))
    return items


def sse(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class ResponseEvents:
    """The events of one streamed response, numbered in order, and the output they build.

    Call `start`, then `text` for each piece of content as it comes, then `finish` once
    (or `fail`, at any point after `start`). The message item opens at the first text
    (or at `finish`, empty, when there is neither text nor calls)."""

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.output: list[dict[str, Any]] = []  # the items done
        self._sequence_number = 0
        self._message_id: str | None = None  # the open message item's
        self._text = ""

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self._sequence_number}
        self._sequence_number += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        response = response_object(self.head, "in_progress", [], None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def text(self, delta: str) -> list[dict[str, Any]]:
        if not delta:
            return []
        events = self._open_message()
        self._text += delta
        assert self._message_id is not None
        events.append(self._event("response.output_text.delta", item_id=self._message_id,
                                  output_index=len(self.output), content_index=0, delta=delta, logprobs=[]))
        return events

    def finish(self, calls: Sequence[ToolCall], finish_reason: str | None, usage: Usage
               ) -> list[dict[str, Any]]:
        status = finish_status(finish_reason)
        events = self._open_message() if not calls and self._message_id is None else []
        events += self._close_message("incomplete" if status == "incomplete" else "completed")
        for call in calls:
            index, item_id = len(self.output), new_id("fc")
            events += [
                self._event("response.output_item.added", output_index=index,
                            item=function_call_item(item_id, call, "", "in_progress")),
                self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                            delta=call.arguments),
                self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                            arguments=call.arguments),
            ]
            item = function_call_item(item_id, call, call.arguments, "completed")
            self.output.append(item)
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        events.append(self._event(kind, response=response_object(self.head, status, self.output, usage)))
        return events

    def fail(self, message: str, usage: Usage) -> list[dict[str, Any]]:
        """The response failed (the backend, or shutdown): its output so far, the open
        message as "incomplete", and the error."""
        output = list(self.output)
        if self._message_id is not None:
            output.append(message_item(self._message_id, self._text, "incomplete"))
        error = {"code": "server_error", "message": message}
        return [self._event("response.failed", response=response_object(self.head, "failed", output, usage, error))]

    def _open_message(self) -> list[dict[str, Any]]:
        if self._message_id is not None:
            return []
        self._message_id = new_id("msg")
        index = len(self.output)
        return [
            self._event("response.output_item.added", output_index=index,
                        item=message_item(self._message_id, None, "in_progress")),
            self._event("response.content_part.added", item_id=self._message_id, output_index=index,
                        content_index=0, part=text_part("")),
        ]

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        if self._message_id is None:
            return []
        item_id, index = self._message_id, len(self.output)
        item = message_item(item_id, self._text, status)
        self.output.append(item)
        self._message_id = None
        return [
            self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                        text=self._text, logprobs=[]),
            self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                        part=text_part(self._text)),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
