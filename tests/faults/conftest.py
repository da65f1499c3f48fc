"""Fault tests: the real stack in real processes, with workers killed, stopped or fed
hostile input. They start stacks the way the end-to-end tests do (tests/e2e); those fed
hostile input share one (fault_helpers.ONE_WORKER), stopped after the last of them."""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_helpers import greedy_references
from shared_stacks import MARKER, order_by_stack, stack_fixtures


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER)


@pytest.fixture(scope="session")
def references(loaded_model, hf_reference) -> list[str]:
    """transformers' greedy continuations of PROMPTS as chat, decoded."""
    return greedy_references(loaded_model, hf_reference)


def pytest_collection_modifyitems(config, items):
    # Everything here is slow and kills processes: `make test-faults` runs it (CI too),
    # `make test` leaves it out. (Before the selection by -m: not trylast.)
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.faults)
    items[:] = order_by_stack(items)  # the tests of each shared stack one after another


stack_pool, stack = stack_fixtures(Path(__file__).resolve().parent)
