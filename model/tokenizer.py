"""The checkpoint's tokenizer and chat template, applied as transformers applies them."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lamina.model.config import ModelConfig
from lamina.model.errors import CheckpointError

ChatMessage = dict[str, Any]  # {"role": ..., "content": ...}


class Tokenizer:
    """Wraps a transformers fast tokenizer loaded from a checkpoint directory."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self._tok = hf_tokenizer
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.has_chat_template = bool(getattr(hf_tokenizer, "chat_template", None))

    @classmethod
    def from_dir(cls, directory: Path, cfg: ModelConfig) -> Tokenizer:
        if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise CheckpointError(directory, "no tokenizer.json or tokenizer_config.json in the checkpoint directory")
        try:
            tok = _tokenizer_class(directory).from_pretrained(str(directory))
        except Exception as exc:
            raise CheckpointError(directory, f"tokenizer could not be loaded: {exc}") from exc
        eos = list(cfg.eos_token_ids)
        if tok.eos_token_id is not None:
            eos.append(int(tok.eos_token_id))
        return cls(tok, eos)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer itself (llguidance builds its own view from it)."""
        return self._tok

    @functools.cached_property
    def max_token_chars(self) -> int:
        """No token spells more characters than this: the longest vocabulary entry (a
        byte-level entry has one character per byte, so it bounds bytes too). A text of
        more than N times this many characters therefore needs more than N tokens."""
        return max(map(len, self._tok.get_vocab()))

    def warm_up(self) -> None:
        """Make now what the first request would wait for: `max_token_chars` (a pass over
        the vocabulary, 70 ms for SmolLM2's 49,152 entries) and the chat template's
        compiled form (transformers compiles it at its first use)."""
        _ = self.max_token_chars
        self.decode(self.encode("Hello"))
        if self.has_chat_template:
            self.encode_chat([{"role": "user", "content": "Hello"}])

    def encode(self, text: str) -> list[int]:
        """Token ids with the special tokens the checkpoint adds by default (e.g. BOS)."""
        return list(self._tok(text)["input_ids"])

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use the completions API")
        return self._tok.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        # The rendered template already holds its special tokens; transformers
        # encodes it without adding more, and so do we.
        text = self.render_chat(messages, add_generation_prompt)
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tok.convert_ids_to_tokens(int(token_id))

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


# The classes AutoTokenizer maps to transformers' generic tokenizers.json backend (one class
# under two names), which carries no model-specific behaviour.
_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    """The checkpoint's tokenizer_config.json ({} where it is missing, unreadable or not an
    object: transformers then decides, and reports what is wrong)."""
    try:
        named = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return named if isinstance(named, dict) else {}


def _tokenizer_class(directory: Path) -> Any:
    """The class AutoTokenizer would load `directory` with. A checkpoint that names the
    generic backend (every GGUF conversion and random model here does) gets it directly:
    AutoTokenizer's module imports torch, which costs the gateway and the scheduler, which
    hold no tensors, about 3 s of CPU at every start. Any other class goes through
    AutoTokenizer."""
    if _tokenizer_config(directory).get("tokenizer_class") in _GENERIC_CLASSES:
        from transformers import TokenizersBackend

        return TokenizersBackend
    from transformers import AutoTokenizer

    return AutoTokenizer


def eos_token_ids(directory: Path, cfg: ModelConfig) -> tuple[int, ...]:
    """`Tokenizer.from_dir(directory, cfg).eos_token_ids`, read with the tokenizers library
    alone where the checkpoint names transformers' generic backend and its
    tokenizer_config.json spells its EOS token (the backend's eos_token_id is that token's
    id in tokenizer.json). A service that needs no more of the tokenizer (the scheduler)
    then skips transformers' import, seconds of CPU at its every start. Any other
    checkpoint has its tokenizer loaded whole."""
    named = _tokenizer_config(directory)
    eos = named.get("eos_token")
    if isinstance(eos, dict):  # an AddedToken, as transformers saves one
        eos = eos.get("content")
    if named.get("tokenizer_class") not in _GENERIC_CLASSES or not isinstance(eos, str) \
            or not (directory / "tokenizer.json").is_file():
        return Tokenizer.from_dir(directory, cfg).eos_token_ids
    from tokenizers import Tokenizer as Vocabulary

    try:
        token_id = Vocabulary.from_file(str(directory / "tokenizer.json")).token_to_id(eos)
    except Exception as exc:  # the tokenizers library raises its own exception types
        raise CheckpointError(directory, f"tokenizer could not be loaded: {exc}") from exc
    if token_id is None:  # not in the vocabulary: transformers decides what it means
        return Tokenizer.from_dir(directory, cfg).eos_token_ids
    return tuple(dict.fromkeys([*cfg.eos_token_ids, token_id]))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    Decoding ids one at a time splits multi-byte characters and drops the
    spaces some tokenizers attach when decoding; decoding a short window of
    recent ids and emitting what the newest ids added avoids both. A delta is
    held back while it ends in an incomplete character (U+FFFD).
    """

    _WINDOW = 6

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens  # False: special tokens' text (e.g. EOS) is shown
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # ids before this are already emitted

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix = self._tok.decode(self.ids[self._prefix_offset : self._read_offset], self._skip_special)
        full = self._tok.decode(self.ids[self._prefix_offset :], self._skip_special)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self._read_offset = len(self.ids)
        self._prefix_offset = max(0, self._read_offset - self._WINDOW)
        return delta
