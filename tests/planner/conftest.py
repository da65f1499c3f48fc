"""Small factories for planner tests: the catalogue, shapes and workloads."""

from __future__ import annotations

import pytest

from lamina.planner.hardware import load_catalogue


@pytest.fixture(scope="session")
def catalogue():
    return load_catalogue()
