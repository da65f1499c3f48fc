"""Token ids -> the text a client sees: incremental detokenization and stop strings.

One `OutputProcessor` per request. It releases text as soon as it is certain:
a delta that might be the start of a stop string is held back until the next
tokens show whether it is one. When a stop string appears, the text is cut just
before it and `stopped` is set; the caller then aborts the backend request.

By default (vLLM's defaults) special tokens (EOS) never reach the text: the
detokenizer skips them, and the token that made the backend stop ("stop" on EOS
or a stop token id) is not detokenized at all, so a stop token id that is an
ordinary token is not shown. vLLM's two output options change that:
`skip_special_tokens=False` shows special tokens' text, and
`include_stop_str=True` (`include_stop_str_in_output`) keeps the stop string at
the end of the text and detokenizes the stop token (shown if it is an ordinary
token, or a special one with `skip_special_tokens=False`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lamina.model.tokenizer import Tokenizer


class StopStringMatcher:
    """Finds the first stop string in a growing text; pure string logic, no tokens."""

    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        """`include_stop`: the text ends with the stop string found, instead of just before it."""
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self.released = ""  # text certainly free of stop strings
        self._pending = ""  # text after `released` that may begin a stop string
        self.stopped = False

    def feed(self, delta: str, match: bool = True) -> str:
        """Add text; return the part that is now safe to release. With `match` False (a
        request's first min_tokens tokens) the text is released unsearched, as vLLM does."""
        if self.stopped or not delta:
            return ""
        if not match:
            out, self._pending = self._pending + delta, ""
            self.released += out
            return out
        if not self._stop:
            self.released += delta
            return delta
        full = self._pending + delta
        # No stop string can start inside `released`: a suffix of it that was a
        # stop-string prefix would have been held in `_pending` instead.
        hits = [(i, len(s)) for i, s in ((full.find(s), s) for s in self._stop) if i != -1]
        if hits:
            at, length = min(hits, key=lambda hit: hit[0])  # the earliest; at a tie, the first listed
            out = full[: at + length if self._include_stop else at]
            self.stopped = True
            self._pending = ""
        else:
            hold = self._held_back_length(full)
            out = full[: len(full) - hold]
            self._pending = full[len(out):]
        self.released += out
        return out

    def flush(self) -> str:
        """At the end of generation: release what was held back."""
        out, self._pending = self._pending, ""
        self.released += out
        return out

    def _held_back_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], stop_token_ids: Iterable[int],
                 min_tokens: int = 0, include_stop_str: bool = False, skip_special_tokens: bool = True) -> None:
        """`min_tokens`: stop strings count only in the text of later tokens (vLLM's rule).
        `include_stop_str`, `skip_special_tokens`: vLLM's output options (module docstring)."""
        self._min_tokens = min_tokens
        self._detok = tokenizer.detokenizer(skip_special_tokens)
        self._matcher = StopStringMatcher(stop, include_stop_str)
        # With include_stop_str the stop token is detokenized like any other.
        self._stop_token_ids = frozenset() if include_stop_str else frozenset(stop_token_ids)
        self.token_ids: list[int] = []  # every generated id, the final EOS or stop id included

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def stopped(self) -> bool:
        """True once a stop string appeared; the text is final."""
        return self._matcher.stopped

    @property
    def text(self) -> str:
        return self._matcher.released

    def add(self, token_ids: Sequence[int], finish_reason: str | None) -> str:
        """Take a backend event's tokens; return the text delta to send (maybe empty)."""
        first = len(self.token_ids)  # how many tokens came before these
        self.token_ids.extend(token_ids)
        ids = token_ids
        if finish_reason == "stop" and ids and ids[-1] in self._stop_token_ids:
            ids = ids[:-1]
        out = []
        for i, t in enumerate(ids):
            if self._matcher.stopped:
                break
            out.append(self._matcher.feed(self._detok.add(t), match=first + i + 1 > self._min_tokens))
        if finish_reason is not None and not self._matcher.stopped:
            out.append(self._matcher.flush())
        return "".join(out)
