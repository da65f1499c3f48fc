"""Token log-probabilities -> OpenAI's JSON shapes; pure functions of their arguments.

Chat: `choices[i].logprobs = {"content": [{"token", "bytes", "logprob", "top_logprobs":
[{"token", "bytes", "logprob"}]}], "refusal": null}`. Completions (the legacy shape):
`{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`, where
each `top_logprobs` entry also holds the sampled token (OpenAI: "up to logprobs + 1
elements"). A token's text is its own decoding, special tokens included (`<|im_end|>`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lamina.gateway.protocol import TokenLogprobs

# JSON has no -Infinity; OpenAI and vLLM send this floor instead.
MIN_LOGPROB = -9999.0

TokenText = Callable[[int], str]


def _floor(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": _floor(logprob)}


def chat_logprobs(entries: Sequence[TokenLogprobs], token_text: TokenText) -> dict[str, Any]:
    return {"content": [{**_entry(token_text(e.token_id), e.logprob),
                         "top_logprobs": [_entry(token_text(t), v) for t, v in e.top]} for e in entries],
            "refusal": None}


class CompletionLogprobs:
    """A completions response's logprobs, one piece per chunk: `text_offset` (each token's
    offset in the completion's text) runs on from one piece to the next."""

    def __init__(self, token_text: TokenText, offset: int = 0) -> None:
        self._token_text = token_text
        self.offset = offset

    def take_prompt(self, prompt_ids: Sequence[int], entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """An echoed prompt's: its first token has no context to score it, so its
        logprob and alternatives are null (as OpenAI sends them); `entries` score the rest."""
        text = self._token_text(prompt_ids[0])
        first = {"tokens": [text], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [self.offset]}
        self.offset += len(text)
        rest = self.take(entries)
        return {key: first[key] + rest[key] for key in first}

    def take(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for e in entries:
            text = self._token_text(e.token_id)
            alternatives = {self._token_text(t): _floor(v) for t, v in e.top}
            alternatives.setdefault(text, _floor(e.logprob))
            tokens.append(text)
            token_logprobs.append(_floor(e.logprob))
            top.append(alternatives)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
