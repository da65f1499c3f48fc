"""Fixtures for the gateway tests: the real SmolLM2 tokenizer and scripted backends."""

from __future__ import annotations

import pytest
from gateway_helpers import SCRIPT_TEXT, ScriptedBackend

from lamina.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    from lamina.model.loader import load_model

    return load_model().tokenizer


@pytest.fixture
def script_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(SCRIPT_TEXT)


@pytest.fixture
def make_backend(tokenizer: Tokenizer, script_ids: list[int]):
    def make(**kwargs) -> ScriptedBackend:
        return ScriptedBackend(script_ids, tokenizer.eos_token_ids[0], **kwargs)
    return make
