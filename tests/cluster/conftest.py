"""Hosts tests: the stack spread over network namespaces (netns.py), one per service,
with links cut, slowed and healed under load. Root only; `make test-hosts` runs them
(CI too), `make test` leaves them out."""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_helpers import greedy_references
from netns import missing


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.hosts)


@pytest.fixture(scope="session")
def hosts_missing() -> str | None:
    return missing()


@pytest.fixture(autouse=True)
def _needs_hosts(hosts_missing):
    if hosts_missing:
        pytest.skip(f"hosts tests: {hosts_missing}")


@pytest.fixture(scope="session")
def references(loaded_model, hf_reference) -> list[str]:
    """transformers' greedy continuations of fault_helpers.PROMPTS as chat, decoded."""
    return greedy_references(loaded_model, hf_reference)
