"""Fault tests: the real stack in real processes, with workers killed, stopped or fed
hostile input. They start stacks the way the end-to-end tests do (tests/e2e)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# e2e_helpers (start_stack, the prompts, attention_stats) and the e2e fixtures' helpers.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from fault_helpers import greedy_references  # noqa: E402 (after the path it needs)


@pytest.fixture(scope="session")
def references(loaded_model, hf_reference) -> list[str]:
    """transformers' greedy continuations of PROMPTS as chat, decoded."""
    return greedy_references(loaded_model, hf_reference)


def pytest_collection_modifyitems(config, items):
    # Everything here is slow and kills processes: `make test-faults` runs it (CI too),
    # `make test` leaves it out.
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.faults)
