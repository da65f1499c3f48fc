"""Fixtures for end-to-end tests: the real stack in real processes over real sockets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from e2e_helpers import CHAT_PROMPTS, COMPLETION_PROMPTS, MAX_TOKENS
from shared_stacks import MARKER, order_by_stack, stack_fixtures


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER)


@pytest.hookimpl(trylast=True)  # after the selection (-k, -m) and pytest's own reordering
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items[:] = order_by_stack(items)  # the tests of each shared stack one after another


@pytest.fixture(scope="session")
def reference_outputs(loaded_model, hf_reference):
    """transformers' greedy continuations (token ids) of the test prompts, computed once."""
    tok = loaded_model.tokenizer
    out = {}
    prompts = [("chat", p, tok.encode_chat([{"role": "user", "content": p}])) for p in CHAT_PROMPTS]
    prompts += [("completion", p, tok.encode(p)) for p in COMPLETION_PROMPTS]
    for kind, text, ids in prompts:
        with torch.no_grad():
            gen = hf_reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        max_new_tokens=MAX_TOKENS, do_sample=False)
        new = gen[0, len(ids):].tolist()
        out[(kind, text)] = {"prompt_ids": ids, "token_ids": new, "text": tok.decode(new)}
    return out


stack_pool, stack = stack_fixtures(Path(__file__).resolve().parent)
