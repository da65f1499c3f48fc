"""Typed results -> OpenAI response JSON (objects, stream chunks, usage); pure functions.

Shapes follow OpenAI's API reference: chat objects are "chat.completion" /
"chat.completion.chunk", completions objects are "text_completion" in both modes.
When a stream includes usage, every chunk carries `"usage": null` and one last
chunk with empty `choices` carries the counts, as OpenAI sends it; with vLLM's
`continuous_usage_stats` every chunk carries the counts so far instead of null.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lamina.gateway.tool_calls import ToolCall

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt's, served by the prefix cache

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def to_responses_json(self) -> dict[str, Any]:
        """The same counts as the Responses API names them (no reasoning tokens here)."""
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass(frozen=True)
class ResponseHead:
    """What every object and chunk of one response repeats."""

    id: str
    created: int
    model: str


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def chat_completion(head: ResponseHead, text: str, finish_reason: str, usage: Usage,
                    logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": head.id,
        "object": "chat.completion",
        "created": head.created,
        "model": head.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }],
        "usage": usage.to_json(),
    }


def chat_chunk(head: ResponseHead, delta: dict[str, str], finish_reason: str | None,
               include_usage: bool, usage: Usage | None = None, logprobs: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": head.id,
        "object": "chat.completion.chunk",
        "created": head.created,
        "model": head.model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None if usage is None else usage.to_json()
    return chunk


def add_tool_calls(choice: dict[str, Any], calls: Sequence[ToolCall]) -> None:
    """A chat choice whose output held tool calls: its message's `tool_calls`, and
    `content` null when there is no text besides them (as OpenAI sends it)."""
    message = choice["message"]
    message["content"] = message["content"] or None
    message["tool_calls"] = [c.to_json() for c in calls]


def tool_call_delta(index: int, call: ToolCall) -> dict[str, Any]:
    """A streamed chunk's delta that brings one whole tool call (`index`: its position)."""
    return {"tool_calls": [call.to_json(index)]}


def chat_usage_chunk(head: ResponseHead, usage: Usage) -> dict[str, Any]:
    return {
        "id": head.id,
        "object": "chat.completion.chunk",
        "created": head.created,
        "model": head.model,
        "choices": [],
        "usage": usage.to_json(),
    }


def text_completion(head: ResponseHead, text: str, finish_reason: str, usage: Usage,
                    logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": head.id,
        "object": "text_completion",
        "created": head.created,
        "model": head.model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
        "usage": usage.to_json(),
    }


def text_chunk(head: ResponseHead, text: str, finish_reason: str | None, include_usage: bool,
               usage: Usage | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": head.id,
        "object": "text_completion",
        "created": head.created,
        "model": head.model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None if usage is None else usage.to_json()
    return chunk


def text_usage_chunk(head: ResponseHead, usage: Usage) -> dict[str, Any]:
    return {
        "id": head.id,
        "object": "text_completion",
        "created": head.created,
        "model": head.model,
        "choices": [],
        "usage": usage.to_json(),
    }


def model_list(model: str, created: int, context_length: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created, context_length)]}


def model_card(model: str, created: int, context_length: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "lamina",
            "max_model_len": context_length}
